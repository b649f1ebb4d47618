"""The report's first sentence: the strategy to use and why, or why none and what would decide it.

Everything in it is read from the analysis: the recommendation, the speed-up with its interval and verdict, the
peak against the budget. When nothing can be recommended on speed because the runs cannot rank the trials (one run
each, or trials that may be unstable), it says how many runs per trial would, and about how long they take at the
run's own measured cost per run (the median wall time of its ok rows, launch to exit).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hfscale.core.text import listed
from hfscale.core.units import GIB
from hfscale.report.columns import is_missing
from hfscale.report.machine import format_bytes
from hfscale.report.text import Span, Text, rich
from hfscale.report.trace import search_sentence
from hfscale.results.stats import sidak_critical

if TYPE_CHECKING:
    import pandas as pd

    from hfscale.report.analysis import Summary

MIN_RUNS = 3
"""Runs per trial the advice asks for at least: two give a noise estimate with one degree of freedom per trial,
three the shortest that a sequential ``target_precision`` stops at."""
MAX_RUNS = 20
"""More runs than this per trial: the difference is too small to chase; the advice says so instead."""
Z = 2.5
"""About the two-sided multiplier of a 95% interval shared by a handful of comparisons (Dunnett's for 5-20 trials
lies between 2.4 and 2.9): what the advice sizes the runs with."""


def _speedup_phrase(row: pd.Series, baseline: str | None) -> str:
    if baseline is None:
        return "no baseline that finished every run ok, so there is no speed-up"
    if row["trial"] == baseline:
        return "the baseline itself"
    value, verdict = row.get("speedup_vs_baseline"), row.get("verdict")
    if is_missing(value):
        return "no speed-up measured"
    low, high = row.get("speedup_low"), row.get("speedup_high")
    interval = "" if is_missing(low) or is_missing(high) else f", 95% interval {low:.2f}–{high:.2f}"
    if verdict == "faster":
        return f"{value:.2f}x the baseline's samples/s{interval}"
    if verdict == "tie":
        return f"as fast as the baseline within the noise ({value:.2f}x{interval})"
    if verdict == "slower":
        return f"{value:.2f}x the baseline's samples/s, slower{interval}"
    why = row.get("verdict_reason")
    return f"{value:.2f}x the baseline's samples/s, untested" + ("" if is_missing(why) else f": {why}")


def _budget_phrase(summary: Summary, row: pd.Series) -> str:
    rec = summary.recommendation
    # The figure the budget is checked against, named as the recommendation names it (NVML, reserved peak, peak).
    source = row.get("fit_source")
    fit = f"{row['fit_gib']:.3g} GiB" + ("" if is_missing(source) else f" ({source})")
    if rec.budget_bytes is None:
        return f"needs {fit}; no memory budget was given"
    return f"needs {fit} of the {format_bytes(rec.budget_bytes)} budget ({rec.budget_source})"


def _ties_phrase(summary: Summary, row: pd.Series) -> str:
    """The trials tied with the recommended one, each with its figure over the recommended one's: a tie within the
    noise can span trials far apart by their figures, and the first screen says how far."""
    ties = summary.recommendation.fastest_ties
    if not ties:
        return ""
    ratios = [summary.trials.loc[name, "samples_per_s"] / row["samples_per_s"] for name in ties]
    named = [f"{name} ({ratio:.2f}x)" for name, ratio in zip(ties, ratios, strict=True)]
    named[0] = f"{ties[0]} ({ratios[0]:.2f}x {summary.recommendation.fastest}'s samples/s)"
    return f"; it ties on speed with {listed(named)}"


def _recommended(summary: Summary) -> Text:
    rec = summary.recommendation
    row = summary.trials.loc[rec.fastest]
    ties = _ties_phrase(summary, row)
    sentence = rich(
        "Use **{name}** ({desc}): {speedup}, and it {budget}{ties}.",
        name=rec.fastest,
        desc=row["description"],
        speedup=_speedup_phrase(row, summary.baseline),
        budget=_budget_phrase(summary, row),
        ties=ties,
    )
    if summary.speed.noise.df >= 1:
        return sentence
    return sentence + _advice(summary, "No trial ran twice, so the ranking is untested: to test it", MIN_RUNS)


def runs_to_decide(summary: Summary) -> int | None:
    """Runs per trial that would rank the two fastest candidates: ``2 (Z sd / d)^2`` for a difference ``d`` of log
    samples/s and the run noise ``sd`` of the two (the sweep's pool where the trials share it; where they do not,
    the fewest runs whose Šidák interval on ``2 (n - 1)`` degrees of freedom excludes the gap), at least
    :data:`MIN_RUNS`; :data:`MIN_RUNS` when the noise is unknown (no trial ran twice); None when even
    :data:`MAX_RUNS` would not (a difference too small to chase)."""
    noise = summary.speed.noise
    ok = _contenders(summary)
    if noise.df < 1 or len(ok) < 2:
        return MIN_RUNS
    top = ok["samples_per_s"].sort_values(ascending=False)
    gap = math.log(top.iloc[0] / top.iloc[1])
    if gap <= 0:
        return None
    speed = summary.speed
    sd = speed.run_sd(*map(str, top.index[:2]))
    if not math.isfinite(sd):
        return MIN_RUNS
    if not speed.shared:  # each pair on its own noise: few degrees of freedom, so count them (Šidák, as the verdicts)
        family = max(len(speed.family()) - 1, 1)
        enough = (
            n for n in range(MIN_RUNS, MAX_RUNS + 1)
            if gap >= sidak_critical(family, 2 * (n - 1), speed.confidence) * sd * math.sqrt(2 / n)
        )  # fmt: skip
        return next(enough, None)
    runs = max(MIN_RUNS, math.ceil(2 * (Z * sd / gap) ** 2))
    return runs if runs <= MAX_RUNS else None


def _contenders(summary: Summary) -> pd.DataFrame:
    """The ok trials with a speed figure that fit the budget: the ones more runs would rank (a trial too large for
    the budget is no candidate, however far it leads)."""
    frame = summary.trials
    ok = frame[(frame["status"] == "ok") & frame["samples_per_s"].notna()]
    budget = summary.recommendation.budget_bytes
    return ok if budget is None else ok[ok["fit_gib"] * GIB <= budget]


def _cost_phrase(summary: Summary, runs: int) -> str:
    """About how long ``runs`` runs of every trial take beyond the runs already done, at the measured cost per run."""
    frame = summary.trials
    ok = frame[(frame["status"] == "ok") & frame["wall_time_s"].notna()]
    if ok.empty:
        return ""
    per_run = float(ok["wall_time_s"].median())
    done = frame["repeats_n"].fillna(1) if "repeats_n" in frame else frame["status"].map(lambda _: 1)
    more = float(sum(max(0, runs - int(n)) for n in done))
    if more <= 0:
        return ""
    seconds = more * per_run
    more_time = f"{seconds:.0f} more seconds" if seconds < 90 else f"{seconds / 60:.0f} more minutes"
    return f", about {more_time} at this sweep's {per_run:.0f} s per run (median wall time)"


def _undecided(summary: Summary) -> Text:
    rec = summary.recommendation
    why = rec.lines[0] if rec.lines else rich("No trial is recommended.")
    frame = summary.trials
    if frame.empty or not (frame["status"] == "ok").any():
        return why + rich(" Nothing to rank: see the trials that did not finish ok below.")
    if rec.undecided == "none_qualifies":
        return why + rich(" Nothing to rank: the Recommendation below names the ok trials left out, and why.")
    if rec.undecided == "too_large":
        return why + rich(" More runs cannot change that: a strategy that needs less memory, or a larger budget, can.")
    unstable = bool(frame["unstable"].fillna(False).astype(bool).any()) if "unstable" in frame else False
    if rec.most_frugal is not None and not unstable and summary.speed.noise.df >= 1:
        return why
    runs = runs_to_decide(summary)
    if runs is None:
        advice = (
            "The fastest two differ by less than more runs could resolve here: treat them as equal, or rerun on an "
            "idle machine."
        )
        return (*why, Span(" " + advice))
    idle = " on an idle machine (busy cores or GPUs flag a run as may be unstable)" if unstable else ""
    return why + _advice(summary, "To decide", runs, idle)


def _advice(summary: Summary, lead: str, runs: int, idle: str = "") -> Text:
    """`` LEAD, run each trial RUNS times (how) and about how long that takes.``"""
    return rich(
        " {lead}, run each trial {runs} times{idle} (`measure: {{repeats: {runs}}}`, or `--repeats {runs}`){cost}.",
        lead=lead,
        runs=runs,
        idle=idle,
        cost=_cost_phrase(summary, runs),
    )


def answer(summary: Summary) -> Text:
    """One sentence (two where the advice needs them) that answers the report's question; after an adaptive
    search, what it spent and why it stopped (and its own answer when it asked for the least memory)."""
    search = summary.search
    if search is not None and search.min_samples_per_s is not None:
        if search.answer is None:
            return rich("No trial answers {question}.", question=search.question) + search_sentence(search)
        return rich("Use **{name}**: {question}.", name=search.answer, question=search.question) + search_sentence(
            search
        )
    said = _recommended(summary) if summary.recommendation.fastest is not None else _undecided(summary)
    return said if search is None else said + search_sentence(search)


__all__ = ["answer", "runs_to_decide"]
