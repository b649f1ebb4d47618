"""What a recipe is once loaded: the record types :func:`hfscale.recipes.recipe.load_recipe` builds.

A :class:`Recipe` holds what every trial shares and its :class:`RecipeTrial` list; each trial carries the
:class:`~hfscale.workload.spec.TrialSpec` the trial process reads plus how the sweep starts it (:class:`RunSpec`,
its batch mode). They live apart from the loader so that a module needing only the types (the planner, a launcher,
``hfscale recipes``) does not read the loader's YAML walking.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hfscale.core.validation import Invalid
from hfscale.recipes.checks import check_batch_fits_data, check_epoch_steps
from hfscale.strategy import Device, StrategyError
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec


class RecipeError(ValueError):
    """A recipe that cannot be run as written; the message starts with the file and the dotted key path."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """How a trial's processes are started (not part of what is measured)."""

    memory_limit_gib: float | None = None
    """Address-space limit (``RLIMIT_AS``) of every process of the trial, in GiB; None for no limit. It caps host
    memory only, so a CPU trial over it really runs out of memory. Note that CUDA maps far more address space than
    it uses: leave it unset for GPU trials."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the trial's processes (``OMP_NUM_THREADS``, ``NCCL_DEBUG``, ...)."""

    def __post_init__(self) -> None:
        if self.memory_limit_gib is not None and not 0 < self.memory_limit_gib < math.inf:
            raise ValueError(f"memory_limit_gib: expected a positive number, got {self.memory_limit_gib!r}")
        for name, value in self.env.items():  # what the OS refuses: the launch raised on it mid-sweep
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"env: {name!r} is not an environment variable's name (empty, or holds '=' or NUL)")
            if "\0" in value:
                raise ValueError(f"env.{name}: a value cannot hold a NUL character")


BatchMode = Literal["fixed", "max", "both"]
SearchMode = Literal["grid", "adaptive"]


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """How the sweep compares the trials (a recipe's ``sweep:`` section)."""

    batch: BatchMode = "fixed"
    """Which per-device batch the strategies are compared at. ``fixed``: each trial's own (the recipe's); the
    command line's ``--find-max-batch`` still records each trial's largest. ``both``: each trial at its own
    batch, and again as ``<trial>-maxbatch`` at the largest batch it fits (found by short probe runs), so a
    strategy that saves memory shows what the memory buys. ``max``: compare at the largest batch only: each trial
    runs once at its own batch (the search's first probe) and its ``-maxbatch`` row, with the recipe's repeats,
    is compared; the baseline is the baseline's ``-maxbatch`` row."""
    max_batch_limit: int | None = None
    """Largest per-device batch the search tries (``--max-batch-limit`` overrides it). Set it on CPU: without a
    ``run.memory_limit_gib`` nothing runs out of memory there, and the search would double up to 1024."""
    search: SearchMode = "grid"
    """``grid``: every trial runs ``measure.repeats`` times. ``adaptive``: trials the estimate says cannot fit are
    skipped, every other runs once (short), trials slower than the leader beyond the noise are pruned, and repeats
    go to the contenders until the answer is decided (``docs/search.md``). ``--search`` overrides it."""
    memory_budget_gib: float | None = None
    """Memory per device the answer must fit, in GiB (``--memory-budget`` overrides it; default: the GPU's
    memory, none on CPU)."""
    min_samples_per_s: float | None = None
    """Ask for the trial with the least memory whose samples/s is at least this, instead of the fastest that fits
    (``--min-samples-per-s`` overrides it)."""
    max_time_s: float | None = None
    """Adaptive: start no run once the runs took this many seconds of wall time in all (``--max-time``)."""
    max_runs: int | None = None
    """Adaptive: run at most this many (``--max-runs``)."""
    noise_floor: float | str | None = None
    """Adaptive: take no trial's mean speed as known better than one run of this noise: a figure (0.15, ``15%``) or
    the run folder of an earlier grid sweep on this machine, relative to the recipe's folder (``--noise-floor``;
    ``docs/search.md``)."""

    def __post_init__(self) -> None:
        if self.batch not in ("fixed", "max", "both"):
            raise ValueError(f"batch: expected one of 'fixed', 'max', 'both', got {self.batch!r}")
        if self.search not in ("grid", "adaptive"):
            raise ValueError(f"search: expected one of 'grid', 'adaptive', got {self.search!r}")
        for name in ("memory_budget_gib", "min_samples_per_s", "max_time_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and (math.isfinite(value) or name == "max_time_s")):
                raise ValueError(f"{name}: expected a number above 0, got {value!r}")
        if self.max_runs is not None and self.max_runs < 1:
            raise ValueError(f"max_runs: expected a positive integer, got {self.max_runs!r}")
        limit = self.max_batch_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_batch_limit: expected a positive integer, got {limit!r}")


@dataclass(frozen=True, kw_only=True)
class RecipeTrial:
    """One trial of a recipe: what the trial process gets, plus how the sweep starts it."""

    spec: TrialSpec
    """The trial as the trial process reads it (name, strategy, model, data, training_args, measure)."""
    run: RunSpec
    """The recipe's ``run`` section with this trial's overrides applied."""
    pinned: frozenset[str] = frozenset()
    """Strategy fields among ``num_processes``/``num_machines`` that the recipe sets for this trial; the others
    follow the sweep's launch."""
    source: str = ""
    """Where the trial comes from in the recipe (``trials[2]``, ``matrix[zero2-bf16]``), for error messages."""
    batch: BatchMode = "fixed"
    """Which per-device batch this trial is compared at (see :attr:`SweepOptions.batch`): the recipe's
    ``sweep.batch`` unless the trial sets its own ``batch:``."""

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A validated recipe; :func:`load_recipe` builds one from a file."""

    name: str
    """Short name (the file's stem unless set); run folders are named after it."""
    description: str = ""
    """What the recipe compares, in a sentence or two."""
    device: Device = "cuda"
    """Where every trial trains."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The model, built from its config with random weights."""
    data: DataSpec = field(default_factory=DataSpec)
    """The dummy data set."""
    training_args: dict[str, Any] = field(default_factory=dict)
    """Base ``TrainingArguments`` keywords (learning rate, logging, seed, ...) shared by every trial."""
    measure: MeasureSpec = field(default_factory=MeasureSpec)
    """Warm-up, length, repeats and per-trial timeout."""
    run: RunSpec = field(default_factory=RunSpec)
    """Memory limit and environment of the trial processes."""
    sweep: SweepOptions = field(default_factory=SweepOptions)
    """How the trials are compared (the batch size axis)."""
    baseline: str
    """Name of the trial the others are compared with."""
    trials: tuple[RecipeTrial, ...]
    """Every trial, explicit ones first, then the matrix's, in the order written."""
    path: str | None = None
    """The file it was loaded from, if any."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.trials]
        if not names:
            raise RecipeError(f"{self.path or '<recipe>'}: no trials: give `trials:` or `matrix:`")
        if self.baseline not in names:
            raise RecipeError(
                f"{self.path or '<recipe>'}: baseline: {self.baseline!r} is not a trial; trials are {', '.join(names)}"
            )

    @property
    def trial_names(self) -> list[str]:
        return [t.name for t in self.trials]

    def resolve(
        self, *, num_processes: int | None = None, num_machines: int | None = None, repeats: int | None = None
    ) -> list[RecipeTrial]:
        """The trials with the launch's process and machine counts applied to those that do not pin them.

        Args:
            num_processes: processes in all (every machine) for trials that do not set ``num_processes``.
            num_machines: machines for trials that do not set ``num_machines``.
            repeats: runs of every trial, in place of its ``measure.repeats`` (``--repeats``; with a
                ``target_precision``, the fewest).

        Raises:
            RecipeError: when a trial's strategy is invalid with these counts (e.g. not a multiple), or one step of
                it would take more samples than ``data.num_samples`` holds.
        """
        out = []
        for trial in self.trials:
            if repeats is not None:  # with a target precision, the fewest runs: the most stay at least as many
                measure = trial.spec.measure
                measure = dataclasses.replace(measure, repeats=repeats, max_repeats=max(measure.max_repeats, repeats))
                trial = dataclasses.replace(trial, spec=dataclasses.replace(trial.spec, measure=measure))
            out.append(self._with_counts(trial, num_processes=num_processes, num_machines=num_machines))
        return out

    def _with_counts(self, trial: RecipeTrial, *, num_processes: int | None, num_machines: int | None) -> RecipeTrial:
        """``trial`` with the launch's counts where it does not pin them, checked again."""
        changes: dict[str, int] = {}
        if num_processes is not None and "num_processes" not in trial.pinned:
            changes["num_processes"] = num_processes
        if num_machines is not None and "num_machines" not in trial.pinned:
            changes["num_machines"] = num_machines
        if not changes:
            return trial
        launch = ", ".join(f"{k}={v}" for k, v in changes.items())
        where = f"{self.path or '<recipe>'}: {trial.source} (with the launch's {launch})"
        try:
            strategy = trial.spec.strategy.replace(**changes)
            check_batch_fits_data(strategy, trial.spec.data, "")
            check_epoch_steps(dataclasses.replace(trial.spec, strategy=strategy), "measure")
        except StrategyError as exc:
            raise RecipeError(f"{where}: {exc}") from exc
        except Invalid as exc:
            raise RecipeError(f"{where}: {exc.path}: {exc.message}") from None
        return dataclasses.replace(trial, spec=dataclasses.replace(trial.spec, strategy=strategy))

    def trial_specs(self, *, num_processes: int | None = None, num_machines: int | None = None) -> list[TrialSpec]:
        """The :class:`TrialSpec` of every trial (see :meth:`resolve` for the counts)."""
        return [t.spec for t in self.resolve(num_processes=num_processes, num_machines=num_machines)]


@dataclass(frozen=True, kw_only=True)
class ShippedRecipe:
    """One shipped recipe as ``hfscale recipes`` lists it."""

    name: str
    """What to pass to ``hfscale sweep`` (the file's stem)."""
    path: Path
    """The file in the installed package."""
    description: str
    """The recipe's ``description:``."""
    device: str
    """Where its trials train (``cpu`` or ``cuda``)."""
    trial_count: int
    """Trials after the matrix is expanded (each runs ``measure.repeats`` times)."""
