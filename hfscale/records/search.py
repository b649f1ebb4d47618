"""What an adaptive search decided, as it is written to disk: one :class:`SearchDecision` on each row it did not run
to the end (``skipped`` by the estimate, ``pruned`` on the evidence), and one :class:`SearchSummary` per run folder
(``search.json``: the question, why the search stopped, what it cost and what the grid would have cost).

The search itself (:mod:`hfscale.sweep.search`) is above; the report and ``hfscale.load_run`` read these records
without importing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

DecisionKind = Literal["skipped", "pruned", "too_slow", "over_budget", "unmeasured"]
"""skipped: the estimate says the trial cannot fit the budget even if it over-predicts by the margin, so it never
runs; pruned: slower than the leader beyond the noise; too_slow: below the throughput floor beyond the noise (the
least-memory question); over_budget: its measured peak does not fit the budget (it ran; its rows stay as they are);
unmeasured: its ok runs gave no steady samples/s, so it cannot be ranked (its rows stay as they are)."""

StopReason = Literal["decided", "runs_spent", "time_spent", "run_budget_spent", "nothing_fits", "no_trials"]
"""decided: every other contender is pruned or equal to the answer within the noise threshold; runs_spent: the
contenders left have run as often as a trial may (``measure.repeats``) and still cannot be told apart; time_spent /
run_budget_spent: ``--max-time`` / ``--max-runs`` ran out first; nothing_fits: no trial fits the budget or meets the
floor; no_trials: nothing was left to run."""


@dataclass(frozen=True, kw_only=True)
class NoiseFloor:
    """The least uncertainty a trial's mean speed may be given: that of one run of this machine over a longer time
    than the runs being judged.

    Where a machine's speed drifts over minutes (a shared or virtual machine), runs of one trial made close together
    share the drift: they agree with each other, and their mean is no better known than one run taken at another
    time, however many there are. A grid spreads each trial's runs over the whole sweep, so its pooled run-to-run
    noise is this floor's natural source; an adaptive search, whose repeats run minutes apart, uses it
    (``docs/search.md``)."""

    sd: float
    """Standard deviation of ln(samples/s) of one run (0.15: about 15%)."""
    df: int | None = None
    """Its degrees of freedom where it was estimated (a run folder's pool); None for a figure given as such, taken
    as known."""
    source: str = ""
    """Where it comes from, in words ("the pooled run noise of runs/grid: 7 trials, 28 df")."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sd) and self.sd > 0):
            raise ValueError(f"noise floor: expected a run-to-run noise above 0 (0.15 for 15%), got {self.sd}")
        if self.df is not None and self.df < 1:
            raise ValueError(f"noise floor: expected at least 1 degree of freedom, got {self.df}")

    @property
    def dof(self) -> float:
        """Degrees of freedom for a critical value: infinite for a figure taken as known."""
        return math.inf if self.df is None else float(self.df)


@dataclass(frozen=True, kw_only=True)
class SearchDecision:
    """Why the search stopped running one trial, with the evidence it stopped on."""

    trial: str
    kind: DecisionKind
    reason: str
    """The decision in a sentence, with its figures."""
    runs: int = 0
    """The trial's ok runs when it was decided."""
    leader: str | None = None
    """The trial it was compared with (pruned), if any."""
    ratio: float | None = None
    """Its speed over the leader's (ratio of geometric means over runs), or over the floor (too_slow)."""
    ratio_low: float | None = None
    ratio_high: float | None = None
    """The interval of ``ratio`` the decision was taken on (its confidence is the search's)."""
    predicted_gib: float | None = None
    """skipped: the estimate."""
    measured_gib: float | None = None
    """over_budget: the measured figure the budget was checked against (its largest run)."""
    budget_gib: float | None = None
    margin: float | None = None
    """skipped: how much the estimate may over-predict (0.25: by 25%), from its measured error."""
    sweep_runs: int = 0
    """Runs the whole sweep had made when the decision was taken."""
    elapsed_s: float = 0.0
    """The sweep's run time (sum of its runs' wall times) when the decision was taken."""


@dataclass(frozen=True, kw_only=True)
class SearchSummary:
    """One adaptive search of a run folder: the question, how it ended, and what it cost against the grid."""

    question: str
    """The question in words ("fastest within 1.50 GiB per device", "least memory at >= 200 samples/s")."""
    min_samples_per_s: float | None = None
    """The least-memory question's floor; None: the fastest-that-fits question."""
    stop: StopReason
    stop_reason: str
    """Why it stopped, in a sentence naming the trials left."""
    answer: str | None
    """The trial the search ends on (the leader; ties are the report's to break), or None."""
    contenders: tuple[str, ...] = ()
    """The trials still in the contest beside the answer when the search stopped (undecided against it, or equal
    to it within the noise threshold)."""
    runs: int = 0
    """Runs launched (ok or not); rows of skipped and pruned trials are not runs."""
    elapsed_s: float = 0.0
    """Sum of the launched runs' wall times."""
    grid_runs: int = 0
    """Runs the grid would have made: every trial's ``measure.repeats``, one for a trial skipped on its estimate
    (the grid does not repeat a trial whose first run fails)."""
    grid_estimate_s: float | None = None
    """What the grid would have taken: each trial's median measured wall time per run times its repeats (the
    median over all runs for a trial that never ran; a trial that ran only a short first run counts it, an
    under-estimate)."""
    confidence: float = 0.95
    """Of the intervals the decisions were taken on (Dunnett's many-to-one over the contenders)."""
    noise_floor: NoiseFloor | None = None
    """The least uncertainty of a trial's mean the decisions assumed (``--noise-floor``); None: none given."""
    trace: tuple[SearchDecision, ...] = field(default_factory=tuple)
    """Every decision, in the order taken."""

    def to_json(self) -> dict[str, Any]:
        from pydantic import TypeAdapter

        return TypeAdapter(SearchSummary).dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchSummary:
        """Raises: ValueError (pydantic's ValidationError) naming the field that does not validate."""
        from pydantic import TypeAdapter

        return TypeAdapter(SearchSummary).validate_python(data)


__all__ = ["DecisionKind", "NoiseFloor", "SearchDecision", "SearchSummary", "StopReason"]
