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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from hfscale.spec import TrialSpec

logger = logging.getLogger(__name__)

ProbeStatus = Literal["fits", "oom", "error"]


@dataclass(frozen=True, kw_only=True)
class ProbeOutcome:
    """What one try at a batch size gave."""

    status: ProbeStatus
    """fits: trained its steps; oom: ran out of device or host memory; error: failed for another reason."""
    samples_per_s: float | None = None
    """Throughput of the try when it fitted."""
    peak_memory_gib: float | None = None
    """Measured peak memory per device when it fitted, if the probe reads it."""
    reason: str | None = None
    """Why it did not fit or failed, in a sentence (the OOM message, the last error line)."""

    def __post_init__(self) -> None:
        if self.status not in ("fits", "oom", "error"):
            raise ValueError(f"ProbeOutcome.status: expected 'fits', 'oom' or 'error', got {self.status!r}")


@dataclass(frozen=True, kw_only=True)
class BatchProbe:
    """One probe of the search, in the order it ran."""

    batch_size: int
    outcome: ProbeOutcome


@dataclass(frozen=True, kw_only=True)
class BatchSearchResult:
    """Where the search ended and every probe on the way."""

    max_batch_size: int | None
    """Largest per-device batch that fitted; None when none did (or the first probe errored)."""
    first_oom_batch_size: int | None
    """Smallest batch that ran out of memory; None when none did (the limit is ``upper_limit`` or beyond)."""
    probes: tuple[BatchProbe, ...] = ()
    stopped_reason: str | None = None
    """Set when a non-OOM error ended the search early."""
    reached_upper_limit: bool = False
    """The largest size allowed fitted: the real limit may be higher."""
    start: int = 1

    @property
    def samples_per_s(self) -> float | None:
        """Throughput at the largest batch that fitted."""
        for probe in self.probes:
            if probe.batch_size == self.max_batch_size:
                return probe.outcome.samples_per_s
        return None

    def to_dict(self) -> dict[str, Any]:
        """As a result row stores it (``row.extra["batch_search"]``)."""
        data = dataclasses.asdict(self)
        data["probes"] = [{"batch_size": p.batch_size, **dataclasses.asdict(p.outcome)} for p in self.probes]
        data["samples_per_s"] = self.samples_per_s
        return data


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


OOM_MARKERS: tuple[str, ...] = (
    "CUDA out of memory",
    "OutOfMemoryError",
    "can't allocate memory",
    "MemoryError",
    "std::bad_alloc",
    "Cannot allocate memory",
)
"""Substrings of stderr that mean a run ran out of memory (torch CUDA/CPU allocators, Python, C++)."""


def looks_like_oom(stderr: str) -> bool:
    """Whether a failed run's stderr says it ran out of memory."""
    return any(marker in stderr for marker in OOM_MARKERS)


__all__ = [
    "OOM_MARKERS",
    "BatchProbe",
    "BatchSearchResult",
    "ProbeOutcome",
    "ProbeStatus",
    "find_max_batch",
    "looks_like_oom",
    "suggest_start_batch",
]
