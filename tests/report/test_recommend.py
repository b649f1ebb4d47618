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


def test_equal_figures_are_not_called_higher_or_lower() -> None:
    """Two trials with the same speed and memory figures: neither is "marked because its point estimate is higher"
    nor "for its lower point figure"."""
    base = Strategy(name="a")
    rows = [ok_row("a", base, 10.0, 4.0, is_baseline=True), ok_row("b", base.replace(name="b"), 10.0, 4.0)]
    text = _lines(report.summarize(rows))
    assert "is higher" not in text and "lower point figure" not in text, text
