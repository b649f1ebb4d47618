"""One trial: train one model under one strategy, inside the process group that ``accelerate launch`` started.

A trial is described by a :class:`TrialSpec` (written as JSON by the sweep) and run by
``accelerate launch --config_file ACCELERATE_YAML -m hfscale.trial SPEC.json --result RESULT.json``.
Every rank trains; the main process writes the result file.

What the runner does, on every rank:

1. reads the spec, and the strategy's ``TrainingArguments`` keywords: ``training_args.json`` next to the spec (as
   ``hfscale.configs.write_configs`` writes it, the file a user sees is the file that runs), or
   ``--training-args PATH``, or else ``hfscale.configs.training_args_kwargs(spec.strategy)`` computed here;
2. seeds everything with the same seed in every trial (``training_args["seed"]``, default 42), so initial weights,
   data and loss curves are comparable between trials;
3. builds the model from its config with random weights (``AutoConfig.for_model`` + ``from_config``; ``pretrained``
   loads real weights) and the dummy data set (:func:`hfscale.data.make_dataset`);
4. merges ``TrainingArguments``: the recipe's ``spec.training_args`` under the strategy's keywords, under what the
   runner owns (:data:`RUNNER_TRAINING_ARGS`: a temporary ``output_dir``, no checkpoints, a loss per optimizer
   step, the step or epoch count from :class:`MeasureSpec`, no ``report_to`` unless the recipe asks, and
   ``average_tokens_across_devices=False`` so a multi-process loss is not multiplied by the world size);
5. for FSDP with transformer-layer wrapping and no class named, names the model's blocks
   (:func:`fsdp_block_classes`); on CPU, applies :func:`hfscale.fsdp_cpu.enable_fsdp2_on_cpu` (accelerate would
   run DDP instead);
6. trains with :class:`~hfscale.callbacks.MemoryCallback` and :class:`~hfscale.callbacks.ThroughputCallback`
   and a :class:`~hfscale.verify.LinearDtypeProbe` hooked on the model, then reads what ran
   (:func:`hfscale.verify.collect`, collective) and checks it against the strategy (:func:`hfscale.verify.check`);
7. the main process writes a :class:`TrialOutcome` as JSON to ``--result``.

Exit status: 0 when the result was written, with ``status`` ``"ok"`` or ``"not_applied"`` (the strategy did not
take effect; ``reason`` and ``mismatches`` say how); an exception propagates (non-zero exit, traceback on stderr)
so that the sweep can classify out-of-memory and crashes from the exit code and stderr. ``2`` is a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hfscale.model import build_model
from hfscale.spec import TrialSpec

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedModel, Trainer, TrainerCallback

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------
# The result file
# --------------------------------------------------------------------------------------------------------------

RESULT_SCHEMA_VERSION = 1
"""Bumped when a field of :class:`TrialOutcome` changes meaning or is removed (adding one does not)."""

OutcomeStatus = Literal["ok", "not_applied"]

TRAINING_ARGS_FILE = "training_args.json"
"""Looked for next to the spec when ``--training-args`` is not given (``hfscale.configs.write_configs`` writes it)."""

DEFAULT_SEED = 42
"""Seed of every trial whose recipe sets none (``TrainingArguments``' own default)."""

RUNNER_TRAINING_ARGS: dict[str, Any] = {
    "save_strategy": "no",
    "eval_strategy": "no",
    "logging_strategy": "steps",
    "logging_steps": 1,
    "average_tokens_across_devices": False,
}
"""``TrainingArguments`` the runner always sets, over the recipe and the strategy: a trial measures, it does not
keep checkpoints; one logged loss per optimizer step makes the loss curve; and without
``average_tokens_across_devices=False`` the logged loss of an N-process run is N times too large."""


@dataclass(kw_only=True)
class TrialOutcome:
    """What one trial process group measured: the JSON object ``python -m hfscale.trial`` writes to ``--result``.

    The sweep turns it into a :class:`hfscale.results.TrialResult` row: every field here of the same name is
    copied; ``timings_s``, ``world_size``, ``training_args`` and ``mismatches`` are kept in the row's ``extra``.
    """

    schema_version: int = RESULT_SCHEMA_VERSION
    trial: str
    """:attr:`TrialSpec.name`."""
    status: OutcomeStatus
    """``ok``: trained, and the verification record matches the strategy; ``not_applied``: trained, but what ran
    is not what the strategy asked for (see ``reason``). Failures to train are not written here: they raise."""
    reason: str | None = None
    """For ``not_applied``: the mismatches, joined into one sentence."""
    mismatches: list[str] = field(default_factory=list)
    """:func:`hfscale.verify.check`'s list, one entry per way what ran differs from what was asked."""
    train_runtime_s: float | None = None
    """The Trainer's ``train_runtime`` (from the first step's set-up end to the last step; set-up excluded)."""
    train_samples_per_second: float | None = None
    """The Trainer's own figure (global samples over ``train_runtime``, warm-up steps included)."""
    final_loss: float | None = None
    """Last entry of :attr:`loss_curve`."""
    loss_curve: list[float] = field(default_factory=list)
    """Training loss logged at each optimizer step, in step order (``logging_steps=1``)."""
    memory: dict[str, Any] | None = None
    """``MemoryCallback.summary.to_dict()`` (max over ranks and per rank)."""
    throughput: dict[str, Any] | None = None
    """``ThroughputCallback.summary.to_dict()`` (steady state, after ``measure.warmup_steps``)."""
    verification: dict[str, Any] | None = None
    """:class:`hfscale.verify.VerificationRecord` as a dict: what really ran."""
    timings_s: dict[str, float] = field(default_factory=dict)
    """Main process, in seconds: ``startup`` (process creation to the runner's ``main``), ``imports`` (torch,
    transformers, accelerate), ``model_build``, ``data_build``, ``training_args``, ``trainer_init`` (the Trainer,
    its accelerator and the process group), ``train_setup`` (``train()`` call to the first step: wrapping,
    sharding, DeepSpeed initialisation, optimizer creation), ``train_loop`` (first step to the end of training),
    ``train_call`` (the whole ``train()`` call), ``verify``, and ``total`` (process creation to the result being
    written)."""
    world_size: int = 1
    """Processes that trained."""
    training_args: dict[str, Any] = field(default_factory=dict)
    """The merged ``TrainingArguments`` keywords the Trainer got (``output_dir`` left out: a temporary folder)."""
    started_at: str | None = None
    """ISO 8601 UTC time the process started."""
    finished_at: str | None = None
    """ISO 8601 UTC time the result was written."""

    def __post_init__(self) -> None:
        if self.status not in ("ok", "not_applied"):
            raise ValueError(f"TrialOutcome.status: expected 'ok' or 'not_applied', got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialOutcome:
        """Inverse of :meth:`to_dict`; keys written by a newer hfscale are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write as JSON atomically (a reader never sees half a file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> TrialOutcome:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


# --------------------------------------------------------------------------------------------------------------
# Building the pieces
# --------------------------------------------------------------------------------------------------------------


def strategy_training_args(spec: TrialSpec, *, scratch_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The strategy's ``TrainingArguments`` keywords, computed as ``hfscale.configs`` does for the sweep.

    A DeepSpeed strategy's JSON is written into ``scratch_dir`` (the Trainer reads a file).
    """
    from hfscale.configs import deepspeed_config, training_args_kwargs

    ds_path = None
    ds = deepspeed_config(spec.strategy)
    if ds is not None:
        ds_path = Path(scratch_dir) / "deepspeed.json"
        ds_path.write_text(json.dumps(ds, indent=2, sort_keys=True), encoding="utf-8")
    return training_args_kwargs(spec.strategy, deepspeed_config_path=str(ds_path) if ds_path else None)


def merge_training_args(spec: TrialSpec, strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords of a trial, ``output_dir`` aside: recipe < strategy < runner.

    The recipe's ``spec.training_args`` sit under the strategy's keywords, and :data:`RUNNER_TRAINING_ARGS`, the
    step count from ``spec.measure`` and the seed sit over both. ``report_to`` is ``"none"`` and ``disable_tqdm``
    true unless the recipe sets them.
    """
    merged: dict[str, Any] = {"report_to": "none", "disable_tqdm": True, "dataloader_num_workers": 0}
    if spec.strategy.device == "cpu":
        merged["dataloader_pin_memory"] = False  # pinning needs a CUDA runtime
    merged |= spec.training_args
    merged |= strategy_kwargs
    owned = dict(RUNNER_TRAINING_ARGS)
    owned["seed"] = int(spec.training_args.get("seed", DEFAULT_SEED))
    if spec.measure.max_steps is not None:
        owned |= {"max_steps": spec.measure.max_steps}
    else:
        owned |= {"max_steps": -1, "num_train_epochs": spec.measure.num_epochs}
    for key, value in owned.items():
        if key in spec.training_args and spec.training_args[key] != value:
            logger.warning(
                "training_args.%s=%r is overridden by the trial runner: %r", key, spec.training_args[key], value
            )
    merged |= owned
    merged.pop("output_dir", None)
    return merged


def fsdp_block_classes(model: PreTrainedModel) -> list[str]:
    """The classes FSDP should wrap one unit each: the model's ``_no_split_modules`` less any that hold the input
    embedding.

    accelerate's FSDP2 wraps the input embedding as a unit of its own after auto-wrapping, so an auto-wrapped class
    that contains it (BERT lists ``BertEmbeddings``) makes ``fully_shard`` meet an already sharded parameter and
    fail ("Invariant encountered: value was None", measured with accelerate 1.15 / torch 2.13).
    """
    names = sorted(getattr(model, "_no_split_modules", None) or [])  # a set on transformers 5 instances
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    holders = {
        type(module).__name__
        for module in model.modules()
        if embedding is not None and any(sub is embedding for sub in module.modules())
    }
    return [name for name in names if name not in holders]


def _name_fsdp_blocks(kwargs: dict[str, Any], model: PreTrainedModel) -> None:
    """Fill ``fsdp_config.transformer_layer_cls_to_wrap`` when transformer-layer wrapping names no class."""
    config = kwargs.get("fsdp_config")
    if not kwargs.get("fsdp") or not isinstance(config, dict):
        return
    if config.get("auto_wrap_policy") != "TRANSFORMER_BASED_WRAP" or config.get("transformer_layer_cls_to_wrap"):
        return
    blocks = fsdp_block_classes(model)
    if blocks:
        kwargs["fsdp_config"] = config | {"transformer_layer_cls_to_wrap": blocks}
        logger.info("FSDP wraps %s (the model's blocks)", ", ".join(blocks))


def _loss_curve(trainer: Trainer) -> list[float]:
    entries = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    return [float(e["loss"]) for e in sorted(entries, key=lambda e: e["step"])]


def _summary_dict(callback: Any) -> dict[str, Any] | None:
    summary = getattr(callback, "summary", None)
    return summary.to_dict() if summary is not None else None


def _utc_iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="seconds")


def _process_start_time() -> float:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # psutil missing or /proc unreadable: start the clock at the runner instead
        return time.time()


def _train_phase_clock() -> TrainerCallback:
    from transformers import TrainerCallback

    class _TrainPhaseClock(TrainerCallback):
        """Marks the first step's start and training's end, to split ``train()`` into set-up and loop."""

        def __init__(self) -> None:
            self.train_begin: float | None = None
            self.train_end: float | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_begin = time.perf_counter()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_end = time.perf_counter()

    return _TrainPhaseClock()


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


def run_trial(
    spec: TrialSpec,
    *,
    strategy_kwargs: dict[str, Any] | None = None,
    result_path: str | os.PathLike[str] | None = None,
    process_start: float | None = None,
) -> TrialOutcome:
    """Train ``spec`` in this process (one rank of the group), verify what ran, and return the outcome.

    Call it on every rank: training and verification are collective. The main process writes ``result_path``.

    Args:
        spec: the trial.
        strategy_kwargs: the strategy's ``TrainingArguments`` keywords; None computes them
            (:func:`strategy_training_args`).
        result_path: where the main process writes the :class:`TrialOutcome` JSON; None writes nothing.
        process_start: epoch time the process started, for the ``startup`` and ``total`` timings.

    Raises:
        Whatever training raises (out of memory, a library refusing the configuration): the sweep classifies it.
    """
    clock = time.perf_counter()
    wall_start = time.time()
    process_start = wall_start if process_start is None else process_start
    timings: dict[str, float] = {"startup": wall_start - process_start}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now

    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    from hfscale.callbacks import MemoryCallback, ThroughputCallback
    from hfscale.data import make_dataset
    from hfscale.verify import LinearDtypeProbe, check, collect, count_parameters

    lap("imports")
    scratch = tempfile.mkdtemp(prefix=f"hfscale-trial-{spec.name}-")
    try:
        if strategy_kwargs is None:
            strategy_kwargs = strategy_training_args(spec, scratch_dir=scratch)
        kwargs = merge_training_args(spec, strategy_kwargs)

        # The model is built before TrainingArguments exist, so ZeRO-3 does not build it partitioned (zero.Init):
        # every trial then starts from the same weights (zero.Init draws them differently, measured), and on
        # several CPU processes zero.Init fails DeepSpeed's batch-size check (it sees a world of one). The
        # accelerator's memory is unaffected: the whole model is built in host memory and only partitions move.
        transformers.set_seed(kwargs["seed"])
        model = build_model(spec.model, spec.data)
        lap("model_build")
        dataset: datasets.Dataset = make_dataset(spec.data, spec.model.task)
        lap("data_build")
        _name_fsdp_blocks(kwargs, model)
        if spec.strategy.fsdp is not None and spec.strategy.device == "cpu":
            from hfscale.fsdp_cpu import enable_fsdp2_on_cpu

            enable_fsdp2_on_cpu()
        args = TrainingArguments(output_dir=os.path.join(scratch, "output"), **kwargs)
        lap("training_args")
        params_total, _ = count_parameters(model)  # before FSDP1 turns the parameters into views of its shard
        probe = LinearDtypeProbe(model)
        phase_clock = _train_phase_clock()
        memory_cb = MemoryCallback()
        throughput_cb = ThroughputCallback(warmup_steps=spec.measure.warmup_steps)
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=dataset,
            callbacks=[memory_cb, throughput_cb, phase_clock],
        )
        lap("trainer_init")

        train_call_start = time.perf_counter()
        output = trainer.train()
        clock = time.perf_counter()
        timings["train_call"] = clock - train_call_start
        if phase_clock.train_begin is not None:
            timings["train_setup"] = phase_clock.train_begin - train_call_start
            if phase_clock.train_end is not None:
                timings["train_loop"] = phase_clock.train_end - phase_clock.train_begin

        probe.remove()
        record = collect(trainer, probe, params_total=params_total)
        mismatches = check(spec.strategy, record)
        lap("verify")

        loss_curve = _loss_curve(trainer)
        outcome = TrialOutcome(
            trial=spec.name,
            status="not_applied" if mismatches else "ok",
            reason=("what ran is not what was asked: " + "; ".join(mismatches)) if mismatches else None,
            mismatches=mismatches,
            train_runtime_s=output.metrics.get("train_runtime"),
            train_samples_per_second=output.metrics.get("train_samples_per_second"),
            final_loss=loss_curve[-1] if loss_curve else None,
            loss_curve=loss_curve,
            memory=_summary_dict(memory_cb),
            throughput=_summary_dict(throughput_cb),
            verification=record.to_dict(),
            world_size=record.world_size,
            training_args=kwargs,
            started_at=_utc_iso(process_start),
        )
        if mismatches:
            logger.warning("trial %s: not applied: %s", spec.name, "; ".join(mismatches))
        finished = time.time()
        timings["total"] = finished - process_start
        outcome.timings_s = timings
        outcome.finished_at = _utc_iso(finished)
        if result_path is not None and trainer.is_world_process_zero():
            outcome.write(result_path)
        # Only after a clean run: after an error the other ranks may never arrive, and exiting ends the group.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return outcome
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hfscale.trial",
        description="Run one trial (one rank of it): train, verify what ran, write the result (main process).",
        epilog="Launched by the sweep as: accelerate launch --config_file accelerate.yaml -m hfscale.trial "
        "SPEC.json --result RESULT.json. Exit 0: result written (status ok or not_applied); non-zero: training "
        "raised (traceback on stderr); 2: usage error.",
    )
    parser.add_argument("spec", type=Path, help="the TrialSpec JSON (TrialSpec.write)")
    parser.add_argument("--result", type=Path, default=None, help="where the main process writes the result JSON")
    parser.add_argument(
        "--training-args",
        type=Path,
        default=None,
        help=f"the strategy's TrainingArguments keywords (JSON); default: {TRAINING_ARGS_FILE} next to the spec, "
        "else computed from the spec's strategy",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level of hfscale (default WARNING)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hfscale.trial``; returns the exit status."""
    process_start = _process_start_time()
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank{os.environ.get('RANK', '0')}] %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("hfscale").setLevel(args.log_level.upper())
    spec = TrialSpec.read(args.spec)
    ta_path = args.training_args
    if ta_path is None and (args.spec.parent / TRAINING_ARGS_FILE).is_file():
        ta_path = args.spec.parent / TRAINING_ARGS_FILE
    strategy_kwargs = None
    if ta_path is not None:
        strategy_kwargs = json.loads(ta_path.read_text(encoding="utf-8"))
        logger.info("strategy TrainingArguments from %s", ta_path)
    run_trial(spec, strategy_kwargs=strategy_kwargs, result_path=args.result, process_start=process_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
