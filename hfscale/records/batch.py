"""The largest-batch search as a row stores it: each probe's outcome, the search's result, and the row's record.

The search itself (:mod:`hfscale.sweep.batch`) runs probes; these types are what it leaves behind, read by the report
and by storage without importing the search.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

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


@dataclass(frozen=True, kw_only=True)
class BatchSearchRecord:
    """What a result row stores of ``--find-max-batch`` for its trial: the search, or why there was none."""

    searched: bool
    """False when the trial was not searched (see ``reason``)."""
    reason: str | None = None
    """Why the trial was not searched (it crashed, timed out, spans several machines, ...)."""
    result: BatchSearchResult | None = None
    """The search; None when not searched."""
    start_from: str | None = None
    """What chose the first batch size tried: ``the estimate`` or ``the trial's batch size``."""
    upper_limit: int | None = None
    """Largest per-device batch the search was allowed to try."""
    probe_steps: int | None = None
    """Optimizer steps of each probe after the trial's warm-up steps."""
    budget_bytes: int | None = None
    """The memory budget per device the estimate started from; None without one."""
    trial_run_batch_size: int | None = None
    """The probe at this batch size is the trial's own run (not launched again)."""
    same_as: str | None = None
    """The search was not repeated: this other trial differs only in its batch size and was searched."""
    max_batch_of: str | None = None
    """Set on a max-batch row (``sweep.batch: both|max``): this row is trial ``max_batch_of`` measured again at the
    largest batch its search found. Its samples/s compares with fixed-batch rows; its step time and loss curve do
    not (another batch, another job)."""

    @staticmethod
    def migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
        """A schema-1 row's ``extra["batch_search"]`` (the search's fields flat beside the record's, probes flat)
        as this record's dict."""
        own = {f.name for f in dataclasses.fields(BatchSearchRecord)} - {"result"}
        record = {k: v for k, v in data.items() if k in own}
        if data.get("searched") and "max_batch_size" in data:
            outcome_keys = {f.name for f in dataclasses.fields(ProbeOutcome)}
            probes = [
                {"batch_size": p["batch_size"], "outcome": {k: v for k, v in p.items() if k in outcome_keys}}
                for p in data.get("probes", [])
            ]
            result_keys = {f.name for f in dataclasses.fields(BatchSearchResult)} - {"probes"}
            record["result"] = {**{k: v for k, v in data.items() if k in result_keys}, "probes": probes}
        return record


MAX_BATCH_SUFFIX = "-maxbatch"
"""A max-batch row's name is its trial's plus this (``fp32`` -> ``fp32-maxbatch``)."""


def max_batch_name(trial: str) -> str:
    """The name of ``trial``'s row at the largest batch it fits."""
    return trial + MAX_BATCH_SUFFIX


def max_batch_base(name: str) -> str | None:
    """The trial a max-batch row's name belongs to; None for any other name."""
    return name.removesuffix(MAX_BATCH_SUFFIX) if name.endswith(MAX_BATCH_SUFFIX) else None
