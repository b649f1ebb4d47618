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
   loads real weights) and the dummy data set (:func:`hfscale.workload.data.make_dataset`);
4. merges ``TrainingArguments`` (:mod:`hfscale.workload.arguments`): the recipe's ``spec.training_args`` under the
   strategy's keywords, under what the runner owns (a temporary ``output_dir``, no checkpoints, the step or epoch
   count from :class:`MeasureSpec`, no ``report_to`` unless the recipe asks, and ``average_tokens_across_devices``
   as the strategy needs it, so a multi-process loss is not multiplied); the loss curve is recorded on the device
   (:class:`~hfscale.trial.recording.LossRecorder`), not logged every step;
5. applies every registered technique (:data:`hfscale.techniques.TECHNIQUES`): each loads, then adapts, the model
   (tensor parallelism: reloaded sharded; LoRA: adapters), prepares what ``TrainingArguments`` need (FSDP on CPU:
   :func:`hfscale.techniques.fsdp_cpu.enable_fsdp2_on_cpu`, else accelerate would run DDP; a mesh's
   ``ParallelismConfig``) and is applied to the built Trainer (activation offloading); for FSDP with
   transformer-layer wrapping and no class named, names the model's blocks (:func:`fsdp_block_classes`);
6. trains with :class:`~hfscale.callbacks.MemoryCallback`, :class:`~hfscale.callbacks.ThroughputCallback` and
   :class:`~hfscale.callbacks.VerificationCallback` (the one a user adds to a Trainer, in ``warn`` mode: it reads
   what ran at the end of the first step and checks it against the strategy), bound to the Trainer with
   :func:`hfscale.callbacks.attach`;
7. the main process writes a :class:`TrialOutcome` as JSON to ``--result``.

Exit status: 0 when the result was written, with ``status`` ``"ok"`` or ``"not_applied"`` (the strategy did not
take effect; ``reason`` and ``mismatches`` say how); an exception propagates (non-zero exit, traceback on stderr)
so that the sweep can classify out-of-memory and crashes from the exit code and stderr. ``2`` is a usage error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.configs import DEEPSPEED_FILE
from hfscale.core.collective import end_process_group
from hfscale.core.collector import frozen_after_imports
from hfscale.core.files import utc_from_epoch, write_atomic
from hfscale.core.imports import leave_out_peft
from hfscale.core.pids import started_at
from hfscale.records.row import TrialOutcome, to_json_text
from hfscale.techniques import TECHNIQUES
from hfscale.trial.recording import LossRecorder, PhaseTimer, train_phase_clock
from hfscale.workload.arguments import owned_by_runner, trial_training_args
from hfscale.workload.model import build_model
from hfscale.workload.spec import TrialSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, Trainer
    from transformers.trainer_utils import TrainOutput

    from hfscale.callbacks import MemoryCallback, ThroughputCallback, VerificationCallback

logger = logging.getLogger(__name__)

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
        ds_path = Path(scratch_dir) / DEEPSPEED_FILE
        ds_path.write_text(json.dumps(ds, indent=2, sort_keys=True), encoding="utf-8")
    return training_args_kwargs(spec.strategy, deepspeed_config_path=str(ds_path) if ds_path else None)


def merge_training_args(spec: TrialSpec, strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    """:func:`~hfscale.workload.arguments.trial_training_args`, warning of each of the recipe's keywords the runner
    overrides."""
    for key, value in owned_by_runner(spec).items():
        if key in spec.training_args and spec.training_args[key] != value:
            logger.warning(
                "training_args.%s=%r is overridden by the trial runner: %r", key, spec.training_args[key], value
            )
    return trial_training_args(spec, strategy_kwargs)


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


def process_start_time() -> float:
    """Epoch time this process started: :func:`hfscale.core.pids.started_at` where there is ``/proc``, else psutil's
    figure, else now (the clock then starts at the top of the trial's ``main``)."""
    started = started_at()
    if started is not None:
        return started
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()


@dataclass
class BuiltTrial:
    """A built Trainer and what the runner reads from it after training."""

    trainer: Trainer
    memory: MemoryCallback
    throughput: ThroughputCallback
    verification: VerificationCallback
    phase_clock: Any
    recorder: LossRecorder


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


def run_trial(
    spec: TrialSpec,
    *,
    strategy_kwargs: dict[str, Any] | None = None,
    result_path: str | os.PathLike[str] | None = None,
    process_start: float | None = None,
    own_process: bool = False,
) -> TrialOutcome:
    """Train ``spec`` in this process (one rank of the group), verify what ran, and return the outcome.

    Call it on every rank: training and verification are collective. The main process writes ``result_path``.

    Args:
        spec: the trial.
        strategy_kwargs: the strategy's ``TrainingArguments`` keywords; None computes them
            (:func:`strategy_training_args`).
        result_path: where the main process writes the :class:`TrialOutcome` JSON; None writes nothing.
        process_start: epoch time the process started, for the ``startup`` and ``total`` timings.
        own_process: the process is the trial's own (``python -m hfscale.trial``), so what the imports leave alive
            is frozen out of the collector's sight (:func:`import_training_stack`).

    Raises:
        Whatever training raises (out of memory, a library refusing the configuration): the sweep classifies it.
    """
    timer = PhaseTimer(process_start)
    import_training_stack(own_process=own_process)
    timer.lap("imports")
    scratch = tempfile.mkdtemp(prefix=f"hfscale-trial-{spec.name}-")
    try:
        if strategy_kwargs is None:
            strategy_kwargs = strategy_training_args(spec, scratch_dir=scratch)
        kwargs = merge_training_args(spec, strategy_kwargs)
        trial = _build_trial(spec, kwargs, scratch, timer)
        output = _train(trial, timer)
        outcome = trial_outcome(spec, trial, output, kwargs, timer)
        try:
            if result_path is not None and trial.trainer.is_world_process_zero():
                write_outcome(outcome, result_path)
        finally:
            # Only after a clean run: after an error in training the other ranks may never arrive, and exiting ends
            # the group. A failed write still frees the other ranks, rather than leaving them in the barrier.
            end_process_group()
        return outcome
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def import_training_stack(*, own_process: bool = False) -> None:
    """Import what training needs, so that its cost (seconds: the Trainer pulls in torch's compiler stack) is the
    ``imports`` phase rather than part of the first phase that needs it.

    ``own_process``: the process is the trial's own and nothing of a user's has run yet; the imports then run with
    the garbage collector paused, and what they leave alive is frozen out of its sight
    (:func:`~hfscale.core.collector.frozen_after_imports`; what it saves: docs/development.md).
    """
    with frozen_after_imports() if own_process else contextlib.nullcontext():
        import torch  # noqa: F401
        from transformers import Trainer, TrainingArguments  # noqa: F401

        from hfscale.callbacks import MemoryCallback  # noqa: F401
        from hfscale.workload.data import make_dataset  # noqa: F401


def _build_model(spec: TrialSpec, scratch: str) -> Any:
    """The trial's model, as every technique needs it: loaded (tensor parallel: sharded), then adapted (LoRA)."""
    # The model is built before TrainingArguments exist, so ZeRO-3 does not build it partitioned (zero.Init):
    # every trial then starts from the same weights (zero.Init draws them differently, measured), and on
    # several CPU processes zero.Init fails DeepSpeed's batch-size check (it sees a world of one). The
    # accelerator's memory is unaffected: the whole model is built in host memory and only partitions move.
    model = build_model(spec.model, spec.data, attn_implementation=spec.strategy.attn_implementation)
    for technique in TECHNIQUES:
        model = technique.load_model(model, spec, scratch)
    for technique in TECHNIQUES:  # adapters on a frozen (QLoRA: 4-bit) base, before any wrapping
        model = technique.adapt_model(model, spec, scratch)
    return model


def _build_trial(spec: TrialSpec, kwargs: dict[str, Any], scratch: str, timer: PhaseTimer) -> BuiltTrial:
    """The model, the data, ``TrainingArguments`` and the Trainer with hfscale's callbacks, each phase timed."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from hfscale.callbacks import MemoryCallback, ThroughputCallback, VerificationCallback, attach
    from hfscale.workload.data import make_training_data

    transformers.set_seed(kwargs["seed"])
    model = _build_model(spec, scratch)
    timer.lap("model_build")
    dataset, collator = make_training_data(spec.data, spec.model.task)
    timer.lap("data_build")
    _name_fsdp_blocks(kwargs, model)
    objects: dict[str, Any] = {}  # keywords that are not JSON (a mesh's ParallelismConfig): kept out of the result
    for technique in TECHNIQUES:
        objects |= technique.prepare_arguments(spec.strategy)
    args = TrainingArguments(output_dir=os.path.join(scratch, "output"), **kwargs, **objects)
    timer.lap("training_args")
    phase_clock = train_phase_clock()
    memory_cb = MemoryCallback()
    throughput_cb = ThroughputCallback(warmup_steps=spec.measure.warmup_steps)
    # Counts the parameters when the Trainer is built, before FSDP1 turns them into views of its shard.
    verify_cb = VerificationCallback(spec.strategy, on_mismatch="warn")
    callbacks = [memory_cb, throughput_cb, phase_clock, verify_cb]
    collate = {"data_collator": collator} if collator is not None else {}
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks, **collate)
    for technique in TECHNIQUES:  # offload hooks; DeepSpeed's checkpoint function
        technique.apply(trainer, spec.strategy)
    recorder = LossRecorder()
    recorder.wrap(trainer)
    # Bound explicitly: the callbacks never search the call stack for their Trainer.
    attach(trainer, memory_cb, throughput_cb, verify_cb)
    timer.lap("trainer_init")
    return BuiltTrial(trainer, memory_cb, throughput_cb, verify_cb, phase_clock, recorder)


def _train(trial: BuiltTrial, timer: PhaseTimer) -> TrainOutput:
    """``trainer.train()``, timed as a whole and split into set-up and loop at the first step."""
    train_call_start = timer.last
    output = trial.trainer.train()
    timer.lap("train_call")
    begin, end = trial.phase_clock.train_begin, trial.phase_clock.train_end
    if begin is not None:
        timer.timings["train_setup"] = begin - train_call_start
        if end is not None:
            timer.timings["train_loop"] = end - begin
    return output


def trial_outcome(
    spec: TrialSpec, trial: BuiltTrial, output: TrainOutput, kwargs: dict[str, Any], timer: PhaseTimer
) -> TrialOutcome:
    """The outcome of a trained trial: ``not_applied`` when the verification found mismatches, else ``ok``.

    Collective (the loss curve is averaged over ranks): call it on every rank.
    """
    # Verified by the callback at the end of the first step (warn mode: a mismatch is a not_applied result).
    record = trial.verification.record
    mismatches = trial.verification.mismatches
    timer.lap("verify")
    outcome = TrialOutcome(
        trial=spec.name,
        status="not_applied" if mismatches else "ok",
        reason=("what ran is not what was asked: " + "; ".join(mismatches)) if mismatches else None,
        mismatches=mismatches,
        train_runtime_s=output.metrics.get("train_runtime"),
        train_samples_per_second=output.metrics.get("train_samples_per_second"),
        loss_curve=trial.recorder.curve(trial.trainer),
        memory=trial.memory.summary,
        throughput=trial.throughput.summary,
        verification=record,
        world_size=record.world_size if record is not None else int(trial.trainer.args.world_size),
        training_args=kwargs,
        started_at=utc_from_epoch(timer.process_start),
    )
    if mismatches:
        logger.warning("trial %s: not applied: %s", spec.name, "; ".join(mismatches))
    finished = time.time()
    timer.timings["total"] = finished - timer.process_start
    outcome.timings_s = timer.timings
    outcome.finished_at = utc_from_epoch(finished)
    return outcome


def write_outcome(outcome: TrialOutcome, path: str | os.PathLike[str]) -> None:
    """Write the outcome as JSON atomically (the sweep never reads half a file)."""
    write_atomic(path, to_json_text(outcome, indent=2) + "\n")


def read_outcome(path: str | os.PathLike[str]) -> TrialOutcome:
    """The outcome a trial wrote.

    Raises:
        OSError: when it cannot be read; ValueError: when it is not a valid outcome.
    """
    return TrialOutcome.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def leave_out_peft_unless_used(spec: TrialSpec) -> bool:
    """:func:`~hfscale.core.imports.leave_out_peft` in a trial that trains no LoRA (the Trainer uses peft only to ask
    whether a model is a peft model, which a trial's model is only under ``strategy.lora``); returns whether it was
    left out. Call it before transformers' Trainer is imported (it changes nothing after)."""
    if spec.strategy.lora is not None:
        return False
    return leave_out_peft()
