"""One trial of the user's own training script: their model, data, collator and ``TrainingArguments``, run unmodified
under the trial's strategy with hfscale's measurement attached.

The mechanism, in one place: the trial process (``python -m hfscale.trial SPEC.json``, one rank of the group that
``accelerate launch`` started with the trial's config) runs the script as ``__main__`` (``runpy``, ``sys.argv`` set
to the script and its arguments, its folder first on ``sys.path``) with ``transformers.Trainer.__init__`` and
``Trainer.train`` wrapped for the time of the run. When the script builds its Trainer, the wrapper:

1. compares the script's ``TrainingArguments`` with the trial's on every field the strategy owns (precision, batch
   size, accumulation, optimizer, checkpointing, DeepSpeed, FSDP, compile): a field the script set away from
   transformers' default to a value other than the trial's is a **conflict**: nothing trains, and the row is
   ``not_applied`` naming each field and both values, never a silent override;
2. rebuilds the arguments with the trial's keywords and what the runner owns (``output_dir`` in the trial's scratch
   folder, no checkpoints or evaluation, the step count from the recipe's ``measure``, no ``report_to``), each owned
   value that changes the script's logged as a warning;
3. adapts the model as the strategy asks (LoRA adapters) and adds the memory, throughput and verification
   callbacks and the on-device loss recorder, exactly as a recipe trial has them.

When ``train()`` returns, the outcome is built and written (main process) as for a recipe trial, and the script is
ended there: what it does after training (evaluation, saving, pushing) is not part of the measurement. A script
that returns, or exits, without having trained raises :class:`ScriptDidNotTrainError`, whose message the sweep's row
carries as its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import runpy
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.core.collective import end_process_group
from hfscale.records.row import TrialOutcome
from hfscale.techniques import TECHNIQUES
from hfscale.trial.recording import LossRecorder, PhaseTimer, train_phase_clock
from hfscale.trial.train import (
    BuiltTrial,
    import_training_stack,
    strategy_training_args,
    trial_outcome,
    write_outcome,
)
from hfscale.workload.arguments import runner_training_args
from hfscale.workload.spec import TrialSpec

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

logger = logging.getLogger(__name__)

STRATEGY_FIELDS = (
    "bf16",
    "fp16",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "optim",
    "gradient_checkpointing",
    "activation_checkpointing",
    "torch_compile",
    "torch_compile_backend",
    "torch_compile_mode",
)
"""``TrainingArguments`` fields a strategy decides and a script may also set: compared for conflicts."""
ENGINE_FIELDS = ("deepspeed", "fsdp")
"""Fields whose every setting by the script is a conflict: the trial writes its own DeepSpeed JSON and FSDP
options (or none), so a script's own cannot be merged with them."""


class ScriptDidNotTrainError(RuntimeError):
    """The script returned or exited before ``Trainer.train()`` returned: a failed row, with this as its reason."""


class _TrainingDone(BaseException):
    """Ends the script once its training was measured (a BaseException: a script's ``except Exception`` does not
    swallow it)."""


class _Conflict(BaseException):
    """The script's arguments contradict the trial; raised from its ``Trainer(...)`` call."""

    def __init__(self, conflicts: list[str]) -> None:
        super().__init__("; ".join(conflicts))
        self.conflicts = conflicts


def _is_set(value: Any) -> bool:
    return value not in (None, "", [], {}, False)


def script_conflicts(script_args: TrainingArguments, trial_kwargs: dict[str, Any]) -> list[str]:
    """The fields where the script's arguments contradict the trial's, one sentence each naming both values."""
    defaults = _default_arguments()
    conflicts = []
    for name in ENGINE_FIELDS:
        have = getattr(script_args, name, None)
        if _is_set(have):
            conflicts.append(
                f"{name}: the script sets its own ({have!r}); the trial sets {name} from its strategy "
                f"({trial_kwargs.get(name) or 'none'}): remove it from the script's arguments"
            )
    for name in STRATEGY_FIELDS:
        if name not in trial_kwargs or not hasattr(script_args, name):
            continue
        have, wanted = getattr(script_args, name), trial_kwargs[name]
        if _same(have, getattr(defaults, name, None)) or _same(have, wanted):
            continue
        conflicts.append(f"{name}: the script sets {_show(have)}, the trial asks for {_show(wanted)}")
    return conflicts


def _same(a: Any, b: Any) -> bool:
    """Equal as written in arguments: an enum member equals its value (``OptimizerNames.ADAMW_TORCH`` and
    ``"adamw_torch"``)."""
    return getattr(a, "value", a) == getattr(b, "value", b)


def _show(value: Any) -> str:
    return repr(getattr(value, "value", value))


def _default_arguments() -> TrainingArguments:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=tempfile.gettempdir(), report_to="none")


@dataclass
class ScriptHook:
    """Wraps ``Trainer.__init__`` and ``Trainer.train`` for the time of the script (see the module's docstring)."""

    spec: TrialSpec
    strategy_kwargs: dict[str, Any]
    scratch: str
    timer: PhaseTimer
    result_path: str | os.PathLike[str] | None = None
    objects: dict[str, Any] = field(default_factory=dict)
    """``TrainingArguments`` keywords that are not JSON (a mesh's ``ParallelismConfig``), from the techniques'
    :meth:`~hfscale.techniques.base.Technique.prepare_arguments`, called before the script runs."""
    callbacks: tuple[Any, ...] = ()
    """Memory, throughput, phase clock and verification, made when the script builds its Trainer."""
    built: BuiltTrial | None = None
    outcome: TrialOutcome | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    """The keywords the trial put over the script's (recorded in the outcome)."""

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from transformers import Trainer

        original_init, original_train = Trainer.__init__, Trainer.train
        signature = inspect.signature(original_init)
        hook = self

        def init(trainer: Trainer, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(trainer, *args, **kwargs)
            hook.before_init(bound.arguments)
            original_init(*bound.args, **bound.kwargs)
            hook.after_init(trainer)

        def train(trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
            output = original_train(trainer, *args, **kwargs)
            hook.finish(trainer, output)
            raise _TrainingDone

        Trainer.__init__, Trainer.train = init, train  # type: ignore[method-assign]
        try:
            yield
        finally:
            Trainer.__init__, Trainer.train = original_init, original_train  # type: ignore[method-assign]

    def before_init(self, arguments: dict[str, Any]) -> None:
        """Check the script's arguments, then put the trial's in their place, adapt the model, add the callbacks."""
        from hfscale.callbacks import MemoryCallback, ThroughputCallback, VerificationCallback

        self.timer.lap("script")
        script_args = arguments.get("args")
        if script_args is None:
            script_args = _default_arguments()
        conflicts = script_conflicts(script_args, self.strategy_kwargs)
        if arguments.get("model") is None:
            conflicts.append("model: the script passes no model (model_init is not measured); pass model=...")
        if conflicts:
            raise _Conflict(conflicts)
        arguments["args"] = self._trial_arguments(script_args)
        model = arguments["model"]
        for technique in TECHNIQUES:  # adapters on the script's model (LoRA), before any wrapping
            model = technique.adapt_model(model, self.spec, self.scratch)
        arguments["model"] = model
        self.callbacks = (
            MemoryCallback(),
            ThroughputCallback(warmup_steps=self.spec.measure.warmup_steps),
            train_phase_clock(),
            VerificationCallback(self.spec.strategy, on_mismatch="warn"),
        )
        arguments["callbacks"] = [*(arguments.get("callbacks") or []), *self.callbacks]

    def _trial_arguments(self, script_args: TrainingArguments) -> TrainingArguments:
        """The script's arguments with the trial's strategy and what the runner owns put over them."""
        owned = runner_training_args(self.spec) | {"report_to": "none"}
        for name, value in owned.items():
            have = getattr(script_args, name, value)
            if not _same(have, value) and not (name == "report_to" and not _is_set(have)):
                logger.warning("the script's %s=%s is replaced by the trial's %s", name, _show(have), _show(value))
        self.arguments = {**self.strategy_kwargs, **owned}
        output_dir = os.path.join(self.scratch, "output")
        return dataclasses.replace(script_args, output_dir=output_dir, **self.arguments, **self.objects)

    def after_init(self, trainer: Trainer) -> None:
        from hfscale.callbacks import attach

        if self.built is not None:
            return  # a second Trainer of the script: the first one built is the one measured
        memory, throughput, clock, verification = self.callbacks
        for technique in TECHNIQUES:  # offload hooks; DeepSpeed's checkpoint function
            technique.apply(trainer, self.spec.strategy)
        self.built = BuiltTrial(trainer, memory, throughput, verification, clock, LossRecorder())
        self.built.recorder.wrap(trainer)
        attach(trainer, memory, throughput, verification)
        self.timer.lap("trainer_init")

    def finish(self, trainer: Trainer, output: Any) -> None:
        """The outcome of the measured training, written by the main process; then the group is taken down."""
        self.timer.lap("train_call")
        assert self.built is not None and self.built.trainer is trainer, "train() of a Trainer hfscale did not build"
        self.outcome = trial_outcome(self.spec, self.built, output, self.arguments, self.timer)
        try:
            if self.result_path is not None and trainer.is_world_process_zero():
                write_outcome(self.outcome, self.result_path)
        finally:  # a failed write still frees the other ranks, rather than leaving them in the barrier
            end_process_group()


def _run_script(path: str, args: tuple[str, ...]) -> None:
    """Run ``path`` as ``__main__`` with ``args``, as ``python path args...`` would."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def run_script(
    spec: TrialSpec,
    *,
    strategy_kwargs: dict[str, Any] | None = None,
    result_path: str | os.PathLike[str] | None = None,
    process_start: float | None = None,
    own_process: bool = False,
) -> TrialOutcome:
    """Run the trial's script (``spec.script``) on this rank under the trial's strategy; the main process writes
    the outcome to ``result_path``: ``ok``/``not_applied`` after training, ``not_applied`` naming the conflicts.
    ``own_process`` as :func:`~hfscale.trial.train.run_trial`'s: the training stack is imported, and frozen, before
    the script runs.

    Raises:
        ScriptDidNotTrainError: when the script returned or exited without ``Trainer.train()`` returning.
        Whatever the script raises (out of memory, a bug in it): the sweep classifies it.
    """
    assert spec.script is not None, "run_script needs a trial with a script"
    timer = PhaseTimer(process_start)
    import_training_stack(own_process=own_process)
    timer.lap("imports")
    scratch = tempfile.mkdtemp(prefix=f"hfscale-trial-{spec.name}-")
    try:
        kwargs = strategy_kwargs if strategy_kwargs is not None else strategy_training_args(spec, scratch_dir=scratch)
        hook = ScriptHook(spec, kwargs, scratch, timer, result_path)
        for technique in TECHNIQUES:  # process-wide adjustments (FSDP on CPU) precede the script's arguments
            hook.objects |= technique.prepare_arguments(spec.strategy)
        with hook.installed():
            return _run_until_trained(hook, spec, result_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_until_trained(hook: ScriptHook, spec: TrialSpec, result_path: str | os.PathLike[str] | None) -> TrialOutcome:
    assert spec.script is not None
    try:
        _run_script(spec.script.path, spec.script.args)
    except _TrainingDone:
        assert hook.outcome is not None
        return hook.outcome
    except _Conflict as conflict:  # raised on every rank alike, in the Trainer's construction, before a collective
        try:
            return _conflict_outcome(spec, conflict.conflicts, result_path)
        finally:
            end_process_group()  # the script's TrainingArguments may have started the group
    except SystemExit as exc:
        raise ScriptDidNotTrainError(f"{_said(spec)} exited (status {exc.code}) {_how_far(hook)}") from None
    raise ScriptDidNotTrainError(f"{_said(spec)} returned {_how_far(hook)}")


def _said(spec: TrialSpec) -> str:
    assert spec.script is not None
    return f"the script {Path(spec.script.path).name}"


def _how_far(hook: ScriptHook) -> str:
    if hook.built is None:
        return "without building a Trainer (hfscale measures transformers.Trainer.train())"
    return "after building its Trainer but without calling train()"


def _conflict_outcome(
    spec: TrialSpec, conflicts: list[str], result_path: str | os.PathLike[str] | None
) -> TrialOutcome:
    outcome = TrialOutcome(
        trial=spec.name,
        status="not_applied",
        reason="the script's own arguments contradict the trial, nothing was trained: " + "; ".join(conflicts),
        mismatches=conflicts,
    )
    logger.warning("trial %s: %s", spec.name, outcome.reason)
    if result_path is not None and int(os.environ.get("RANK", "0")) == 0:
        write_outcome(outcome, result_path)
    return outcome


__all__ = ["ScriptDidNotTrainError", "ScriptHook", "run_script", "script_conflicts"]
