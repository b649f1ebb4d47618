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
stores; the sweep gives it a callable that launches one probe as its own process group. What the rows at the
largest batch are (a recipe's ``sweep.batch``) is :mod:`hfscale.sweep.batch_axis`'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hfscale.launch.settings import SweepError
from hfscale.records.batch import (
    MAX_BATCH_SUFFIX,
    BatchProbe,
    BatchSearchRecord,
    BatchSearchResult,
    ProbeOutcome,
    ProbeStatus,
)

if TYPE_CHECKING:
    from hfscale.launch.plan import SweepSettings
    from hfscale.recipes.schema import RecipeTrial
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
        TypeError: when ``probe`` returns something other than a :class:`ProbeOutcome`.
    """
    if upper_limit < 1 or multiple_of < 1:
        raise ValueError(f"upper_limit and multiple_of must be positive, got {upper_limit} and {multiple_of}")
    start = min(max(1, int(start)), upper_limit)
    if multiple_of > 1 and start > multiple_of:
        start -= start % multiple_of
    search = _Search(probe=probe, on_probe=on_probe, start=start, upper_limit=upper_limit)
    outcome = search.run(start)
    if outcome.status == "error":
        return search.result(None, None, _stopped(start, outcome))
    if outcome.status == "fits":
        fit, oom, stopped = _double(search, start, upper_limit)
    else:
        fit, oom, stopped = _halve(search, start, multiple_of)
    if stopped is not None or fit is None or oom is None:
        return search.result(fit, oom, stopped)
    return _bisect(search, fit, oom, multiple_of)


@dataclasses.dataclass(kw_only=True)
class _Search:
    """The probes of one search: each size probed once, in the order probed."""

    probe: Callable[[int], ProbeOutcome]
    on_probe: Callable[[BatchProbe], None] | None
    start: int
    upper_limit: int
    probes: list[BatchProbe] = dataclasses.field(default_factory=list)
    seen: dict[int, ProbeOutcome] = dataclasses.field(default_factory=dict)

    def run(self, batch: int) -> ProbeOutcome:
        if batch in self.seen:
            return self.seen[batch]
        outcome = self.probe(batch)
        if not isinstance(outcome, ProbeOutcome):
            raise TypeError(f"probe({batch}) returned {type(outcome).__name__}, expected ProbeOutcome")
        self.seen[batch] = outcome
        record = BatchProbe(batch_size=batch, outcome=outcome)
        self.probes.append(record)
        logger.info("batch %d: %s%s", batch, outcome.status, f" ({outcome.reason})" if outcome.reason else "")
        if self.on_probe is not None:
            self.on_probe(record)
        return outcome

    def result(self, fit: int | None, oom: int | None, stopped: str | None = None) -> BatchSearchResult:
        return BatchSearchResult(
            max_batch_size=fit,
            first_oom_batch_size=oom,
            probes=tuple(self.probes),
            stopped_reason=stopped,
            reached_upper_limit=fit == self.upper_limit,
            start=self.start,
        )


_Bounds = tuple[int | None, int | None, str | None]
"""(largest size that fitted, smallest that ran out of memory, why the search stopped early)."""


def _stopped(batch: int, outcome: ProbeOutcome) -> str:
    return f"batch {batch}: {outcome.reason or 'failed without an out-of-memory error'}"


def _double(search: _Search, fit: int, upper_limit: int) -> _Bounds:
    """From a size that fits: double (capped at ``upper_limit``) until a size runs out of memory."""
    oom: int | None = None
    while oom is None and fit < upper_limit:
        nxt = min(fit * 2, upper_limit)
        outcome = search.run(nxt)
        if outcome.status == "error":
            return fit, None, _stopped(nxt, outcome)
        if outcome.status == "fits":
            fit = nxt
        else:
            oom = nxt
    return fit, oom, None


def _halve(search: _Search, oom: int, multiple_of: int) -> _Bounds:
    """From a size that does not fit: halve (kept a multiple of ``multiple_of``) until a size fits."""
    fit: int | None = None
    while fit is None and oom > 1:
        nxt = max(oom // 2, 1)
        if multiple_of > 1 and nxt > multiple_of:
            nxt -= nxt % multiple_of
        outcome = search.run(nxt)
        if outcome.status == "error":
            return None, oom, _stopped(nxt, outcome)
        if outcome.status == "fits":
            fit = nxt
        else:
            oom = nxt
    return fit, oom, None


def _bisect(search: _Search, fit: int, oom: int, multiple_of: int) -> BatchSearchResult:
    """Between a size that fits and a larger one that does not, until they are adjacent (or ``multiple_of``
    apart)."""
    step = multiple_of if fit >= multiple_of else 1
    while oom - fit > step:
        mid = (fit + oom) // 2
        if step > 1:
            mid -= mid % step
            if mid <= fit:
                break
        outcome = search.run(mid)
        if outcome.status == "error":
            return search.result(fit, oom, _stopped(mid, outcome))
        if outcome.status == "fits":
            fit = mid
        else:
            oom = mid
    return search.result(fit, oom)


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
    max_steps = spec.measure.planned_warmup_steps + probe_steps
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

    result = find_max_batch(probe, start=start, upper_limit=upper_limit, on_probe=lambda p: progress(_probe_line(p)))
    progress(_found_line(result, upper_limit))
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


def _probe_line(p: BatchProbe) -> str:
    o = p.outcome
    detail = f"{o.samples_per_s:.2f} samples/s" if o.samples_per_s is not None else " ".join((o.reason or "").split())
    return f"batch {p.batch_size}: {o.status}" + (f" ({detail[:100]})" if detail else "")


def _found_line(result: BatchSearchResult, upper_limit: int) -> str:
    found = (
        f"largest batch that fits: {result.max_batch_size}"
        + (f" ({result.samples_per_s:.2f} samples/s)" if result.samples_per_s is not None else "")
        + (f", out of memory at {result.first_oom_batch_size}" if result.first_oom_batch_size else "")
        + (f" (the upper limit {upper_limit}: may be higher)" if result.reached_upper_limit else "")
        + (f"; stopped: {result.stopped_reason}" if result.stopped_reason else "")
    )
    return f"{found} ({len(result.probes)} probes)"


def check_batch_search(trials: Sequence[RecipeTrial], settings: SweepSettings) -> None:
    """Refuse, before anything runs, a largest-batch search that cannot do what it is asked: for a user's script
    (its data is the script's own: the recipe key ``batch`` is refused there, and ``--find-max-batch`` was taken),
    or a batch axis (``batch: both`` or ``max``) under a limit below a trial's own batch (the search would start
    below it, and the ``-maxbatch`` row would run a smaller batch than the trial; ``--find-max-batch`` alone only
    records a largest batch, which may rightly be below a batch that runs out of memory).

    Raises:
        SweepError: naming the option or key.
    """
    for trial in trials:
        if not searched(trial, settings):
            continue
        if trial.spec.script is not None:  # a recipe's batch axis is refused at load (check_script_trial)
            raise SweepError("--find-max-batch: the largest-batch search trains data hfscale builds: not with "
                             "workload.script")  # fmt: skip
        own = trial.spec.strategy.per_device_batch_size
        if trial.batch != "fixed" and settings.max_batch_limit < own:  # a -maxbatch row smaller than the trial
            raise SweepError(
                f"the largest-batch search's limit {settings.max_batch_limit} (sweep.max_batch_limit or "
                f"--max-batch-limit) is below {trial.name}'s own per-device batch {own}: raise the limit to {own} "
                "or more"
            )


def searched(trial: RecipeTrial, settings: SweepSettings) -> bool:
    """Whether the sweep searches the trial's largest batch: ``--find-max-batch``, or its ``batch: max|both``."""
    return settings.find_max_batch or trial.batch != "fixed"


__all__ = [
    "MAX_BATCH_SUFFIX",
    "BatchProbe",
    "BatchSearchRecord",
    "BatchSearchResult",
    "ProbeOutcome",
    "ProbeStatus",
    "find_max_batch",
    "probe_spec",
    "search_key",
    "search_trial",
    "searched",
    "suggest_start_batch",
    "trial_probe",
    "why_not_searched",
]
