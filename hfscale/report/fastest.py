"""Which trial is "the fastest" of a pool when speeds tie: one rule for the recommendation and the budget table.

The leader is the highest figure. Trials whose speed cannot be told apart from it (:func:`~hfscale.report.noise.
speed_tie`) tie with it, and memory breaks the tie: of the tied trials within 2% of the least memory, the highest
figure. Ties are not transitive, and the family of a comparison sets its width (against the baseline Dunnett's,
between two other trials the wider all-pairs family), so a trial T can tie with the leader although the evidence
puts it among the slower ones. Such a T is not counted as tying, and memory cannot pick it, when

- a trial no faster by its figure than the leader (within the budget or not) is shown faster than T, or
- the leader is shown faster than a trial (within the budget or not) that T measured no faster than: a three-run
  ``cpu_techniques`` grid recommended ddp-x2 at 1.00x the baseline (248.57 samples/s against the baseline's
  249.50), by memory, over lora-maxbatch, the only trial shown faster than the baseline (1.30x, 1.01-1.69).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hfscale.report.noise import memory_tie, speed_tie
from hfscale.results.stats import SweepNoise

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, kw_only=True)
class LeftOut:
    """A trial whose interval holds the leader's speed, not counted as tying with it."""

    trial: pd.Series
    by: pd.Series
    """The trial that puts it out."""
    shown_faster: bool
    """True: ``by`` is shown faster than it. False: it is no faster by its figure than ``by``, which the leader is
    shown faster than."""


@dataclass(frozen=True, kw_only=True)
class FastestPick:
    """The fastest of a pool, its ties, and how the tie was broken."""

    leader: pd.Series
    """The highest figure."""
    tied: list[pd.Series]
    """The trials that tie with the leader, the leader first."""
    tested: bool
    """Whether every tie was tested with an interval (not only the 2% threshold)."""
    left_out: list[LeftOut]
    least: list[pd.Series]
    """The tied trials within 2% of the least memory (the leader alone when no tied trial has a memory figure)."""
    chosen: pd.Series
    """The answer: of :attr:`least`, the highest figure."""


def shown_faster(a: pd.Series, b: pd.Series, evidence: SweepNoise) -> bool:
    """Whether ``a`` is faster than ``b`` beyond the noise, tested with an interval."""
    tie, tested = speed_tie(a, b, evidence)
    return tested and not tie and a["samples_per_s"] > b["samples_per_s"]


def pick_fastest(pool: pd.DataFrame, evidence: SweepNoise, compared: pd.DataFrame | None = None) -> FastestPick:
    """The fastest of ``pool`` (sorted fastest first, not empty). ``compared`` (default ``pool``) holds the trials
    the leader may be shown faster than: that evidence holds whether or not they fit the budget that made ``pool``."""
    leader = pool.iloc[0]
    rivals = [row for _, row in pool.iloc[1:].iterrows()]
    others = rivals if compared is None else [r for _, r in compared.iterrows() if r["trial"] != leader["trial"]]
    beaten = max(
        (other for other in others if shown_faster(leader, other, evidence)),
        key=lambda r: r["samples_per_s"],
        default=None,
    )
    tied, tested_all, left_out = [leader], True, []
    for other in rivals:
        tie, tested = speed_tie(leader, other, evidence)
        if not tie:
            continue
        by = next(
            (
                r
                for r in others
                if r["trial"] != other["trial"]
                and r["samples_per_s"] <= leader["samples_per_s"]
                and shown_faster(r, other, evidence)
            ),
            None,
        )
        if by is not None:
            left_out.append(LeftOut(trial=other, by=by, shown_faster=True))
        elif beaten is not None and other["samples_per_s"] <= beaten["samples_per_s"]:
            left_out.append(LeftOut(trial=other, by=beaten, shown_faster=False))
        else:
            tied.append(other)
            tested_all = tested_all and tested
    by_memory = sorted(tied, key=lambda r: r["fit_gib"])
    # A sub-MiB difference in resident memory must not pick a trial 35% slower by its figure; a trial without a
    # memory figure ties with nothing; with no figure at all the leader stays.
    least = [r for r in by_memory if memory_tie(by_memory[0], r)] or [leader]
    chosen = max(least, key=lambda r: r["samples_per_s"])
    return FastestPick(leader=leader, tied=tied, tested=tested_all, left_out=left_out, least=least, chosen=chosen)


__all__ = ["FastestPick", "LeftOut", "pick_fastest", "shown_faster"]
