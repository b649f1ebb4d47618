"""The budget table: for each memory budget at which the answer changes, the fastest trial that fits and its
speed-up against the baseline.

"Fits" uses what the device really had to hold (``fit_gib``: NVML's process memory, else the allocator's reserved
peak, else the peak; the table says which). Going up in memory, a trial takes over only when it is faster than the
one before it *beyond the noise*: a trial that ties on speed with one that needs less memory never buys anything,
so the tie is broken by memory. Trials whose loss was flagged or whose speed may be unstable are left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hfscale.report.columns import Column, fmt, interval_cell, speedup_cell
from hfscale.report.noise import speed_tie
from hfscale.results.stats import SweepNoise

if TYPE_CHECKING:
    import pandas as pd


def budget_rows(frame: pd.DataFrame, evidence: SweepNoise) -> list[dict[str, Any]]:
    """One record per budget step, smallest budget first (empty when no trial qualifies)."""
    ok = frame[(frame["status"] == "ok") & frame["samples_per_s"].notna() & frame["fit_gib"].notna()]
    ok = ok[~ok["parity_flagged"].fillna(False).astype(bool)]
    if "unstable" in ok:
        ok = ok[~ok["unstable"].fillna(False).astype(bool)]
    rows: list[dict[str, Any]] = []
    best: Any = None
    for _, row in ok.sort_values(["fit_gib", "samples_per_s"], ascending=[True, False], kind="stable").iterrows():
        if best is not None:
            if row["samples_per_s"] <= best["samples_per_s"]:
                continue
            if speed_tie(row, best, evidence)[0]:
                continue
        note = ""
        if best is not None:
            _, tested = speed_tie(row, best, evidence)
            gain = 100 * (row["samples_per_s"] / best["samples_per_s"] - 1)
            note = f"{gain:.1f}% faster than {best['trial']}" + ("" if tested else " (untested)")
        same = [
            str(other["trial"])
            for _, other in ok[ok["fit_gib"] <= row["fit_gib"]].iterrows()
            if other["trial"] != row["trial"] and speed_tie(row, other, evidence)[0]
        ]
        if same:
            note = "; ".join(filter(None, [note, f"ties on speed with {', '.join(same)}"]))
        rows.append({**row.to_dict(), "budget_gib": row["fit_gib"], "budget_note": note})
        best = row
    return rows


BUDGET_COLUMNS = [
    Column(key="budget_gib", header="budget from (GiB)", unit="GiB", cell=lambda r: f"≥ {fmt(r['budget_gib'], 3)}"),
    Column(key="trial", header="fastest that fits", align="left"),
    Column(key="samples_per_s", header="samples/s", unit="samples/s", digits=2),
    Column(key="samples_per_s_low", header="samples/s 95% interval", unit="samples/s", cell=interval_cell),
    Column(key="speedup_vs_baseline", header="speed-up vs baseline (x)", unit="x", cell=speedup_cell),
    Column(key="fit_source", header="memory counted", align="left", cell=lambda r: r.get("fit_source") or "—"),
    Column(key="budget_note", header="against the row above", align="left", cell=lambda r: r["budget_note"]),
]

BUDGET_NOTE = (
    "Read a row as: with at least this much memory per device, this is the fastest trial that fits, until the next "
    "row. The memory counted is what the device had to hold: NVML's process memory (CUDA context included) where "
    "it was read, else the allocator's reserved peak, else the peak (CPU: resident set). A trial needing more memory "
    "takes over only when it is faster beyond the noise; a tie is broken by memory (the smaller one stays). Trials "
    "with a flagged loss or a speed that may be unstable are left out."
)


__all__ = ["BUDGET_COLUMNS", "BUDGET_NOTE", "budget_rows"]
