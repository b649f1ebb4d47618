"""What a sweep will run: the planned launches under its settings (:mod:`hfscale.launch.settings`).

:func:`plan_runs` expands the trials into launches
(repeats interleaved) and decides, without launching, what cannot run here; :func:`estimate_runs` adds each trial's
predicted peak memory (:mod:`hfscale.estimate`) and, on request, skips what is predicted not to fit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hfscale.core.text import short
from hfscale.launch.settings import SettingError, SweepError, SweepSettings
from hfscale.recipes.schema import Recipe, RecipeTrial
from hfscale.strategy import EIGHT_BIT_OPTIMIZERS, Strategy

if TYPE_CHECKING:
    from hfscale.estimate import MemoryEstimate


logger = logging.getLogger(__name__)


# -- what will run --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One launch of one trial (a trial with ``measure.repeats`` = 3 is three runs)."""

    trial: RecipeTrial
    repeat: int
    """0-based."""
    index: int
    """Position in the whole sweep, 0-based (multi-machine ports are derived from it)."""
    skip_reason: str | None = None
    """Why it will not be launched, decided before launching."""
    estimate: MemoryEstimate | None = None
    """The trial's predicted peak (:func:`estimate_runs`); None when it could not be estimated."""
    estimate_error: str | None = None
    """Why there is no estimate (a model type or optimizer the estimator does not model, ...)."""
    predicted_oom: bool = False
    """``skip_reason`` is ``--skip-predicted-oom``'s: the estimate does not fit the budget."""

    @property
    def name(self) -> str:
        return self.trial.name

    @property
    def repeats(self) -> int:
        """How many runs the trial can have (``measure.max_repeats`` when it asks for a target precision)."""
        return self.trial.spec.measure.most_runs

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.repeat)

    @property
    def label(self) -> str:
        return self.name if self.repeats == 1 else f"{self.name} (repeat {self.repeat + 1}/{self.repeats})"


NO_CUDA_DEVICE = "device 'cuda' but no CUDA device is visible (see environment.json)"
"""The skip reason of a CUDA trial on a machine without a visible GPU (:func:`skip_reason`)."""
CPU_INSTEAD = (
    "run it where a GPU is visible (under Slurm: --gpus-per-node and a GPU partition; check CUDA_VISIBLE_DEVICES), "
    "or use a CPU recipe such as cpu_small (hfscale recipes lists them); hfscale sweep RECIPE --dry-run plans a "
    "recipe without running it"
)


@dataclass(frozen=True, kw_only=True)
class SkipCause:
    """Why runs were skipped before launching, in general terms, and what to do about it (for the one message of
    a sweep in which no trial ran)."""

    cause: str
    """The reason without the figures of one trial: skips of one cause share it."""
    remedy: str


def skip_cause(reason: str | None) -> SkipCause:
    """The cause of a ``skipped`` row's reason, as :func:`skip_reason`, :func:`estimate_runs` and a run after a
    failed repeat write them; an unknown reason is its own cause."""
    text = reason or "no reason recorded"
    if text == NO_CUDA_DEVICE:
        return SkipCause(cause="device 'cuda' but no CUDA device is visible on this machine", remedy=CPU_INSTEAD)
    if text.startswith("predicted peak ") and "does not fit the budget" in text:  # an adaptive search's skip
        return SkipCause(
            cause="predicted not to fit the budget even at the estimate's largest measured over-prediction",
            remedy="give the real per-device memory with --memory-budget, lower the batch, or search the grid "
            "(--search grid) to try",
        )
    if text.startswith("predicted out of memory"):
        return SkipCause(
            cause="predicted out of memory",
            remedy="give the real per-device memory with --memory-budget, lower the batch, or run without "
            "--skip-predicted-oom to try",
        )
    if " GPUs per machine; " in text:
        return SkipCause(cause=text, remedy="run on a machine with that many GPUs, or lower --num-processes")
    if text.startswith("needs ") and " machines; " in text:
        return SkipCause(cause=text, remedy="start one driver per machine (hfscale slurm writes them)")
    if "not installed" in text:
        return SkipCause(cause=text, remedy="install it as the reason says, then start the sweep again")
    return SkipCause(cause=text, remedy="hfscale sweep RECIPE --dry-run shows what each trial would run")


def device_not_visible(recipe: Recipe, runs: Sequence[PlannedRun]) -> str | None:
    """A line for before the first trial when the recipe's device is not visible here (every CUDA run will be
    skipped), with what to do; None when it is, or nothing asks for it."""
    skipped = sum(run.skip_reason == NO_CUDA_DEVICE for run in runs)
    if not skipped:
        return None
    return (
        f"recipe {recipe.name}: device 'cuda', but no CUDA device is visible on this machine: {skipped} of its "
        f"{len(runs)} runs will be skipped; {CPU_INSTEAD}"
    )


def skip_reason(strategy: Strategy, *, gpu_count: int, num_machines: int) -> str | None:
    """Why a strategy cannot run here, decided without launching it; None when it can be tried.

    Missing optional dependencies are found with ``importlib.util.find_spec`` (nothing is imported).
    """
    if strategy.deepspeed is not None and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'hfscale[deepspeed]')"
    if strategy.optimizer in EIGHT_BIT_OPTIMIZERS and importlib.util.find_spec("bitsandbytes") is None:
        return (
            f"optimizer {strategy.optimizer!r} needs bitsandbytes, which is not installed (pip install 'hfscale[bnb]')"
        )
    if strategy.num_machines > num_machines:
        return f"needs {strategy.num_machines} machines; this sweep was launched on {num_machines}"
    if strategy.device == "cuda":
        per_machine = strategy.num_processes // strategy.num_machines
        if gpu_count == 0:
            return NO_CUDA_DEVICE
        if per_machine > gpu_count:
            return f"needs {per_machine} GPUs per machine; {gpu_count} visible"
    return None


def plan_runs(
    trials: Sequence[RecipeTrial], *, gpu_count: int, num_machines: int, only: Sequence[str] | None = None
) -> list[PlannedRun]:
    """Every launch, interleaved: the first run of every trial in recipe order, then the second of every trial that
    has one, and so on, so that drift over the sweep (the machine warming up, another job starting) reaches every
    trial alike instead of all the repeats of one; ``only`` keeps the named trials.

    Raises:
        SweepError: when ``only`` names a trial the recipe does not have.
    """
    names = [t.name for t in trials]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise SweepError(f"--only: no trial named {', '.join(unknown)}; trials are {', '.join(names)}")
    kept = [t for t in trials if not only or t.name in only]
    reasons = {t.name: skip_reason(t.spec.strategy, gpu_count=gpu_count, num_machines=num_machines) for t in kept}
    runs = []
    for repeat in range(max((t.spec.measure.repeats for t in kept), default=0)):
        for trial in kept:
            if repeat < trial.spec.measure.repeats:
                runs.append(PlannedRun(trial=trial, repeat=repeat, index=len(runs), skip_reason=reasons[trial.name]))
    return runs


NO_BUDGET = (
    "--skip-predicted-oom needs a memory budget per device: give --memory-budget SIZE (e.g. --memory-budget 80GiB); "
    "no GPU memory is recorded for this machine to default to"
)


def estimate_runs(
    runs: Sequence[PlannedRun], *, budget_bytes: int | None = None, skip_predicted_oom: bool = False
) -> list[PlannedRun]:
    """Every run with its trial's memory estimate (:func:`hfscale.estimate.estimate_memory`, one per trial); with
    ``skip_predicted_oom``, a run whose estimate does not fit ``budget_bytes`` per device (CUDA context included on
    a GPU: :func:`hfscale.estimate.predict_fit`) is skipped with the predicted figure as its reason.

    The estimate is advice: a trial it cannot model (an unknown model type or optimizer) keeps no estimate, is
    launched, and the reason is logged.

    Raises:
        SweepError: when ``skip_predicted_oom`` is asked without a budget.
    """
    if skip_predicted_oom and budget_bytes is None:
        raise SweepError(NO_BUDGET)
    from hfscale.estimate import estimate_memory, predict_fit

    by_trial: dict[str, tuple[MemoryEstimate | None, str | None, str | None]] = {}
    out = []
    for run in runs:
        if run.name not in by_trial:
            spec = run.trial.spec
            try:
                if skip_predicted_oom and budget_bytes is not None:
                    fit = predict_fit(spec, budget_bytes)
                    by_trial[run.name] = (fit.estimate, None, None if fit.fits else fit.reason)
                else:
                    by_trial[run.name] = (estimate_memory(spec), None, None)
            except Exception as exc:  # advice only: a model the estimator cannot build must not stop the sweep
                error = short(f"{type(exc).__name__}: {exc}", 300)  # transformers lists every model type
                logger.warning("%s: no memory estimate (%s); it will be launched", run.name, error)
                by_trial[run.name] = (None, error, None)
        estimate, error, oom_reason = by_trial[run.name]
        predicted_oom = run.skip_reason is None and oom_reason is not None
        out.append(
            dataclasses.replace(
                run,
                estimate=estimate,
                estimate_error=error,
                skip_reason=oom_reason if predicted_oom else run.skip_reason,
                predicted_oom=predicted_oom,
            )
        )
    return out


def memory_budget(settings: SweepSettings, environment: Mapping[str, Any]) -> int | None:
    """The memory per device trials must fit: ``--memory-budget``, else the smallest GPU's memory as the
    environment record has it, else None (a CPU machine)."""
    if settings.memory_budget_bytes is not None:
        return settings.memory_budget_bytes
    if not environment.get("gpu_count"):
        return None  # a CPU machine: no device memory to default to
    from hfscale.results.environment import gpu_memory_bytes

    return gpu_memory_bytes(dict(environment))


# -- dry run ------------------------------------------------------------------------------------------------------


__all__ = [
    "NO_BUDGET",
    "NO_CUDA_DEVICE",
    "PlannedRun",
    "SettingError",
    "SkipCause",
    "SweepError",
    "SweepSettings",
    "device_not_visible",
    "estimate_runs",
    "memory_budget",
    "plan_runs",
    "skip_cause",
    "skip_reason",
]
