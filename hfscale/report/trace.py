"""An adaptive search in words: one sentence for the answer (what it spent against the grid, and why it stopped),
and its decision trace (what was skipped or pruned, when, on what evidence) for its own section.

Read from ``search.json`` (:class:`hfscale.records.search.SearchSummary`); a grid sweep has none, and nothing here
is shown for it.
"""

from __future__ import annotations

from hfscale.core.text import clock
from hfscale.records.search import SearchDecision, SearchSummary
from hfscale.report.text import Text, plain, rich

KIND_WORDS = {
    "skipped": "skipped (estimate)",
    "pruned": "pruned",
    "too_slow": "pruned (below the floor)",
    "over_budget": "over the budget",
    "unmeasured": "not ranked",
}


def cost_phrase(search: SearchSummary) -> str:
    """``15 runs (3:02 of summed run time) against the grid's 35 (about 7:10)``."""
    grid = f" (about {clock(search.grid_estimate_s)})" if search.grid_estimate_s is not None else ""
    spent = f"{search.runs} runs ({clock(search.elapsed_s)} of summed run time)"
    return f"{spent} against the grid's {search.grid_runs}{grid}"


def search_sentence(search: SearchSummary) -> Text:
    """What the answer adds for an adaptive search: its question, what it spent, and why it stopped; without a
    noise floor, that its verdicts rest on the noise of its own runs (the caveat belongs beside the answer: the
    decision trace is further down)."""
    said = rich(
        " An adaptive search asked for {question} and spent {cost}; it stopped: {why}.",
        question=search.question,
        cost=cost_phrase(search),
        why=search.stop_reason,
    )
    if search.noise_floor is not None:
        return said
    return said + plain(
        " Its verdicts rest on the noise its own runs measured over minutes: on a machine whose speed drifts, "
        "confirm the answer by a grid or give --noise-floor (How the search decided)."
    )


def decision_line(decision: SearchDecision) -> Text:
    """One decision: when (runs and summed run time so far), which trial, what, and on what evidence."""
    when = "before any run"
    if decision.sweep_runs:
        when = f"after {decision.sweep_runs} runs ({clock(decision.elapsed_s)} of summed run time)"
    return rich(
        "{when}: **{trial}** {kind}: {reason}.",
        when=when,
        trial=decision.trial,
        kind=KIND_WORDS.get(decision.kind, decision.kind),
        reason=decision.reason,
    )


def search_paragraphs(search: SearchSummary) -> tuple[Text, ...]:
    """The search's section: its question and cost, why it stopped, and how the grid's time was estimated."""
    return (
        rich("Question: {q}. Stopped ({stop}): {why}.", q=search.question, stop=search.stop, why=search.stop_reason),
        plain(
            f"Spent {cost_phrase(search)}. The grid's time is estimated from this run's own measurements: each trial's "
            "median wall time per run at full length (a shortened first run lengthened by its left-out steps at its "
            "own mean step time) times its measure.repeats: once for a trial whose first run failed or that was "
            "skipped on its estimate (the grid does not repeat a failed first run), never for one the sweep does not "
            "launch; the median over all runs for a trial that never ran. Batch-search probes are counted in neither."
        ),
        plain(
            f"A pruned trial's speed ratio to the leader had its {search.confidence:.0%} interval below 1 and its "
            "value beyond the 2% noise threshold (ratio of geometric means over runs, Dunnett's many-to-one over the "
            "contenders, the run-to-run noise pooled over the sweep); one pruned below a throughput floor had its "
            "Šidák interval below the floor. A skipped trial's estimate did not fit the budget even at its largest "
            "measured over-prediction. Their runs stay in the tables as measured; they are never recommended."
        ),
        plain(_floor_words(search)),
    )


def _floor_words(search: SearchSummary) -> str:
    """What noise the decisions rested on beside their own runs."""
    floor = search.noise_floor
    if floor is None:
        return (
            "No noise floor was given: the noise is the one the search's runs measured, over the minutes they ran. On "
            "a machine whose speed drifts (shared, virtual), confirm a decided answer later or by the grid, or give "
            "--noise-floor (docs/search.md)."
        )
    return (
        f"Noise floor: {floor.sd:.1%} of one run ({floor.source}): no trial's mean speed was taken as known better "
        "than one run of it, however many runs it had (Šidák over the contenders instead of Dunnett); the verdicts "
        "of this report use it too."
    )


def search_items(search: SearchSummary) -> tuple[Text, ...]:
    """Every decision, in the order taken."""
    return tuple(decision_line(d) for d in search.trace) or (plain("No trial was skipped or pruned."),)


__all__ = [
    "KIND_WORDS",
    "cost_phrase",
    "decision_line",
    "search_items",
    "search_paragraphs",
    "search_sentence",
]
