"""Which trial is "the fastest" of a pool when speeds tie: one rule for the recommendation and the budget table.

The leader is the highest figure. Trials whose speed cannot be told apart from it (:func:`~hfscale.report.noise.
speed_tie`) tie with it, and memory breaks the tie: of the tied trials within 2% of the least memory, the highest
figure. Ties are not transitive, and the family of a comparison sets its width (against the baseline Dunnett's,
between two other trials the wider all-pairs family), so a trial T can tie with the leader although the leader is
shown faster than another trial that T measured no faster than. Such a T is not counted as tying: the evidence puts
it among the beaten, and memory must not pick it (a three-run ``cpu_techniques`` grid recommended ddp-x2 at 1.00x the
baseline, by memory, over lora-maxbatch, the only trial shown faster than the baseline: 1.30x, 1.01-1.69).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hfscale.report.noise import memory_tie, speed_tie
from hfscale.results.stats import SweepNoise

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, kw_only=True)
class FastestPick:
    """The fastest of a pool, its ties, and how the tie was broken."""

    leader: pd.Series
    """The highest figure."""
    tied: list[pd.Series]
    """The trials that tie with the leader, the leader first."""
    tested: bool
    """Whether every tie was tested with an interval (not only the 2% threshold)."""
    left_out: list[pd.Series]
    """Trials whose interval holds the leader's speed, not counted as tying: no faster by their figure than
    :attr:`beaten`."""
    beaten: pd.Series | None
    """The fastest trial (by figure) the leader is shown faster than; None when it is shown faster than none."""
    least: list[pd.Series]
    """The tied trials within 2% of the least memory (the leader alone when no tied trial has a memory figure)."""
    chosen: pd.Series
    """The answer: of :attr:`least`, the highest figure."""


def pick_fastest(pool: pd.DataFrame, evidence: SweepNoise, compared: pd.DataFrame | None = None) -> FastestPick:
    """The fastest of ``pool`` (sorted fastest first, not empty). ``compared`` (default ``pool``) holds the trials
    whose defeat by the leader leaves a slower-looking tie out: a trial the leader is shown faster than is evidence
    whether or not it fits the budget that made ``pool``."""
    leader = pool.iloc[0]
    others = (pool if compared is None else compared).iterrows()
    said = [(other, *speed_tie(leader, other, evidence)) for _, other in others if other["trial"] != leader["trial"]]
    beaten = max(
        (other for other, tie, tested in said if not tie and tested), key=lambda r: r["samples_per_s"], default=None
    )
    in_pool = set(pool["trial"])
    tied, tested_all, left_out = [leader], True, []
    for other, tie, tested in said:
        if not tie or other["trial"] not in in_pool:
            continue
        if beaten is not None and other["samples_per_s"] <= beaten["samples_per_s"]:
            left_out.append(other)
            continue
        tied.append(other)
        tested_all = tested_all and tested
    by_memory = sorted(tied, key=lambda r: r["fit_gib"])
    # A sub-MiB difference in resident memory must not pick a trial 35% slower by its figure; a trial without a
    # memory figure ties with nothing; with no figure at all the leader stays.
    least = [r for r in by_memory if memory_tie(by_memory[0], r)] or [leader]
    chosen = max(least, key=lambda r: r["samples_per_s"])
    return FastestPick(
        leader=leader, tied=tied, tested=tested_all, left_out=left_out, beaten=beaten, least=least, chosen=chosen
    )


__all__ = ["FastestPick", "pick_fastest"]
