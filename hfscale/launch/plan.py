"""What a sweep will run: its settings (what the command line adds to a recipe) and the planned launches.

:class:`SweepSettings` declares each command-line option once: its flag, help, bounds and how ``--resume`` treats it
sit in the field's metadata, the parser of ``hfscale sweep`` is derived from it
(:func:`hfscale.commands.sweep.build_parser`),
and the bounds are checked in one place (``__post_init__``). :func:`plan_runs` expands the trials into launches
(repeats interleaved) and decides, without launching, what cannot run here; :func:`estimate_runs` adds each trial's
predicted peak memory (:mod:`hfscale.estimate`) and, on request, skips what is predicted not to fit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hfscale.core.text import short
from hfscale.recipes.schema import Recipe, RecipeTrial
from hfscale.strategy import EIGHT_BIT_OPTIMIZERS, Strategy

if TYPE_CHECKING:
    from hfscale.estimate import MemoryEstimate


logger = logging.getLogger(__name__)


class SweepError(RuntimeError):
    """A sweep that cannot start: the run folder exists or is locked, the recipe and run folder disagree, ..."""


class SettingError(ValueError):
    """A setting out of its bounds; ``setting`` is the field's name (the command line names the flag instead)."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem


def _memory_size(text: str) -> int:
    """``--memory-budget``'s parser: argparse prints an ArgumentTypeError's own message (a ValueError's it hides)."""
    import argparse

    from hfscale.core.units import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


ResumeRule = Literal["keep", "override"]


def _option(
    flag: str,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    least: float | None = None,
    positive: bool = False,
    group: str | None = None,
    resume: ResumeRule = "override",
) -> dict[str, Any]:
    """A field's metadata: its command-line flag and help, its bounds, and what ``--resume`` does with it
    (``keep``: it defines the trials, so a resumed run must use the recorded value; ``override``: a value given
    on the command line of the resumed run applies to the runs still to do, and is recorded in its entry)."""
    return {
        "flag": flag,
        "help": help,
        "parse": parse,
        "metavar": metavar,
        "least": least,
        "positive": positive,
        "group": group,
        "resume": resume,
    }


@dataclass(frozen=True, kw_only=True)
class SweepSettings:
    """What the command line adds to a recipe; recorded in environment.json so that ``--resume`` keeps it."""

    num_processes: int | None = field(
        default=None,
        metadata=_option(
            "--num-processes", "processes for trials that do not pin num_processes", least=1, resume="keep"
        ),
    )
    """Processes for trials that do not pin ``num_processes`` (None: the outer launch's, else the recipe's own)."""
    num_machines: int | None = field(
        default=None,
        metadata=_option("--num-machines", "machines for trials that do not pin num_machines", least=1, resume="keep"),
    )
    """Machines for trials that do not pin ``num_machines``."""
    memory_limit_gib: float | None = field(
        default=None,
        metadata=_option(
            "--memory-limit-gib", "address-space limit of every trial process (GiB), over the recipe's", positive=True
        ),
    )
    """Overrides every trial's ``run.memory_limit_gib``."""
    timeout_s: float | None = field(
        default=None,
        metadata=_option(
            "--timeout-s",
            "wall-clock limit of every trial in seconds, over the recipe's (with --resume: for the runs still to do)",
            positive=True,
        ),
    )
    """Overrides every trial's ``measure.timeout_s``."""
    repeats: int | None = field(
        default=None,
        metadata=_option(
            "--repeats",
            "runs of every trial, over the recipe's measure.repeats (with a target_precision: the fewest)",
            metavar="N",
            least=1,
        ),
    )
    """Overrides every trial's ``measure.repeats``."""
    only: tuple[str, ...] = field(
        default=(), metadata=_option("--only", "run only this trial (repeatable)", metavar="NAME")
    )
    """Run only these trials."""
    memory_budget_bytes: int | None = field(
        default=None,
        metadata=_option(
            "--memory-budget",
            "memory per device, e.g. 80GiB, 24GB, 512MiB: what --skip-predicted-oom checks the estimate against, "
            "where --find-max-batch starts, and what the report's recommendation must fit (default: the GPU's memory "
            "as environment.json records it; none on CPU)",
            parse=_memory_size,
            metavar="SIZE",
            least=1,
            group="memory",
        ),
    )
    """Memory per device (``--memory-budget``) for ``skip_predicted_oom``, the batch search's first size and the
    report's recommendation; None: the GPU memory ``environment.json`` records, if any."""
    skip_predicted_oom: bool = field(
        default=False,
        metadata=_option(
            "--skip-predicted-oom",
            "do not launch a trial whose estimated peak (hfscale estimate, plus the CUDA context on a GPU) exceeds "
            "the budget; its row is 'skipped' with the predicted figure",
            group="memory",
        ),
    )
    """Do not launch a trial whose estimated peak does not fit the budget; its row is ``skipped`` with the figure."""
    find_max_batch: bool = field(
        default=False,
        metadata=_option(
            "--find-max-batch",
            "after each trial, find the largest per-device batch that fits by short probe runs (each its own "
            "process group; logs in RUN/trials/NAME/probes/), starting from the estimate; out of memory is expected",
            group="memory",
        ),
    )
    """After each trial, search the largest per-device batch that fits (:mod:`hfscale.sweep.batch`)."""
    max_batch_limit: int = field(
        default=1024,
        metadata=_option(
            "--max-batch-limit",
            "largest per-device batch --find-max-batch tries (default %(default)s)",
            metavar="N",
            least=1,
            group="memory",
        ),
    )
    """Largest per-device batch the search tries."""
    probe_steps: int = field(
        default=3,
        metadata=_option(
            "--probe-steps",
            "optimizer steps per probe after the trial's warm-up steps (default %(default)s; at least 2: the "
            "steady-state throughput needs two timed steps)",
            metavar="N",
            least=2,
            group="memory",
        ),
    )
    """Optimizer steps of each batch-search probe after the trial's warm-up steps (at least 2: the steady-state
    throughput needs two timed steps)."""
    price_per_hour: float | None = field(
        default=None,
        metadata=_option(
            "--price-per-hour",
            "price of one device for one hour, in your currency: the report adds the cost per million tokens",
            metavar="PRICE",
            positive=True,
        ),
    )
    """Price of one device-hour; the report's cost per million tokens (None: no cost column)."""
    machine_wait_s: float = field(
        default=600.0,
        metadata=_option(
            "--machine-wait-s",
            "on several machines: how long machine 0 waits for another machine's driver before each trial (a "
            "machine that does not come makes a timeout row naming it) and another machine waits for machine 0's "
            "plan, in seconds (default %(default)s)",
            metavar="S",
            positive=True,
        ),
    )
    """How long a driver waits for another machine's driver (:mod:`hfscale.sweep.machines`): machine 0 before each trial
    on several machines, machine k for machine 0's plan; a driver that spoke and then went silent is not waited
    for."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            least, positive = f.metadata.get("least"), f.metadata.get("positive")
            if least is not None and value < least:
                raise SettingError(f.name, f"must be at least {least:g}, got {value:g}")
            if positive and value <= 0:
                raise SettingError(f.name, f"must be more than 0, got {value:g}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "only": list(self.only)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepSettings:
        """Settings as ``environment.json`` records them; keys of another hfscale version are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["only"] = tuple(kwargs.get("only") or ())
        return cls(**kwargs)

    def given(self) -> dict[str, Any]:
        """The settings that differ from their defaults (what a command line gave)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != SweepSettings.__dataclass_fields__[f.name].default
            and not (f.name == "only" and not self.only)
        }

    def for_resume(self, given: SweepSettings) -> SweepSettings:
        """These (recorded) settings with what ``given`` changes for a resumed run.

        A setting marked ``keep`` (the process and machine counts: they define the trials) must match the recorded
        value; any other given setting (``--timeout-s``, ``--memory-limit-gib``, ``--only``, ...) applies to the
        runs still to do.

        Raises:
            SweepError: when a ``keep`` setting differs from the recorded one, naming its flag and both values.
        """
        changes: dict[str, Any] = {}
        for name, value in given.given().items():
            meta = SweepSettings.__dataclass_fields__[name].metadata
            recorded = getattr(self, name)
            if value == recorded:
                continue
            if meta.get("resume") == "keep":
                raise SweepError(
                    f"{meta['flag']} {value} differs from the recorded {recorded}: a resumed run keeps the recorded "
                    f"{meta['flag']} so that its trials stay the same (omit it, or start a new run)"
                )
            logger.info("%s: %r replaces the recorded %r for the runs still to do", meta["flag"], value, recorded)
            changes[name] = value
        return dataclasses.replace(self, **changes)


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
