"""Trainer callbacks that measure peak memory and steady-state throughput, on every rank, at negligible cost.

Add them to any ``transformers.Trainer``::

    trainer = Trainer(..., callbacks=[MemoryCallback(), ThroughputCallback(warmup_steps=5)])
    trainer.train()
    trainer.callback_handler.callbacks[-1].summary.to_dict()   # or keep a reference to the callback

Each callback fills a result dataclass (``summary``) when training ends, logs it through ``Trainer.log`` (so it
lands in ``trainer.state.log_history`` and in every ``report_to`` integration: TensorBoard, W&B, ...), and writes
it as JSON when given ``output_path`` (main process only).

How a callback reaches ``Trainer.log``: the Trainer builds each log dict inside its own methods and gives callbacks
no hook in between, and the ``report_to`` integrations run before user callbacks in ``on_log``, so adding keys to
someone else's log in ``on_log`` would reach ``log_history`` but not TensorBoard/W&B. Instead, at train begin the
callback finds the Trainer that is calling it (the caller frames of the ``on_train_begin`` event, checked to be a
``transformers.Trainer`` whose handler holds this callback) and keeps a weak reference. At the end of the last
step it calls ``Trainer.log(trainer, summary)``: one log event of its own, which the Trainer appends to
``log_history`` and dispatches to every callback, exactly as its own loss logs. The ``should_log`` flag that this
event resets is restored, so the Trainer's own loss log for that step still happens. Where no Trainer is found (a
custom loop calling the hooks), the summary is still computed and written; only the log event is skipped, with a
warning.

Timing never synchronises the device on a step: on CUDA, events are recorded at step boundaries and read when
they have completed (polled every few dozen steps, waited for once at the end); on CPU, ``time.perf_counter``.
The memory callback reads the allocator only in the first optimizer step and at the end.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import TrainerCallback

from hfscale.flops import compute_dtype, mfu, model_shape, peak_flops_per_s, transformer_flops_per_token
from hfscale.memory import GIB, MemoryProbe, probe_for

logger = logging.getLogger(__name__)

MEMORY_PHASES: tuple[str, ...] = ("model_load", "forward", "backward", "optimizer_step")
"""The phases of the first optimizer step, in order (the breakdown of HF's "model training anatomy")."""

_BATCH_KEYS: tuple[str, ...] = ("input_ids", "inputs_embeds", "input_values", "pixel_values", "labels")
_TOKEN_KEYS: frozenset[str] = frozenset({"input_ids", "inputs_embeds"})


# --------------------------------------------------------------------------------------------------------------
# Shared machinery
# --------------------------------------------------------------------------------------------------------------


def _gib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / GIB


def _max(*values: Any) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _sum(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (a collective: every rank must call it); ``[obj]`` without a group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    return [obj]


def _find_trainer(callback: TrainerCallback) -> Any | None:
    """The ``transformers.Trainer`` whose event is running this callback, found in the caller frames, or None.

    Called once per training run (on_train_begin); a frame is accepted only if its ``self`` is a Trainer whose
    callback handler holds this very callback object.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and any(cb is callback for cb in handler.callbacks):
                return candidate
        frame = frame.f_back
    return None


def _write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class _SummaryCallback(TrainerCallback):
    """Finds the Trainer at train begin, finishes once (at the last step's end, else at train end), logs, writes."""

    def _begin_run(self) -> None:
        trainer = _find_trainer(self)
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None
        self._finished = False

    def _finish(self, args: Any, state: Any, control: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # DefaultFlowCallback (always first in the handler) has already decided whether this was the last step;
        # finishing here, before the Trainer's own end-of-training log and before the report_to integrations
        # close their writers in on_train_end, puts the figures in the same log stream as the loss.
        if control.should_training_stop or (state.max_steps > 0 and state.global_step >= state.max_steps):
            self._finish(args, state, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Training stopped some other way (early stopping, a short iterable data set): finish now.
        self._finish(args, state, control)

    def _log(self, control: Any, payload: dict[str, float]) -> None:
        trainer = self._trainer_ref() if getattr(self, "_trainer_ref", None) is not None else None
        if trainer is None:
            logger.warning(
                "%s: no transformers.Trainer found calling this callback; the summary is computed but not logged",
                type(self).__name__,
            )
            return
        if not payload:
            return
        from transformers import Trainer

        should_log = control.should_log
        # The base class's log, not a subclass override: some (TRL's trainers) drain their own accumulated metrics
        # into whatever is logged, which would move them from the loss log into this one.
        Trainer.log(trainer, dict(payload))
        # Trainer.log resets should_log through the callback handler; restore it so the Trainer's own log for this
        # step (the loss) still happens.
        control.should_log = should_log


# --------------------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """What one rank measured. Memory in GiB (2**30 bytes)."""

    rank: int
    device: Literal["cuda", "cpu"]
    """Where the model trained: CUDA figures come from the torch allocator, CPU figures are process RSS."""
    peak_gib: float | None
    """Training peak: CUDA peak allocated by tensors, CPU peak RSS (VmHWM), from train begin to the last step."""
    peak_reserved_gib: float | None
    """CUDA: peak reserved by the caching allocator (what the device really had to give); None on CPU."""
    phases_gib: dict[str, float | None]
    """Memory held at the end of each phase of the first optimizer step (CUDA allocated / CPU RSS):
    ``model_load`` (at train begin: weights, plus whatever the wrapper allocates up front: DDP buckets, DeepSpeed
    partitions and optimizer states), ``forward`` (after the first forward: + activations), ``backward`` (after the
    first backward: + gradients), ``optimizer_step`` (after the first optimizer step: + optimizer states)."""
    phase_peaks_gib: dict[str, float | None]
    """Peak within each phase; for ``model_load`` the peak from process start (or the last reset) to train begin."""
    alloc_retries: int | None
    """CUDA allocator retries (cache flushed and allocation retried: a sign of fragmentation near the limit)
    during training; None on CPU."""
    ooms: int | None
    """CUDA out-of-memory errors raised by the allocator during training; None on CPU."""
    nvml_process_used_gib: float | None
    """The driver's figure for this process (CUDA context included), the largest of the readings after the first
    optimizer step and at the end; None without NVML or where the driver does not list this pid (containers)."""
    nvml_device_used_gib: float | None
    """The driver's figure for the whole device (every process), read at the same times; None without NVML."""


@dataclass(frozen=True, kw_only=True)
class MemorySummary:
    """Memory of a training run: the max over ranks, and each rank's own figures. Memory in GiB."""

    device: Literal["cuda", "cpu"]
    world_size: int
    peak_gib: float | None
    """Training peak, max over ranks (CUDA peak allocated / CPU peak RSS)."""
    peak_reserved_gib: float | None
    """CUDA peak reserved, max over ranks; None on CPU."""
    phases_gib: dict[str, float | None]
    """Held at the end of each first-step phase (see :class:`RankMemory`), max over ranks; None if not reached."""
    phase_peaks_gib: dict[str, float | None]
    """Peak within each phase, max over ranks."""
    alloc_retries: int | None
    """CUDA allocator retries during training, summed over ranks; None on CPU."""
    ooms: int | None
    """CUDA out-of-memory errors during training, summed over ranks; None on CPU."""
    nvml_process_used_gib: float | None
    """NVML per-process memory, max over ranks; None where unavailable."""
    nvml_device_used_gib: float | None
    """NVML whole-device memory, max over ranks; None where unavailable."""
    per_rank: list[RankMemory] = field(default_factory=list)
    """Each rank's figures, in rank order."""
    notes: list[str] = field(default_factory=list)
    """How to read the phases for this run (DeepSpeed, gradient accumulation)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemorySummary:
        known = {f.name for f in dataclasses.fields(RankMemory)}
        rows = [RankMemory(**{k: v for k, v in row.items() if k in known}) for row in data.get("per_rank", [])]
        top = {f.name for f in dataclasses.fields(cls)} - {"per_rank"}
        return cls(**{k: v for k, v in data.items() if k in top}, per_rank=rows)

    @classmethod
    def from_ranks(cls, rows: list[RankMemory], notes: list[str] | None = None) -> MemorySummary:
        """Combine the ranks' figures: memory is the max over ranks, error counters the sum."""
        if not rows:
            raise ValueError("rows: expected at least one rank's figures, got none")

        def phase_max(attr: str) -> dict[str, float | None]:
            return {p: _max(*(getattr(r, attr).get(p) for r in rows)) for p in MEMORY_PHASES}

        return cls(
            device=rows[0].device,
            world_size=len(rows),
            peak_gib=_max(*(r.peak_gib for r in rows)),
            peak_reserved_gib=_max(*(r.peak_reserved_gib for r in rows)),
            phases_gib=phase_max("phases_gib"),
            phase_peaks_gib=phase_max("phase_peaks_gib"),
            alloc_retries=_sum([r.alloc_retries for r in rows]),
            ooms=_sum([r.ooms for r in rows]),
            nvml_process_used_gib=_max(*(r.nvml_process_used_gib for r in rows)),
            nvml_device_used_gib=_max(*(r.nvml_device_used_gib for r in rows)),
            per_rank=sorted(rows, key=lambda r: r.rank),
            notes=list(notes or []),
        )

    def log_dict(self) -> dict[str, float]:
        """The flat ``memory/...`` keys logged through ``Trainer.log`` (None figures left out)."""
        out: dict[str, Any] = {
            "memory/peak_gib": self.peak_gib,
            "memory/peak_reserved_gib": self.peak_reserved_gib,
            "memory/alloc_retries": self.alloc_retries,
            "memory/ooms": self.ooms,
            "memory/nvml_process_used_gib": self.nvml_process_used_gib,
            "memory/nvml_device_used_gib": self.nvml_device_used_gib,
        }
        for phase in MEMORY_PHASES:
            out[f"memory/{phase}_gib"] = self.phases_gib.get(phase)
            out[f"memory/{phase}_peak_gib"] = self.phase_peaks_gib.get(phase)
        if self.world_size > 1:
            for row in self.per_rank:
                out[f"memory/rank_{row.rank}/peak_gib"] = row.peak_gib
        return {k: v for k, v in out.items() if v is not None}


class MemoryCallback(_SummaryCallback):
    """Peak memory of a training run and of each phase of its first optimizer step, on every rank.

    On CUDA the figures come from the torch caching allocator (peaks reset at train begin), plus NVML's view of the
    device where ``pynvml`` works; on CPU from the kernel: RSS now (``VmRSS``) and its high-water mark (``VmHWM``,
    reset at train begin and at each phase boundary through ``/proc/self/clear_refs``), never a lifetime peak.

    Phases (memory held at the end of each, and the peak within it), measured in the first optimizer step:

    ============== ================================================================================================
    model_load     ``on_train_begin``: after the Trainer prepared the model (and optimizer), before any forward
    forward        a forward hook on the model, removed after its first training call
    backward       first ``on_substep_end`` (gradient accumulation) or ``on_pre_optimizer_step``
    optimizer_step first ``on_optimizer_step`` (after ``optimizer.step()``, before gradients are zeroed)
    ============== ================================================================================================

    With gradient accumulation the optimizer_step phase also spans the first step's remaining micro-batches. Under
    DeepSpeed, accelerate runs ``engine.step()`` inside backward, so the backward phase includes the optimizer step
    (and ZeRO allocates optimizer states at initialisation, i.e. in model_load); ``summary.notes`` says so.

    Several processes: every rank measures itself; at the end the ranks exchange figures
    (``torch.distributed.all_gather_object``, a collective: every rank must have this callback).

    Logged once, at the end of the last step, through ``Trainer.log`` (so ``log_history`` and ``report_to``):

    ============================== =============================================================================
    ``memory/peak_gib``            training peak, max over ranks (CUDA allocated / CPU RSS)
    ``memory/peak_reserved_gib``   CUDA peak reserved by the caching allocator (CUDA only)
    ``memory/{phase}_gib``         held at the end of ``model_load``, ``forward``, ``backward``, ``optimizer_step``
    ``memory/{phase}_peak_gib``    peak within that phase
    ``memory/alloc_retries``       allocator retries during training, summed over ranks (CUDA only)
    ``memory/ooms``                allocator out-of-memory errors during training, summed over ranks (CUDA only)
    ``memory/nvml_process_used_gib`` NVML: this process's memory on its device (CUDA with NVML only)
    ``memory/nvml_device_used_gib``  NVML: the whole device's used memory (CUDA with NVML only)
    ``memory/rank_{r}/peak_gib``   each rank's training peak (several processes only)
    ============================== =============================================================================

    After training, ``summary`` holds a :class:`MemorySummary` (on every rank).

    Args:
        output_path: where the main process writes ``summary.to_dict()`` as JSON; None writes nothing.
    """

    def __init__(self, *, output_path: str | os.PathLike[str] | None = None) -> None:
        self.output_path = output_path
        self.summary: MemorySummary | None = None

    # -- events ------------------------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._begin_run()
        self.summary = None
        self._remove_hook()
        self._probe: MemoryProbe = probe_for(args.device)
        self._held: dict[str, int | None] = {}
        self._phase_peak: dict[str, int | None] = {}
        self._nvml_process: int | None = None
        self._nvml_device: int | None = None
        probe = self._probe
        # The model_load phase's peak is the peak so far (model build, Trainer set-up); its held value is now.
        self._phase_peak["model_load"] = probe.peak_bytes()
        self._held["model_load"] = probe.current_bytes()
        probe.reset_peak()
        self._train_peak: int | None = probe.current_bytes()
        self._reserved_peak: int | None = probe.peak_reserved_bytes()
        self._counters_start = probe.counters()
        self._notes = _memory_notes(args)
        if model is not None:
            self._hook = model.register_forward_hook(self._after_first_forward)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending("backward"):
            self._end_phase("backward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending("backward"):
            self._end_phase("backward")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending("optimizer_step"):
            self._end_phase("optimizer_step")
            self._read_nvml()

    # -- measurement -------------------------------------------------------------------------------------------

    def _pending(self, phase: str) -> bool:
        """Whether ``phase`` of the first step is still to be measured (only ever true inside a training run)."""
        held = getattr(self, "_held", None)
        return held is not None and not self._finished and phase not in held

    def _after_first_forward(self, module: Any, inputs: Any, output: Any) -> None:
        if not module.training:  # an evaluation before training (eval_on_start) is not the training forward
            return
        self._remove_hook()
        self._end_phase("forward")

    def _remove_hook(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        self._hook = None

    def _end_phase(self, phase: str) -> None:
        probe = self._probe
        self._held[phase] = probe.current_bytes()
        peak = probe.peak_bytes()
        self._phase_peak[phase] = peak
        self._train_peak = _max(self._train_peak, peak)
        self._reserved_peak = _max(self._reserved_peak, probe.peak_reserved_bytes())
        # A reset per phase (first step only) is what makes a per-phase peak; the training peak is their max.
        probe.reset_peak()

    def _read_nvml(self) -> None:
        reading = self._probe.nvml()
        if reading is not None:
            self._nvml_process = _max(self._nvml_process, reading.process_used_bytes)
            self._nvml_device = _max(self._nvml_device, reading.device_used_bytes)

    def _finish(self, args: Any, state: Any, control: Any) -> None:
        if getattr(self, "_finished", True):
            return
        self._finished = True
        self._remove_hook()
        probe = self._probe
        self._train_peak = _max(self._train_peak, probe.peak_bytes())
        self._reserved_peak = _max(self._reserved_peak, probe.peak_reserved_bytes())
        self._read_nvml()
        retries, ooms = probe.counters()
        retries0, ooms0 = self._counters_start
        rank, _ = _rank_and_world()
        row = RankMemory(
            rank=rank,
            device="cuda" if probe.device == "cuda" else "cpu",
            peak_gib=_gib(self._train_peak),
            peak_reserved_gib=_gib(self._reserved_peak) if probe.device == "cuda" else None,
            phases_gib={p: _gib(self._held.get(p)) for p in MEMORY_PHASES},
            phase_peaks_gib={p: _gib(self._phase_peak.get(p)) for p in MEMORY_PHASES},
            alloc_retries=None if retries is None or retries0 is None else retries - retries0,
            ooms=None if ooms is None or ooms0 is None else ooms - ooms0,
            nvml_process_used_gib=_gib(self._nvml_process),
            nvml_device_used_gib=_gib(self._nvml_device),
        )
        self.summary = MemorySummary.from_ranks(_all_gather(row), notes=self._notes)
        self._log(control, self.summary.log_dict())
        if self.output_path is not None and state.is_world_process_zero:
            _write_json(self.output_path, self.summary.to_dict())


def _memory_notes(args: Any) -> list[str]:
    notes = []
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        notes.append(
            "DeepSpeed: engine.step() runs inside backward, so the backward phase includes the optimizer step; "
            "ZeRO allocates its optimizer states at initialisation, so they are in model_load"
        )
    if getattr(args, "gradient_accumulation_steps", 1) > 1:
        notes.append(
            "gradient accumulation: backward ends at the first micro-batch's backward; the optimizer_step phase "
            "spans the first step's remaining micro-batches"
        )
    return notes


# --------------------------------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ThroughputSummary:
    """Steady-state throughput of a training run, global over ranks. None figures: too few steps were measured."""

    samples_per_s: float | None
    """Samples trained per second, all ranks together, over the measured (post-warm-up) steps."""
    tokens_per_s: float | None
    """Input tokens (padding included) per second, all ranks together; None when batches carry no token ids."""
    step_time_median_s: float | None
    """Median optimizer-step time (end of one step to the end of the next; the slowest rank for each step)."""
    step_time_p90_s: float | None
    step_time_mean_s: float | None
    measured_steps: int
    """Optimizer steps in the figures: all steps but the warm-up and those interrupted by evaluation or saving."""
    warmup_steps: int
    samples_per_step: int | None
    """Samples per optimizer step, all ranks together, as counted from the batches the model received (a full
    step: per-device batch x gradient accumulation x world size)."""
    tokens_per_sample: float | None
    """Mean input length over the measured steps (sequence length for unpadded data)."""
    world_size: int
    flops_per_token: float | None
    """Model FLOPs per trained token (``hfscale.flops``: 6N + 12 L H T; recomputation not counted)."""
    mfu: float | None
    """Model FLOPs utilisation: tokens/s x flops_per_token / (peak_flops_per_s x world_size); None without a peak."""
    peak_flops_per_s: float | None
    """One device's peak for the run's compute dtype (``hfscale.flops.DEVICE_PEAK_FLOPS``, or as given)."""
    device_name: str
    compute_dtype: str = "fp32"
    """The dtype matrix multiplications ran in (bf16, fp16, tf32, fp32): the peak is looked up for it."""
    timer: Literal["cuda_events", "perf_counter"] = "perf_counter"
    total_steps: int = 0
    """Optimizer steps timed (warm-up included)."""
    interrupted_steps: int = 0
    """Steps left out because an evaluation or a checkpoint save ran inside them."""
    measured_samples: int | None = None
    """Samples in the measured steps, all ranks (a last partial batch counts what it really held)."""
    measured_time_s: float | None = None
    """Sum of the measured step times."""
    samples_per_step_configured: int | None = None
    """per_device_train_batch_size x n_gpu x gradient_accumulation_steps x world_size, from the arguments."""
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ThroughputSummary:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def log_dict(self) -> dict[str, float]:
        """The flat ``throughput/...`` keys logged through ``Trainer.log`` (None figures left out)."""
        out: dict[str, Any] = {
            "throughput/samples_per_s": self.samples_per_s,
            "throughput/tokens_per_s": self.tokens_per_s,
            "throughput/step_time_median_s": self.step_time_median_s,
            "throughput/step_time_p90_s": self.step_time_p90_s,
            "throughput/step_time_mean_s": self.step_time_mean_s,
            "throughput/mfu": self.mfu,
            "throughput/measured_steps": self.measured_steps,
            "throughput/samples_per_step": self.samples_per_step,
        }
        return {k: v for k, v in out.items() if v is not None}


class _PerfCounterTimer:
    """Wall-clock step boundaries (CPU training): ``time.perf_counter`` at each mark."""

    kind = "perf_counter"

    def __init__(self) -> None:
        self._marks: list[float] = []

    def mark(self) -> None:
        self._marks.append(time.perf_counter())

    def durations_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self._marks)]


class _CudaEventTimer:
    """CUDA events recorded at step boundaries on the current stream; never a device synchronisation per step.

    Events are turned into durations once they have completed: ``query()`` (non-blocking) is polled when more than
    ``2 * window`` are pending, and the last one is waited for at the end of training.
    """

    kind = "cuda_events"

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self._pending: list[Any] = []
        self._durations: list[float] = []

    def mark(self) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append(event)
        if len(self._pending) > 2 * self.window and self._pending[self.window].query():
            self._drain(self.window)

    def _drain(self, upto: int) -> None:
        events = self._pending
        for start, end in itertools.pairwise(events[: upto + 1]):
            self._durations.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in ms
        self._pending = events[upto:]

    def durations_s(self) -> list[float]:
        if len(self._pending) >= 2:
            self._pending[-1].synchronize()  # once, at the end of training
            self._drain(len(self._pending) - 1)
        return list(self._durations)


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


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class ThroughputCallback(_SummaryCallback):
    """Steady-state samples/s, tokens/s, step time and MFU of a training run, global over ranks.

    A step is one optimizer step (all its gradient-accumulation micro-batches); its time runs from the end of the
    previous step to the end of this one (``on_step_end``), so data loading and loss logging are included. The
    first ``warmup_steps`` steps are left out, and so are steps that contain an evaluation or a checkpoint save.
    Samples and tokens are counted from the batches the model really receives (a forward pre-hook reads the
    shape of ``input_ids``; no device synchronisation), so a last partial batch counts what it held; the
    configured figure (batch x accumulation x world size) is kept beside it and a mismatch is logged.

    Across ranks, each step's time is the slowest rank's, and samples and tokens are summed over ranks.
    MFU = tokens/s x FLOPs per token / (peak FLOP/s x world size), with FLOPs per token from
    :mod:`hfscale.flops` (``6 * N + 12 * L * H * T``, PaLM appendix B; N without embeddings; activation
    recomputation is not useful work and is not counted) and the peak from :data:`hfscale.flops.DEVICE_PEAK_FLOPS`
    for the device name and the compute dtype (bf16/fp16/tf32/fp32). On CPU the peak is unknown: MFU is None unless
    ``peak_flops`` is given.

    Too few steps: when training has fewer than ``warmup_steps + 2`` optimizer steps, a warning is logged at train
    begin, and the figures that need measured steps are None (the run is not stopped: memory figures and the
    Trainer's own results are still worth having).

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
    =================================== ========================================================================

    After training, ``summary`` holds a :class:`ThroughputSummary` (on every rank).

    Args:
        warmup_steps: optimizer steps left out at the start (compilation, allocator growth, caches).
        peak_flops: one device's peak FLOP/s, overriding the table (and giving an MFU on CPU).
        flops_per_token: model FLOPs per trained token, overriding the formula.
        output_path: where the main process writes ``summary.to_dict()`` as JSON; None writes nothing.

    Raises:
        ValueError: for a negative ``warmup_steps`` or a non-positive ``peak_flops`` / ``flops_per_token``.
    """

    def __init__(
        self,
        warmup_steps: int = 5,
        *,
        peak_flops: float | None = None,
        flops_per_token: float | None = None,
        output_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an integer >= 0, got {warmup_steps!r}")
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

        self._begin_run()
        self.summary = None
        self._remove_hook()
        self._samples: list[int] = []
        self._tokens: list[int] = []
        self._interrupted: list[bool] = []
        self._acc_samples = 0
        self._acc_tokens = 0
        self._dirty = False
        self._model_shape: tuple[int, int, int] | None = None
        if model is not None:
            self._hook = model.register_forward_pre_hook(self._count_batch, with_kwargs=True)
            self._model_shape = _model_shape(model)
        if state.max_steps < self.warmup_steps + 2:
            logger.warning(
                "ThroughputCallback: training has %d optimizer steps, fewer than warmup_steps + 2 = %d: throughput "
                "figures will be None; train longer or lower warmup_steps",
                state.max_steps,
                self.warmup_steps + 2,
            )
        on_cuda = torch.device(args.device).type == "cuda"
        self._timer: _PerfCounterTimer | _CudaEventTimer = _CudaEventTimer() if on_cuda else _PerfCounterTimer()
        self._timer.mark()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._dirty = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._dirty = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(self, "_finished", True):
            return
        self._timer.mark()
        self._samples.append(self._acc_samples)
        self._tokens.append(self._acc_tokens)
        self._interrupted.append(self._dirty)
        self._acc_samples = self._acc_tokens = 0
        self._dirty = False
        super().on_step_end(args, state, control, **kwargs)

    # -- measurement -------------------------------------------------------------------------------------------

    def _count_batch(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Runs before every forward of the model: a dict lookup and a shape read, about a microsecond.
        if not module.training:
            return
        for key in _BATCH_KEYS:
            value = kwargs.get(key)
            if value is not None and hasattr(value, "shape"):
                break
        else:
            key, value = "", args[0] if args and hasattr(args[0], "shape") else None
        if value is None or len(value.shape) == 0:
            return
        self._acc_samples += int(value.shape[0])
        if key in _TOKEN_KEYS and len(value.shape) >= 2:
            self._acc_tokens += int(value.shape[0]) * int(value.shape[1])

    def _remove_hook(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        self._hook = None

    def _finish(self, args: Any, state: Any, control: Any) -> None:
        if getattr(self, "_finished", True):
            return
        self._finished = True
        self._remove_hook()
        durations = self._timer.durations_s()
        n = min(len(durations), len(self._samples))
        rank, world = _rank_and_world()
        rows = _all_gather(
            {
                "rank": rank,
                "durations": durations[:n],
                "samples": self._samples[:n],
                "tokens": self._tokens[:n],
                "interrupted": self._interrupted[:n],
            }
        )
        self.summary = self._summarise(args, rows, world)
        self._log(control, self.summary.log_dict())
        if self.output_path is not None and state.is_world_process_zero:
            _write_json(self.output_path, self.summary.to_dict())

    def _summarise(self, args: Any, rows: list[dict[str, Any]], world: int) -> ThroughputSummary:
        n = min(len(r["durations"]) for r in rows)
        step_s = [max(r["durations"][k] for r in rows) for k in range(n)]
        samples = [sum(r["samples"][k] for r in rows) for k in range(n)]
        tokens = [sum(r["tokens"][k] for r in rows) for k in range(n)]
        interrupted = [any(r["interrupted"][k] for r in rows) for k in range(n)]
        accumulation = int(getattr(args, "gradient_accumulation_steps", 1))
        configured = int(args.train_batch_size) * accumulation * world
        if n and not any(samples):
            logger.warning(
                "ThroughputCallback: counted no samples in the model's inputs (no input_ids / inputs_embeds / "
                "pixel_values / labels keyword); using the configured %d samples per step",
                configured,
            )
            samples = [configured] * n
        measured = [k for k in range(n) if k >= self.warmup_steps and not interrupted[k]]
        samples_per_step = max(samples) if samples else None
        if samples_per_step is not None and samples_per_step != configured:
            logger.warning(
                "ThroughputCallback: the batches held %d samples per optimizer step, the arguments say %d "
                "(per-device batch x accumulation x world size); the figures use what the batches held",
                samples_per_step,
                configured,
            )
        dtype = compute_dtype(args)
        device_name = _device_name(args.device)
        peak = self.peak_flops if self.peak_flops is not None else peak_flops_per_s(device_name, dtype)
        common = dict(
            warmup_steps=self.warmup_steps,
            samples_per_step=samples_per_step,
            world_size=world,
            peak_flops_per_s=peak,
            device_name=device_name,
            compute_dtype=dtype,
            timer=self._timer.kind,
            total_steps=n,
            interrupted_steps=sum(interrupted[self.warmup_steps :]),
            samples_per_step_configured=configured,
        )
        if len(measured) < 2:
            logger.warning(
                "ThroughputCallback: %d optimizer steps timed, %d after %d warm-up steps; at least 2 are needed, so "
                "the throughput figures are None",
                n,
                len(measured),
                self.warmup_steps,
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
        times = [step_s[k] for k in measured]
        total_time = sum(times)
        total_samples = sum(samples[k] for k in measured)
        total_tokens = sum(tokens[k] for k in measured)
        tokens_per_s = total_tokens / total_time if total_tokens else None
        tokens_per_sample = total_tokens / total_samples if total_tokens and total_samples else None
        fpt = self.flops_per_token
        if fpt is None and self._model_shape is not None and tokens_per_sample is not None:
            params, layers, hidden = self._model_shape
            fpt = transformer_flops_per_token(
                non_embedding_params=params, num_layers=layers, hidden_size=hidden, seq_len=tokens_per_sample
            )
        utilisation = None
        if fpt is not None and peak is not None and tokens_per_s is not None:
            # One process drives n_gpu devices under nn.DataParallel (n_gpu is 1 per process in DDP, 0 on CPU).
            devices = world * max(1, int(getattr(args, "n_gpu", 1) or 1))
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
            **common,
        )


def _model_shape(model: Any) -> tuple[int, int, int] | None:
    try:
        return model_shape(model)
    except ValueError as exc:
        logger.warning("ThroughputCallback: no FLOPs per token, so no MFU: %s", exc)
        return None


__all__ = [
    "MEMORY_PHASES",
    "MemoryCallback",
    "MemorySummary",
    "RankMemory",
    "ThroughputCallback",
    "ThroughputSummary",
]
