"""The recommendation's edge cases: ok trials without a figure, a baseline not marked or marked twice, the budget
table's verdicts, and what a tie is said to be broken by."""

from __future__ import annotations

import dataclasses

from helpers.report import CPU_HOG, ok_row, runs_of

from hfscale import report
from hfscale.core.units import GIB
from hfscale.report.budget import BUDGET_COLUMNS, budget_rows
from hfscale.report.text import as_plain
from hfscale.strategy import Strategy
from hfscale.strategy.specs import LoraSpec


def _lines(summary: report.Summary) -> str:
    return " ".join(as_plain(line) for line in summary.recommendation.lines)


def _without(row, field: str):
    return dataclasses.replace(row, measured=dataclasses.replace(row.measured, **{field: None}))


def test_an_ok_trial_without_a_memory_or_speed_figure_is_named_as_left_out() -> None:
    rows = [
        *runs_of("base", 0.10, seed=1, is_baseline=True),
        *(_without(row, "memory") for row in runs_of("nomem", 0.05, seed=2)),
        *runs_of("c", 0.09, seed=3),
    ]
    summary = report.summarize(rows)
    assert summary.recommendation.fastest == "c"
    text = _lines(summary)
    assert "Left out because a figure was not measured: nomem (no memory figure)" in text, text


def test_the_lora_note_compares_with_the_baseline_the_table_used() -> None:
    """No trial marked: the first ok trial is the baseline, here a LoRA trial too, so the fastest LoRA trial does
    not do "a different job from the baseline's"."""
    lora = Strategy(name="lora_a", lora=LoraSpec())
    rows = [ok_row(name, lora.replace(name=name), speed, 4.0) for name, speed in (("lora_a", 10.0), ("lora_b", 20.0))]
    summary = report.summarize(rows, memory_budget_bytes=8 * GIB)
    assert summary.baseline == "lora_a" and summary.recommendation.fastest == "lora_b"
    assert "a different job from the baseline's" not in _lines(summary)


def test_a_second_marked_trial_is_compared_on_the_all_pairs_family_like_any_other() -> None:
    """Only the baseline the table used is compared on its own (Dunnett's) verdicts; marking another trial as a
    baseline too must not change the recommendation."""

    def summary(mark_second: bool) -> report.Summary:
        rows = [
            *runs_of("base", 0.10, seed=1, is_baseline=True, drift=0.03, runs=3),
            *runs_of("base2", 0.08, seed=2, is_baseline=mark_second, drift=0.03, runs=3, peak=2.0),
            *runs_of("x", 0.08 / 1.08, seed=3, drift=0.03, runs=3),
            *(row for k in range(4) for row in runs_of(f"o{k}", 0.11, seed=10 + k, drift=0.03, runs=3)),
        ]
        return report.summarize(rows)

    marked, unmarked = summary(True), summary(False)
    assert marked.baseline == unmarked.baseline == "base"
    assert (marked.recommendation.fastest, marked.recommendation.fastest_ties) == (
        unmarked.recommendation.fastest,
        unmarked.recommendation.fastest_ties,
    )


def test_the_budget_table_says_when_a_speed_up_is_untested() -> None:
    rows = [
        *runs_of("base", 0.1, seed=1, is_baseline=True, activity=CPU_HOG),
        *runs_of("b", 0.05, seed=2),
        *runs_of("c", 0.06, seed=3, peak=2.0),
    ]
    summary = report.summarize(rows, memory_budget_bytes=8 * GIB)
    (speedup,) = [column for column in BUDGET_COLUMNS if column.key == "speedup_vs_baseline"]
    cells = {row["trial"]: speedup.text(row) for row in budget_rows(summary.trials, summary.speed)}
    assert summary.trials.loc["b", "verdict"] == "untested"  # the baseline may be unstable
    assert cells["b"].endswith(" untested"), cells


def _rows(*figures: tuple[str, float, float]) -> list:
    """One single-run ok row per (name, samples/s, peak GiB), the first the baseline."""
    return [
        ok_row(name, Strategy(name=name), speed, peak, is_baseline=k == 0)
        for k, (name, speed, peak) in enumerate(figures)
    ]


def test_why_a_tied_trial_is_the_one_marked_is_said_as_it_was_chosen() -> None:
    """Among trials that tie, the one marked is chosen by speed, then memory, then the table's order (or memory,
    then speed, for the least memory): the sentence says which of those decided, never a figure that is equal."""
    equal = _lines(report.summarize(_rows(("a", 10.0, 4.0), ("b", 10.0, 4.0))))
    assert "a is marked only because it comes first in the table (their figures are equal)" in equal, equal
    assert "is higher" not in equal and "lower point figure" not in equal, equal
    # The same speed, b a little smaller (within 2%): b, for its memory.
    smaller = _lines(report.summarize(_rows(("a", 10.0, 4.05), ("b", 10.0, 4.0))))
    assert "b is marked only because of those with the highest point estimate it needs the least memory" in smaller
    # The least memory: a and b at 10.0 GiB, c at 10.1 (within 2%) and faster than both: a, faster than b.
    frugal = _lines(report.summarize(_rows(("a", 100.0, 10.0), ("b", 90.0, 10.0), ("c", 101.0, 10.1))))
    assert "of those with the lowest memory figure its point estimate of speed is the highest" in frugal, frugal


def test_no_trial_qualifies_says_so_when_the_only_measured_one_is_flagged() -> None:
    """The baseline has no memory figure, b has both but its loss was flagged: no trial qualifies, which is not
    "no trial has both figures"."""
    from hfscale.records.parity import ParityResult

    flagged = ParityResult(flagged=True, compared=True, reason="loss diverged", baseline="base")
    rows = [
        _without(ok_row("base", Strategy(name="base"), 10.0, 4.0, is_baseline=True), "memory"),
        ok_row("b", Strategy(name="b"), 12.0, 4.0, parity=flagged),
    ]
    text = _lines(report.summarize(rows))
    assert text.startswith("No trial qualifies (status ok, throughput and memory measured, a loss"), text
    assert "b (loss diverged)" in text and "base (no memory figure)" in text, text
