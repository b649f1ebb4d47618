"""The budget table: for each memory budget at which the answer changes, the fastest trial that fits and its
speed-up against the baseline.

"Fits" uses what the device really had to hold (``fit_gib``: NVML's process memory, else the allocator's reserved
peak, else the peak; the table says which). At each budget the answer is the recommendation's rule applied to the
trials that fit (:mod:`hfscale.report.fastest`): a trial that ties on speed with one that needs less memory never
buys anything, so the tie is broken by memory, and a trial the evidence puts among the slower ones does not tie.
Trials whose loss was flagged or whose speed may be unstable are left out. Two differences from the
recommendation: where a trial that may be unstable measured fastest, the recommendation names none; and the
recommendation leaves out the trials an adaptive search pruned, which the table keeps (below the memory of the
search's answer they are the measured answers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hfscale.report.columns import Column, fmt, interval_cell, verdict_cell
from hfscale.report.fastest import FastestPick, pick_fastest
from hfscale.report.noise import speed_tie
from hfscale.results.stats import SweepNoise

if TYPE_CHECKING:
    import pandas as pd


def budget_rows(frame: pd.DataFrame, evidence: SweepNoise) -> list[dict[str, Any]]:
    """One record per budget step, smallest budget first (empty when no trial qualifies): at each trial's memory
    figure, the fastest of the trials that fit by the recommendation's own rule
    (:func:`~hfscale.report.fastest.pick_fastest`), recorded where it changes."""
    ok = frame[(frame["status"] == "ok") & frame["samples_per_s"].notna() & frame["fit_gib"].notna()]
    ok = ok[~ok["parity_flagged"].fillna(False).astype(bool)]
    if "unstable" in ok:
        ok = ok[~ok["unstable"].fillna(False).astype(bool)]
    by_speed = ok.sort_values(["samples_per_s", "fit_gib"], ascending=[False, True], kind="stable")
    steps: list[tuple[float, FastestPick]] = []
    for budget in sorted(set(ok["fit_gib"])):
        pick = pick_fastest(by_speed[by_speed["fit_gib"] <= budget], evidence, by_speed)
        if steps and fmt(steps[-1][0], 3) == fmt(budget, 3):
            steps.pop()  # two budgets the table prints alike: the answer at the larger one
        if not steps or steps[-1][1].chosen["trial"] != pick.chosen["trial"]:
            steps.append((budget, pick))
    rows = []
    for k, (budget, pick) in enumerate(steps):
        before = steps[k - 1][1].chosen if k else None
        rows.append({**pick.chosen.to_dict(), "budget_gib": budget, "budget_note": _note(pick, before, evidence)})
    return rows


def _note(pick: FastestPick, before: Any, evidence: SweepNoise) -> str:
    """Against the row above (its figure, and whether the two tie), and which trials that fit tie with this one."""
    chosen = pick.chosen
    same = [str(other["trial"]) for other in pick.tied if other["trial"] != chosen["trial"]]
    parts = []
    if before is not None:
        name = str(before["trial"])
        tie, tested = speed_tie(chosen, before, evidence)
        gain = 100 * (chosen["samples_per_s"] / before["samples_per_s"] - 1)
        figure = f"its figure {abs(gain):.1f}% {'above' if gain >= 0 else 'below'} {name}'s"
        if tie:
            alike = any(r["trial"] == name for r in pick.least)  # pick.least is within pick.tied
            parts.append(f"ties on speed with {name}" + (" and needs as little memory within 2%" if alike else ""))
            parts.append(figure)
            same = [other for other in same if other != name]
        else:  # never shown slower than the row above: pick_fastest leaves out a trial shown slower than one that fits
            parts.append(
                (f"{gain:.1f}% faster than {name}" if gain >= 0 else figure) + ("" if tested else " (untested)")
            )
    if same:
        parts.append(f"ties on speed with {', '.join(same)}")
    return "; ".join(parts)


BUDGET_COLUMNS = [
    Column(key="budget_gib", header="budget from (GiB)", unit="GiB", cell=lambda r: f"≥ {fmt(r['budget_gib'], 3)}"),
    Column(key="trial", header="fastest that fits", align="left"),
    Column(key="samples_per_s", header="samples/s", unit="samples/s", digits=2),
    Column(key="samples_per_s_low", header="samples/s 95% interval", unit="samples/s", cell=interval_cell),
    Column(key="speedup_vs_baseline", header="speed-up vs baseline (x)", unit="x", cell=verdict_cell),
    Column(key="fit_source", header="memory counted", align="left", cell=lambda r: r.get("fit_source") or "—"),
    Column(key="budget_note", header="against the row above", align="left", cell=lambda r: r["budget_note"]),
]

BUDGET_NOTE = (
    "Read a row as: with at least this much memory per device, this is the fastest trial that fits, until the next "
    "row. The memory counted is what the device had to hold: NVML's process memory (CUDA context included) where "
    "it was read, else the allocator's reserved peak, else the peak (CPU: resident set). Each row is the "
    "recommendation's rule applied to the trials that fit (Recommendation, above): a speed tie is broken by memory, "
    "and a trial shown slower than one no faster than the leader does not tie. Trials with a flagged loss or a speed "
    "that may be unstable are left out; trials an adaptive search pruned stay."
)


__all__ = ["BUDGET_COLUMNS", "BUDGET_NOTE", "budget_rows"]
