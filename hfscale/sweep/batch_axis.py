"""Batch size as an axis (a recipe's ``sweep.batch``): which batch each trial is compared at, and the rows at the
largest batch its search found.

``batch: fixed`` compares every trial at its own per-device batch; ``both`` adds, after every fixed-batch run, one
row per searched trial at its largest batch (named :func:`~hfscale.records.batch.max_batch_name`); ``max`` compares
at the largest batch only (the trial's own run is then the search's first probe). The search itself is
:mod:`hfscale.sweep.batch`'s.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hfscale.records.batch import BatchSearchRecord, max_batch_base, max_batch_name
from hfscale.workload.lengths import sequences_for_rows
from hfscale.workload.steps import batches_its_own_way, rows_per_epoch, steps_per_epoch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hfscale.launch.plan import PlannedRun, SweepSettings
    from hfscale.recipes.schema import Recipe, RecipeTrial, SweepOptions
    from hfscale.records.row import TrialResult
    from hfscale.strategy import Strategy
    from hfscale.workload.spec import TrialSpec


def batch_settings(options: SweepOptions, settings: SweepSettings) -> SweepSettings:
    """The sweep's settings with the recipe's ``sweep.max_batch_limit``, unless ``--max-batch-limit`` was given (a
    CPU recipe needs a small one: without a memory limit nothing runs out of memory there, and the search would
    double up to the default). Which trials are searched is each trial's ``batch``
    (:func:`hfscale.sweep.batch.searched`)."""
    if options.max_batch_limit is not None and "max_batch_limit" not in settings.given():
        return dataclasses.replace(settings, max_batch_limit=options.max_batch_limit)
    return settings


def comparison_baseline(recipe: Recipe) -> str:
    """The trial the others are compared with: the recipe's baseline, or when that trial is compared at the
    largest batch only (``batch: max``) its max-batch row."""
    base = next((t for t in recipe.trials if t.name == recipe.baseline), None)
    return max_batch_name(recipe.baseline) if base is not None and base.batch == "max" else recipe.baseline


def fixed_batch_trials(trials: list[RecipeTrial]) -> list[RecipeTrial]:
    """The trials as the sweep runs them at their own batch: a ``batch: max`` trial once (that run is the search's
    first probe, not the comparison, so it needs no repeats); the others unchanged."""
    out = []
    for trial in trials:
        if trial.batch == "max":
            measure = dataclasses.replace(trial.spec.measure, repeats=1, target_precision=None)
            trial = dataclasses.replace(trial, spec=dataclasses.replace(trial.spec, measure=measure))
        out.append(trial)
    return out


def max_batch_trial(
    trial: RecipeTrial, record: BatchSearchRecord | None, *, original: RecipeTrial | None = None
) -> RecipeTrial | None:
    """``trial`` at the largest per-device batch its search found, named :func:`max_batch_name`; None when there
    is no such batch (not searched, none fitted).

    The data set is resized so that the row trains the same number of optimizer steps per epoch as the trial (a
    larger batch over the same samples would leave fewer timed steps, or none): throughput is then measured over
    as many steps at either batch. ``original`` (the recipe's trial, before :func:`fixed_batch_trials`) gives the
    measure section (repeats) of the row.

    Raises:
        StrategyError: when the strategy refuses the batch size (the search probed it, so it does not).
    """
    if record is None or not record.searched or record.result is None or record.result.max_batch_size is None:
        return None
    spec = trial.spec
    batch = record.result.max_batch_size
    strategy = spec.strategy.replace(name=max_batch_name(trial.name), per_device_batch_size=batch)
    measure = (original or trial).spec.measure
    new_spec = dataclasses.replace(
        spec,
        name=strategy.name,
        strategy=strategy,
        data=dataclasses.replace(spec.data, num_samples=_samples_for(spec, strategy)),
        measure=measure,
    )
    return dataclasses.replace(trial, spec=new_spec, source=f"{trial.source} at its largest batch ({batch})")


def _samples_for(spec: TrialSpec, strategy: Strategy) -> int:
    """The samples that give ``strategy`` (the larger batch) as many full optimizer steps per epoch as ``spec``
    has (where its ``training_args`` batch an epoch their own way, as many as its whole batches): for packed data,
    the sequences that pack into exactly those steps' rows."""
    rows = rows_per_epoch(spec.data) or spec.data.num_samples
    steps = steps_per_epoch(spec.strategy, rows)
    if batches_its_own_way(spec.training_args):  # drop_last trains the whole batches only
        steps = max(1, rows // spec.strategy.global_batch_size)
    rows_needed = steps * strategy.global_batch_size
    return sequences_for_rows(spec.data, rows_needed) if spec.data.packing == "pack" else rows_needed


def max_batch_runs(
    runs: list[PlannedRun], stored: dict[tuple[str, int], TrialResult], originals: Sequence[RecipeTrial]
) -> list[PlannedRun]:
    """The max-batch rows still to run: one trial per ``batch: max|both`` trial of ``runs`` whose row in ``stored``
    found a largest batch, with the repeats of its trial in ``originals`` (the recipe's, before
    :func:`fixed_batch_trials`, with ``--repeats``), interleaved like the planned runs; rows already in ``stored``
    are left out (a resumed sweep runs only what is missing). A trial that asks for a target precision gets two
    runs (the least that rule asks for); the sweep's extra rounds toward the target follow the planned runs only.

    Raises:
        StrategyError: as :func:`max_batch_trial`.
    """
    by_name = {t.name: t for t in originals}
    trials = []
    for run in runs:
        row = stored.get(run.key)
        if run.repeat != 0 or row is None or run.trial.batch == "fixed":
            continue
        trial = max_batch_trial(run.trial, row.batch_search, original=by_name.get(run.name))
        if trial is not None:
            trials.append((run, trial))

    def count(trial: RecipeTrial) -> int:
        measure = trial.spec.measure
        return measure.repeats if measure.target_precision is None else max(2, measure.repeats)

    out: list[PlannedRun] = []
    for repeat in range(max((count(t) for _, t in trials), default=0)):
        for run, trial in trials:
            if repeat < count(trial) and (trial.name, repeat) not in stored:
                out.append(
                    dataclasses.replace(
                        run, trial=trial, repeat=repeat, index=len(runs) + len(out), skip_reason=None, estimate=None,
                        estimate_error=None, predicted_oom=False,
                    )
                )  # fmt: skip
    return out


def mark_max_batch(row: TrialResult, run: PlannedRun, stored: dict[tuple[str, int], TrialResult]) -> TrialResult:
    """A max-batch row with its trial's search record, marked :attr:`BatchSearchRecord.max_batch_of` (what the
    report reads to say the row ran another batch)."""
    of = max_batch_base(run.name) or run.name
    found = stored.get((of, 0))
    record = found.batch_search if found is not None else None
    if record is None:
        record = BatchSearchRecord(searched=False, reason=f"the max-batch row of {of}")
    marked = dataclasses.replace(record, max_batch_of=of, trial_run_batch_size=None)
    return dataclasses.replace(row, batch_search=marked)


__all__ = [
    "batch_settings",
    "comparison_baseline",
    "fixed_batch_trials",
    "mark_max_batch",
    "max_batch_runs",
    "max_batch_trial",
]
