"""The largest per-device batch that fits: a search driven by real runs, started from the estimate.

The search only decides *which* batch size to try next; running a try (a fresh process that trains a few steps
and says whether it fit) is the caller's job, :func:`find_max_batch` takes it as ``probe``. An out-of-memory try is
an expected outcome, not a failure: it bounds the search. Any other error stops the search, with its reason, and
the result keeps the largest size that fitted so far.

The walk: probe ``start`` (:func:`suggest_start_batch` predicts it from the memory estimate); while it fits, double
(capped at ``upper_limit``) until a size runs out of memory; when ``start`` itself does not fit, halve until one
does. Then bisect between the largest size that fitted and the smallest that did not, until they are adjacent (or
``multiple_of`` apart). A size is never probed twice. With a start within a factor of two of the limit, that is
about ``2 + log2(start)`` probes.

For a sweep's trial (``--find-max-batch``), :func:`search_trial` chooses the start, counts the trial's own run as the
probe at its batch size, sizes each probe (:func:`probe_spec`) and returns the :class:`BatchSearchRecord` its row
stores; the sweep gives it a callable that launches one probe as its own process group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hfscale.records.batch import (
    MAX_BATCH_SUFFIX,
    BatchProbe,
    BatchSearchRecord,
    BatchSearchResult,
    ProbeOutcome,
    ProbeStatus,
    max_batch_base,
    max_batch_name,
)

if TYPE_CHECKING:
    from hfscale.launch.plan import PlannedRun, SweepSettings
    from hfscale.recipes.recipe import Recipe, RecipeTrial, SweepOptions
    from hfscale.records.row import TrialResult
    from hfscale.workload.spec import TrialSpec

logger = logging.getLogger(__name__)


def find_max_batch(
    probe: Callable[[int], ProbeOutcome],
    *,
    start: int,
    upper_limit: int = 4096,
    multiple_of: int = 1,
    on_probe: Callable[[BatchProbe], None] | None = None,
) -> BatchSearchResult:
    """Find the largest per-device batch size for which ``probe`` reports ``fits``.

    Args:
        probe: runs one try at a batch size (in its own process) and reports the outcome.
        start: first size tried, normally :func:`suggest_start_batch`; clamped into ``[1, upper_limit]``.
        upper_limit: largest size ever tried.
        multiple_of: stop bisecting when the bounds are this close (sizes stay multiples of it, 1 aside).
        on_probe: called after each probe (progress, appending to a log).

    Raises:
        ValueError: when ``upper_limit`` or ``multiple_of`` is not positive.
    """
    if upper_limit < 1 or multiple_of < 1:
        raise ValueError(f"upper_limit and multiple_of must be positive, got {upper_limit} and {multiple_of}")
    start = min(max(1, int(start)), upper_limit)
    if multiple_of > 1 and start > multiple_of:
        start -= start % multiple_of
    probes: list[BatchProbe] = []
    seen: dict[int, ProbeOutcome] = {}

    def run(batch: int) -> ProbeOutcome:
        if batch in seen:
            return seen[batch]
        outcome = probe(batch)
        if not isinstance(outcome, ProbeOutcome):
            raise TypeError(f"probe({batch}) returned {type(outcome).__name__}, expected ProbeOutcome")
        seen[batch] = outcome
        record = BatchProbe(batch_size=batch, outcome=outcome)
        probes.append(record)
        logger.info("batch %d: %s%s", batch, outcome.status, f" ({outcome.reason})" if outcome.reason else "")
        if on_probe is not None:
            on_probe(record)
        return outcome

    def result(fit: int | None, oom: int | None, stopped: str | None = None) -> BatchSearchResult:
        return BatchSearchResult(
            max_batch_size=fit,
            first_oom_batch_size=oom,
            probes=tuple(probes),
            stopped_reason=stopped,
            reached_upper_limit=fit == upper_limit,
            start=start,
        )

    def error(batch: int, outcome: ProbeOutcome) -> str:
        return f"batch {batch}: {outcome.reason or 'failed without an out-of-memory error'}"

    fit: int | None = None
    oom: int | None = None
    outcome = run(start)
    if outcome.status == "error":
        return result(None, None, error(start, outcome))
    if outcome.status == "fits":
        fit = start
        while oom is None and fit < upper_limit:
            nxt = min(fit * 2, upper_limit)
            outcome = run(nxt)
            if outcome.status == "error":
                return result(fit, None, error(nxt, outcome))
            if outcome.status == "fits":
                fit = nxt
            else:
                oom = nxt
        if oom is None:
            return result(fit, None)
    else:
        oom = start
        while fit is None and oom > 1:
            nxt = max(oom // 2, 1)
            if multiple_of > 1 and nxt > multiple_of:
                nxt -= nxt % multiple_of
            outcome = run(nxt)
            if outcome.status == "error":
                return result(None, oom, error(nxt, outcome))
            if outcome.status == "fits":
                fit = nxt
            else:
                oom = nxt
        if fit is None:
            return result(None, oom)

    step = multiple_of if fit >= multiple_of else 1
    while oom - fit > step:
        mid = (fit + oom) // 2
        if step > 1:
            mid -= mid % step
            if mid <= fit:
                break
        outcome = run(mid)
        if outcome.status == "error":
            return result(fit, oom, error(mid, outcome))
        if outcome.status == "fits":
            fit = mid
        else:
            oom = mid
    return result(fit, oom)


def suggest_start_batch(
    spec: TrialSpec, budget_bytes: int, *, reserve_bytes: int | None = None, upper_limit: int = 4096
) -> int:
    """The largest per-device batch the memory estimate predicts to fit ``budget_bytes``: the search's first probe.

    The estimate grows with the batch (activations linearly, the optimizer step's temporaries stepwise), so the
    largest size whose predicted peak plus the reserve (the CUDA context on a GPU) fits is found by bisection over
    the estimate; 1 when even that does not fit.

    Raises:
        ValueError: as :func:`hfscale.estimate.estimate_memory`.
    """
    from hfscale.estimate import default_reserve_bytes, estimate_memory

    reserve = default_reserve_bytes(spec.strategy.device) if reserve_bytes is None else reserve_bytes
    room = budget_bytes - reserve

    def fits(batch: int) -> bool:
        strategy = spec.strategy.replace(per_device_batch_size=batch)
        return estimate_memory(dataclasses.replace(spec, strategy=strategy)).total_bytes <= room

    if not fits(1):
        return 1
    low, high = 1, upper_limit + 1  # fits(low), not known beyond
    probe = 2
    while probe <= upper_limit and fits(probe):
        low, probe = probe, probe * 2
    high = min(probe, upper_limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


# -- one trial's search, as the sweep runs it ----------------------------------------------------------------------


def probe_spec(spec: TrialSpec, batch_size: int, *, probe_steps: int) -> TrialSpec:
    """The trial at another per-device batch size, trained for its warm-up steps plus ``probe_steps``.

    The data set holds exactly enough samples for that many full global batches, so that no step trains a smaller
    remainder batch (a recipe's 128 samples would otherwise cap a probe of 256).

    Raises:
        StrategyError: when the strategy refuses the batch size.
    """
    strategy = spec.strategy.replace(per_device_batch_size=batch_size)
    max_steps = spec.measure.warmup_steps + probe_steps
    global_batch = batch_size * strategy.gradient_accumulation_steps * strategy.num_processes
    return dataclasses.replace(
        spec,
        strategy=strategy,
        data=dataclasses.replace(spec.data, num_samples=global_batch * max_steps),
        measure=dataclasses.replace(spec.measure, max_steps=max_steps, num_epochs=1.0, repeats=1),
    )


def trial_probe(row: TrialResult) -> ProbeOutcome | None:
    """The trial's own run as a probe at its batch size: it fitted (ok) or ran out of memory; None otherwise."""
    if row.status == "ok":
        return ProbeOutcome(status="fits", samples_per_s=row.samples_per_s, peak_memory_gib=row.peak_gib)
    if row.status == "oom":
        return ProbeOutcome(status="oom", reason=f"the trial's own run: {row.reason}")
    return None


def why_not_searched(row: TrialResult, *, predicted_oom: bool) -> str | None:
    """Why a trial gets no batch search, or None: a trial predicted out of memory (``predicted_oom``), or that ran
    out of memory, is searched (a smaller batch may fit); one skipped for another reason, or that failed
    otherwise, is not."""
    if row.status == "skipped" and not predicted_oom:
        return f"skipped: {row.reason}"
    if row.status in ("crashed", "timeout", "not_applied"):
        return f"the trial ended {row.status}"
    if row.strategy.num_machines > 1:
        return "trials on several machines are not searched"
    return None


def search_key(trial: RecipeTrial) -> str:
    """What decides a trial's largest batch: everything of its spec and launch but its name, its batch size and the
    data set's length (probes size the data set themselves). Trials with the same key are searched once."""
    spec = trial.spec
    strategy = {k: v for k, v in spec.strategy.to_dict().items() if k not in ("name", "per_device_batch_size")}
    data = {k: v for k, v in dataclasses.asdict(spec.data).items() if k != "num_samples"}
    key = {
        "strategy": strategy,
        "model": dataclasses.asdict(spec.model),
        "data": data,
        "training_args": spec.training_args,
        "warmup_steps": spec.measure.warmup_steps,
        "timeout_s": spec.measure.timeout_s,
        "run": dataclasses.asdict(trial.run),
    }
    return json.dumps(key, sort_keys=True, default=str)


def search_trial(
    spec: TrialSpec,
    row: TrialResult,
    launch_probe: Callable[[TrialSpec], ProbeOutcome],
    *,
    budget_bytes: int | None,
    upper_limit: int,
    probe_steps: int,
    progress: Callable[[str], None] = logger.info,
) -> BatchSearchRecord:
    """Find the largest per-device batch that fits for a trial that has run (``row``, not searched: see
    :func:`why_not_searched`).

    Each probe is ``launch_probe`` of the trial at another batch size for its warm-up steps plus ``probe_steps``
    (:func:`probe_spec`; the sweep launches it as its own process group with the trial's limits). The trial's own
    run counts as the probe at its batch size. The first size is the estimate's largest that fits the budget
    (:func:`suggest_start_batch`) when there is a budget, else the trial's own; then :func:`find_max_batch`.

    Raises:
        KeyboardInterrupt: when interrupted; whatever ``launch_probe`` raises.
    """
    own_batch = spec.strategy.per_device_batch_size
    start, start_from = own_batch, "the trial's batch size"
    if budget_bytes is not None:
        try:
            start = suggest_start_batch(spec, budget_bytes, upper_limit=upper_limit)
            start_from = "the estimate"
        except Exception as exc:  # the estimate is advice: start from the trial's batch instead
            logger.warning("%s: no estimated start for the batch search (%s)", spec.name, exc)
    own = trial_probe(row)

    def probe(batch: int) -> ProbeOutcome:
        if own is not None and batch == own_batch:
            return own
        try:
            probed = probe_spec(spec, batch, probe_steps=probe_steps)
        except ValueError as exc:  # StrategyError: the strategy refuses this batch size
            return ProbeOutcome(status="error", reason=str(exc))
        progress(f"batch search: probing batch {batch}")
        return launch_probe(probed)

    def report(p: BatchProbe) -> None:
        o = p.outcome
        detail = (
            f"{o.samples_per_s:.2f} samples/s" if o.samples_per_s is not None else " ".join((o.reason or "").split())
        )
        progress(f"batch {p.batch_size}: {o.status}" + (f" ({detail[:100]})" if detail else ""))

    result = find_max_batch(probe, start=start, upper_limit=upper_limit, on_probe=report)
    found = (
        f"largest batch that fits: {result.max_batch_size}"
        + (f" ({result.samples_per_s:.2f} samples/s)" if result.samples_per_s is not None else "")
        + (f", out of memory at {result.first_oom_batch_size}" if result.first_oom_batch_size else "")
        + (f" (the upper limit {upper_limit}: may be higher)" if result.reached_upper_limit else "")
        + (f"; stopped: {result.stopped_reason}" if result.stopped_reason else "")
    )
    progress(f"{found} ({len(result.probes)} probes)")
    reused = own is not None and any(p.batch_size == own_batch for p in result.probes)
    return BatchSearchRecord(
        searched=True,
        result=result,
        start_from=start_from,
        upper_limit=upper_limit,
        probe_steps=probe_steps,
        budget_bytes=budget_bytes,
        trial_run_batch_size=own_batch if reused else None,
    )


# -- batch size as an axis: rows at the largest batch (a recipe's `sweep.batch`) -------------------------------------


def batch_settings(options: SweepOptions, settings: SweepSettings) -> SweepSettings:
    """The sweep's settings with the recipe's ``sweep.max_batch_limit``, unless ``--max-batch-limit`` was given (a
    CPU recipe needs a small one: without a memory limit nothing runs out of memory there, and the search would
    double up to the default). Which trials are searched is each trial's ``batch`` (:func:`searched`)."""
    if options.max_batch_limit is not None and "max_batch_limit" not in settings.given():
        return dataclasses.replace(settings, max_batch_limit=options.max_batch_limit)
    return settings


def searched(trial: RecipeTrial, settings: SweepSettings) -> bool:
    """Whether the sweep searches the trial's largest batch: ``--find-max-batch``, or its ``batch: max|both``."""
    return settings.find_max_batch or trial.batch != "fixed"


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
    import math

    spec = trial.spec
    batch = record.result.max_batch_size
    strategy = spec.strategy.replace(name=max_batch_name(trial.name), per_device_batch_size=batch)
    steps = max(1, math.ceil(spec.data.num_samples / spec.strategy.global_batch_size))
    measure = (original or trial).spec.measure
    new_spec = dataclasses.replace(
        spec,
        name=strategy.name,
        strategy=strategy,
        data=dataclasses.replace(spec.data, num_samples=steps * strategy.global_batch_size),
        measure=measure,
    )
    return dataclasses.replace(trial, spec=new_spec, source=f"{trial.source} at its largest batch ({batch})")


def max_batch_runs(
    runs: list[PlannedRun], stored: dict[tuple[str, int], TrialResult], recipe: Recipe
) -> list[PlannedRun]:
    """The max-batch rows still to run: one trial per ``batch: max|both`` trial of ``runs`` whose row in ``stored``
    found a largest batch, with the recipe's repeats, interleaved like the planned runs; rows already in ``stored``
    are left out (a resumed sweep runs only what is missing). A trial that asks for a target precision gets two
    runs (the least that rule asks for); the sweep's extra rounds toward the target follow the planned runs only.

    Raises:
        StrategyError: as :func:`max_batch_trial`.
    """
    originals = {t.name: t for t in recipe.trials}
    trials = []
    for run in runs:
        row = stored.get(run.key)
        if run.repeat != 0 or row is None or run.trial.batch == "fixed":
            continue
        trial = max_batch_trial(run.trial, row.batch_search, original=originals.get(run.name))
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
    "MAX_BATCH_SUFFIX",
    "BatchProbe",
    "BatchSearchRecord",
    "BatchSearchResult",
    "ProbeOutcome",
    "ProbeStatus",
    "batch_settings",
    "comparison_baseline",
    "find_max_batch",
    "fixed_batch_trials",
    "mark_max_batch",
    "max_batch_base",
    "max_batch_name",
    "max_batch_runs",
    "max_batch_trial",
    "probe_spec",
    "search_key",
    "search_trial",
    "searched",
    "suggest_start_batch",
    "trial_probe",
    "why_not_searched",
]
