"""Steady-state samples/s, tokens/s, step time and MFU of a training run, global over ranks."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from hfscale.callbacks.base import _batch_counts, _rank_and_world, _SummaryCallback, _write_json
from hfscale.callbacks.timing import _CudaEventTimer, _percentile, _PerfCounterTimer
from hfscale.core.collective import all_gather_object
from hfscale.measure.flops import (
    GradientFlowProbe,
    compute_dtype,
    matmul_parameters,
    mfu,
    model_shape,
    peak_flops_per_s,
    transformer_flops_per_token,
)
from hfscale.measure.readback import LinearDtypeProbe
from hfscale.measure.warmup import MIN_STEPS, WarmupDetection, detect_warmup
from hfscale.records.measurements import ThroughputSummary
from hfscale.techniques.mesh import shared_batch

logger = logging.getLogger(__name__)


def _device_name(device: Any) -> str:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or dev.type


class ThroughputCallback(_SummaryCallback):
    """Steady-state samples/s, tokens/s, step time and MFU of a training run, global over ranks.

    A step is one optimizer step (all its gradient-accumulation micro-batches); its time runs from the end of the
    previous optimizer step to the end of this one (``on_optimizer_step``, right after ``optimizer.step()``), so
    data loading and loss logging are included. The boundary is taken before any callback's ``on_step_end`` runs,
    so end-of-training work (this and other callbacks' summaries, gathered over ranks and logged at the last
    step's end) is never inside a timed step, whatever the callbacks' order. A loop that never calls
    ``on_optimizer_step`` is timed at ``on_step_end`` instead. The
    first ``warmup_steps`` steps are left out, and so are steps that contain an evaluation or a checkpoint save.
    Samples and tokens are counted from the batches the model really receives (a forward pre-hook reads the
    shape of ``input_ids``; no device synchronisation), so a last partial batch counts what it held; the
    configured figure (batch x accumulation x world size) is kept beside it and a mismatch is logged.

    ``warmup_steps="auto"`` reads the warm-up from the run instead of assuming it: after training,
    :func:`hfscale.measure.warmup.detect_warmup` (MSER) runs on the times (the slowest rank's) of the steps no
    evaluation or save interrupted, and the steps up to the detected end are left out as a fixed warm-up of that
    length would be. The summary's ``warmup_steps`` holds that count, ``warmup_detected`` is True, and
    ``steady_state`` is False (with a warning) when the end falls in the second half of the run: the step times were
    still falling or drifting (on a short run MSER sometimes calls a steady run unsteady: docs/callbacks.md gives
    the rates).

    Across ranks, each step's time is the slowest rank's, and samples and tokens are summed over ranks.
    MFU = tokens/s x FLOPs per token / (peak FLOP/s x world size), with FLOPs per token from
    :mod:`hfscale.measure.flops` (``6 * N + 12 * L * H * T``, PaLM appendix B; N without embedding tables, the output
    head counted, tied or not; ``H`` query heads x head dimension; activation recomputation is not useful work and is
    not counted; the whole model's N under FSDP1, counted on a meta-device copy, not this rank's shard; for a
    partly frozen model (LoRA) the work its first training forward showed needs no gradient is taken off,
    :class:`hfscale.measure.flops.GradientFlowProbe`) and the peak from
    :data:`hfscale.measure.flops.DEVICE_PEAK_FLOPS` for the device name and the compute dtype (bf16/fp16/tf32/fp32): the
    dtype an ``nn.Linear`` really produced in the first training forward, so a model loaded in bf16 without
    ``args.bf16`` is divided by the bf16 peak. On CPU the peak is unknown: MFU is None unless ``peak_flops`` is
    given.

    Too few steps: when training has fewer than ``warmup_steps + 2`` optimizer steps, a warning is logged at train
    begin, and the figures that need measured steps are None (the run is not stopped: memory figures and the
    Trainer's own results are still worth having). Under ``"auto"`` the warning comes below the
    :data:`~hfscale.measure.warmup.MIN_STEPS` = 4 steps a warm-up is detected on: nothing is then left out, and
    ``steady_state`` is False.

    Logged once, at the end of the last step, through ``Trainer.log``:

    =================================== ========================================================================
    ``throughput/samples_per_s``        samples per second, all ranks
    ``throughput/tokens_per_s``         input tokens per second, all ranks
    ``throughput/step_time_median_s``   median optimizer-step time
    ``throughput/step_time_p90_s``      90th percentile optimizer-step time
    ``throughput/step_time_mean_s``     mean optimizer-step time
    ``throughput/mfu``                  model FLOPs utilisation (where the peak is known)
    ``throughput/measured_steps``       steps in the figures
    ``throughput/samples_per_step``     samples per optimizer step, all ranks
    ``throughput/warmup_steps``         leading steps left out (``"auto"`` only: the detected warm-up)
    ``throughput/steady_state``         1 when the run reached a steady state, else 0 (``"auto"`` only)
    =================================== ========================================================================

    After training, ``summary`` holds a :class:`ThroughputSummary` (on every rank).

    Args:
        warmup_steps: optimizer steps left out at the start (compilation, allocator growth, caches), or
            ``"auto"`` to detect them from the run's step times.
        peak_flops: one device's peak FLOP/s, overriding the table (and giving an MFU on CPU).
        flops_per_token: model FLOPs per trained token, overriding the formula.
        output_path: where the main process writes ``summary.to_dict()`` as JSON; None writes nothing.

    Raises:
        ValueError: for a ``warmup_steps`` that is neither an integer >= 0 nor ``"auto"``, or a non-positive
            ``peak_flops`` / ``flops_per_token``.
    """

    def __init__(
        self,
        warmup_steps: int | Literal["auto"] = 5,
        *,
        peak_flops: float | None = None,
        flops_per_token: float | None = None,
        output_path: str | os.PathLike[str] | None = None,
    ) -> None:
        fixed = isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps >= 0
        if not fixed and warmup_steps != "auto":
            raise ValueError(f'warmup_steps: expected an integer >= 0 or "auto", got {warmup_steps!r}')
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops: expected a positive FLOP/s figure, got {peak_flops!r}")
        if flops_per_token is not None and not flops_per_token > 0:
            raise ValueError(f"flops_per_token: expected a positive number, got {flops_per_token!r}")
        self.warmup_steps = warmup_steps
        self.peak_flops = peak_flops
        self.flops_per_token = flops_per_token
        self.output_path = output_path
        self.summary: ThroughputSummary | None = None

    # -- events ------------------------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        import torch

        self._begin_run(model)
        self.summary = None
        self._remove_hook()
        self._samples: list[int] = []
        self._tokens: list[int] = []
        self._interrupted: list[bool] = []
        self._acc_samples = 0
        self._acc_tokens = 0
        self._real: list[Any] = []
        self._acc_real: Any = None
        self._dirty = False
        self._model_shape: tuple[int, int, int] | None = None
        self._frozen_params = 0
        self._marked_step = False
        self._dtype_probe: LinearDtypeProbe | None = None
        self._flow_probe: GradientFlowProbe | None = None
        if model is not None:
            self._hook = model.register_forward_pre_hook(self._count_batch, with_kwargs=True)
            self._model_shape = _model_shape(model)
            self._frozen_params = matmul_parameters(model, frozen_only=True)  # LoRA's base: no weight grads
            self._dtype_probe = LinearDtypeProbe(model)
            frozen = any(not p.requires_grad for p in model.parameters())  # LoRA's base, or frozen embeddings
            if frozen and not getattr(args, "torch_compile", False):
                # Upstream of the first trainable parameter no gradient flows: read where, once (hooks would be
                # traced into a compiled graph, so not under torch_compile).
                self._flow_probe = GradientFlowProbe(model)
        self._warn_if_short(state.max_steps - state.global_step)  # a resumed run has only the steps left
        on_cuda = torch.device(args.device).type == "cuda"
        self._timer: _PerfCounterTimer | _CudaEventTimer = _CudaEventTimer() if on_cuda else _PerfCounterTimer()
        self._timer.mark()

    def _warn_if_short(self, max_steps: int) -> None:
        if isinstance(self.warmup_steps, int):
            if max_steps < self.warmup_steps + 2:
                logger.warning(
                    "ThroughputCallback: training has %d optimizer steps to run, fewer than warmup_steps + 2 = %d: "
                    "throughput figures will be None; train longer or lower warmup_steps",
                    max_steps,
                    self.warmup_steps + 2,
                )
        elif max_steps < MIN_STEPS:
            logger.warning(
                "ThroughputCallback: training has %d optimizer steps to run, fewer than the %d a warm-up is detected "
                'on (warmup_steps="auto"): no step will be left out and steady_state will be False; train longer or '
                "give warmup_steps as a number",
                max_steps,
                MIN_STEPS,
            )

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._dirty = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._dirty = True

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(self, "_finished", True):
            return
        self._end_step()
        self._marked_step = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(self, "_finished", True):
            return
        if not self._marked_step:  # a loop without on_optimizer_step
            self._end_step()
        self._marked_step = False
        super().on_step_end(args, state, control, **kwargs)

    def _end_step(self) -> None:
        self._timer.mark()
        self._samples.append(self._acc_samples)
        self._tokens.append(self._acc_tokens)
        self._real.append(self._acc_real)
        self._acc_real = None
        self._interrupted.append(self._dirty)
        self._acc_samples = self._acc_tokens = 0
        self._dirty = False

    # -- measurement -------------------------------------------------------------------------------------------

    def _count_batch(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Runs before every forward of the model: a dict lookup and a shape read, about a microsecond.
        if not module.training:
            return
        samples, tokens = _batch_counts(args, kwargs)
        self._acc_samples += samples
        self._acc_tokens += tokens
        mask = kwargs.get("attention_mask")
        if tokens and mask is not None and hasattr(mask, "sum") and len(getattr(mask, "shape", ())) == 2:
            # Summed on the device and read once after training: no synchronisation inside a step.
            real = mask.detach().sum()
            self._acc_real = real if self._acc_real is None else self._acc_real + real

    def _remove_hook(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        self._hook = None

    def _flops_per_token(self, tokens_per_sample: float | None) -> float | None:
        """The given figure, else the formula for the model at the measured tokens per sample (None without one)."""
        if self.flops_per_token is not None or self._model_shape is None or tokens_per_sample is None:
            return self.flops_per_token
        params, layers, width = self._model_shape
        flow = self._flow_probe.flow if self._flow_probe is not None else None
        if flow is not None and flow.no_input_grad_params > params:  # a shard's N (FSDP1): leave the formula
            flow = None
        return transformer_flops_per_token(
            non_embedding_params=params,
            num_layers=layers,
            attention_width=width,
            seq_len=tokens_per_sample,
            frozen_params=min(self._frozen_params, params),
            flow=flow,
        )

    def _finish(self, args: Any, state: Any, control: Any) -> None:
        if getattr(self, "_finished", True):
            return
        self._finished = True
        self._remove_hook()
        if self._dtype_probe is not None:
            self._dtype_probe.remove()
        if self._flow_probe is not None:
            self._flow_probe.remove()
        durations = self._timer.durations_s()
        n = min(len(durations), len(self._samples))
        rank, world = _rank_and_world()
        rows = all_gather_object(
            {
                "rank": rank,
                "durations": durations[:n],
                "samples": self._samples[:n],
                "tokens": self._tokens[:n],
                "real_tokens": _read_counts(self._real[:n]),
                "interrupted": self._interrupted[:n],
            }
        )
        self.summary = self._summarise(args, rows, world)
        self._log(control, self.summary.log_dict())
        if self.output_path is not None and state.is_world_process_zero:
            _write_json(self.output_path, self.summary.to_dict())

    def _summarise(self, args: Any, rows: list[dict[str, Any]], world: int) -> ThroughputSummary:
        # Ranks of one tensor/context/sequence-parallel group see the same samples
        # (hfscale.techniques.mesh.shared_batch).
        samples_shared, tokens_shared = shared_batch()
        steps = _combine_ranks(rows, samples_shared, tokens_shared)
        n = len(steps.step_s)
        accumulation = int(getattr(args, "gradient_accumulation_steps", 1))
        configured = int(args.train_batch_size) * accumulation * world // samples_shared
        samples = _counted_or_configured(steps.samples, configured)
        warmup, detection = self._warmup(steps)
        measured = [k for k in range(n) if k >= warmup and not steps.interrupted[k]]
        samples_per_step = max(samples) if samples else None
        if samples_per_step is not None and samples_per_step != configured:
            logger.warning(
                "ThroughputCallback: the batches held %d samples per optimizer step, the arguments say %d "
                "(per-device batch x accumulation x world size); the figures use what the batches held",
                samples_per_step,
                configured,
            )
        observed = self._dtype_probe.output_dtype if self._dtype_probe is not None else None
        dtype = compute_dtype(args, observed=observed)
        device_name = _device_name(args.device)
        common: dict[str, Any] = dict(
            warmup_steps=warmup,
            warmup_detected=detection is not None,
            steady_state=detection.steady if detection is not None else None,
            samples_per_step=samples_per_step,
            world_size=world,
            peak_flops_per_s=self.peak_flops if self.peak_flops is not None else peak_flops_per_s(device_name, dtype),
            device_name=device_name,
            compute_dtype=dtype,
            timer=self._timer.kind,
            total_steps=n,
            interrupted_steps=sum(steps.interrupted[warmup:]),
            samples_per_step_configured=configured,
            first_step_s=steps.step_s[0] if n else None,  # compilation lands here under torch.compile
        )
        if len(measured) >= 2:
            return self._figures(args, steps, samples, measured, common)
        logger.warning(
            "ThroughputCallback: %d optimizer steps timed, %d after %d warm-up steps; at least 2 are needed, so "
            "the throughput figures are None",
            n,
            len(measured),
            warmup,
        )
        return ThroughputSummary(
            samples_per_s=None,
            tokens_per_s=None,
            step_time_median_s=None,
            step_time_p90_s=None,
            step_time_mean_s=None,
            measured_steps=len(measured),
            tokens_per_sample=None,
            flops_per_token=self.flops_per_token,
            mfu=None,
            **common,
        )

    def _warmup(self, steps: _Steps) -> tuple[int, WarmupDetection | None]:
        """The leading steps to leave out: the given count, or the one detected (with its detection) under
        ``"auto"``."""
        if isinstance(self.warmup_steps, int):
            return self.warmup_steps, None
        warmup, detection = _detected_warmup(steps.step_s, steps.interrupted)
        kept = len(steps.step_s) - sum(steps.interrupted)
        if kept < MIN_STEPS:
            logger.warning(
                "ThroughputCallback: %d uninterrupted optimizer steps, fewer than the %d a warm-up is detected on: "
                "no step is left out and steady_state is False",
                kept,
                MIN_STEPS,
            )
        elif not detection.steady:
            logger.warning(
                "ThroughputCallback: the run did not reach a steady state: the step times settle only after %d of "
                "its %d uninterrupted steps (%s), past half the run, so the figures describe a run still warming up "
                "or drifting; train longer",
                detection.steps,
                kept,
                detection.method,
            )
        return warmup, detection

    def _figures(
        self, args: Any, steps: _Steps, samples: list[int], measured: list[int], common: dict[str, Any]
    ) -> ThroughputSummary:
        """The summary over the ``measured`` steps (two or more): rates, step-time statistics and MFU."""
        times = [steps.step_s[k] for k in measured]
        total_time = sum(times)
        total_samples = sum(samples[k] for k in measured)
        total_tokens = sum(steps.tokens[k] for k in measured)
        tokens_per_s = total_tokens / total_time if total_tokens else None
        real = [steps.real_tokens[k] for k in measured]
        real_tokens_per_s = sum(real) / total_time if real and None not in real else None
        tokens_per_sample = total_tokens / total_samples if total_tokens and total_samples else None
        fpt = self._flops_per_token(tokens_per_sample)
        peak = common["peak_flops_per_s"]
        utilisation = None
        if fpt is not None and peak is not None and tokens_per_s is not None:
            # One process drives n_gpu devices under nn.DataParallel (n_gpu is 1 per process in DDP, 0 on CPU).
            devices = common["world_size"] * max(1, int(getattr(args, "n_gpu", 1) or 1))
            utilisation = mfu(
                tokens_per_s=tokens_per_s, flops_per_token=fpt, peak_flops_per_s=peak, num_devices=devices
            )
        return ThroughputSummary(
            samples_per_s=total_samples / total_time,
            tokens_per_s=tokens_per_s,
            step_time_median_s=_percentile(times, 50),
            step_time_p90_s=_percentile(times, 90),
            step_time_mean_s=total_time / len(times),
            measured_steps=len(measured),
            tokens_per_sample=tokens_per_sample,
            flops_per_token=fpt,
            mfu=utilisation,
            measured_samples=total_samples,
            measured_time_s=total_time,
            step_time_min_s=min(times),
            step_time_max_s=max(times),
            step_times_s=times,
            real_tokens_per_s=real_tokens_per_s,
            **common,
        )


@dataclass(frozen=True)
class _Steps:
    """The optimizer steps of every rank combined: each step's time is the slowest rank's; its samples and tokens
    are all ranks' (divided by the ranks that share one batch)."""

    step_s: list[float]
    samples: list[int]
    tokens: list[int]
    interrupted: list[bool]
    """Steps that held an evaluation or a checkpoint save on any rank."""
    real_tokens: list[int | None]
    """Tokens not padding (attention mask), all ranks; None for a step where a rank's batches had no mask."""


def _detected_warmup(step_s: list[float], interrupted: list[bool]) -> tuple[int, WarmupDetection]:
    """MSER on the times of the steps no evaluation or save interrupted (their time is not the training's), and
    the leading steps to leave out so that exactly the detected number of those is: an interrupted step before the
    detected end is left out with them, as a fixed warm-up of that length would leave it out."""
    kept = [k for k, cut in enumerate(interrupted) if not cut]
    detection = detect_warmup([step_s[k] for k in kept])
    return (kept[detection.steps - 1] + 1 if detection.steps else 0), detection


def _read_counts(counts: list[Any]) -> list[int | None]:
    """Per-step device counts as integers, read in one transfer (None where a step had none)."""
    import torch

    present = [c for c in counts if c is not None]
    values = iter(torch.stack(present).tolist() if present else [])
    return [None if c is None else int(next(values)) for c in counts]


def _counted_or_configured(samples: list[int], configured: int) -> list[int]:
    """The samples counted per step, or the configured figure for every step where none was counted at all."""
    if not samples or any(samples):
        return samples
    logger.warning(
        "ThroughputCallback: counted no samples in the model's inputs (no input_ids / inputs_embeds / "
        "pixel_values / labels keyword); using the configured %d samples per step",
        configured,
    )
    return [configured] * len(samples)


def _combine_ranks(rows: list[dict[str, Any]], samples_shared: int, tokens_shared: int) -> _Steps:
    """The steps all ranks timed (the shortest rank's count), combined across ranks."""
    n = min(len(r["durations"]) for r in rows)
    return _Steps(
        step_s=[max(r["durations"][k] for r in rows) for k in range(n)],
        samples=[sum(r["samples"][k] for r in rows) // samples_shared for k in range(n)],
        tokens=[sum(r["tokens"][k] for r in rows) // tokens_shared for k in range(n)],
        interrupted=[any(r["interrupted"][k] for r in rows) for k in range(n)],
        real_tokens=[_sum_or_none([r["real_tokens"][k] for r in rows], tokens_shared) for k in range(n)],
    )


def _sum_or_none(counts: list[int | None], shared: int) -> int | None:
    return None if any(c is None for c in counts) else sum(counts) // shared  # type: ignore[misc]


def _fsdp1_active(model: Any) -> bool:
    """Whether FSDP1 wraps the model: its parameters are then this rank's shard only."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return True
    try:  # the root unit alone wraps from outside, where the model's own modules do not show it
        from accelerate.state import AcceleratorState
        from accelerate.utils import DistributedType
    except ImportError:
        return False
    if not AcceleratorState._shared_state:  # no accelerate state: nothing prepared the model
        return False
    state = AcceleratorState()
    plugin = getattr(state, "fsdp_plugin", None)
    return state.distributed_type == DistributedType.FSDP and getattr(plugin, "fsdp_version", 1) == 1


def _model_shape(model: Any) -> tuple[int, int, int] | None:
    try:
        return model_shape(model, from_config=_fsdp1_active(model))
    except ValueError as exc:
        logger.warning("ThroughputCallback: no FLOPs per token, so no MFU: %s", exc)
        return None


__all__ = ["ThroughputCallback", "ThroughputSummary"]
