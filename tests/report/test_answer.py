"""The report's first screen: the answer sentence, the ranked chart, the slim table with its badges, and the
definitions folded at the end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.report import CPU_HOG, ENV, constructed_rows, md_table, runs_of, write_run

from hfscale import report
from hfscale.core.units import GIB
from hfscale.report.answer import MIN_RUNS, answer, runs_to_decide
from hfscale.report.text import as_plain


def test_one_run_each_names_the_choice_its_budget_and_the_runs_that_would_test_it() -> None:
    summary = report.summarize(constructed_rows(), environment=ENV, memory_budget_bytes=5 * GIB)
    text = as_plain(answer(summary))
    assert text.startswith("Use zero3 (fp32, default optimizer, ZeRO-3"), text
    assert "1.20x the baseline's samples/s, untested" in text and "of the 5 GiB budget" in text
    fit = summary.trials.loc["zero3"]
    assert f"needs {fit['fit_gib']:.3g} GiB ({fit['fit_source']}) of" in text  # the figure the budget was checked on
    assert "No trial ran twice, so the ranking is untested: to test it, run each trial 3 times" in text
    assert "`--repeats 3`" not in text and "--repeats 3" in text  # plain text: the code marks are gone


def test_a_clear_winner_is_named_with_its_interval_and_no_advice() -> None:
    rows = [*runs_of("base", 0.10, seed=1, is_baseline=True), *runs_of("fast", 0.05, seed=2, peak=3.0)]
    text = as_plain(answer(report.summarize(rows, memory_budget_bytes=80 * GIB)))
    assert re.match(r"Use fast \(.*\): 2\.\d\dx the baseline's samples/s, 95% interval \d\.\d\d–\d\.\d\d", text), text
    assert "run each trial" not in text


def test_a_disturbed_fastest_trial_gives_no_choice_and_says_how_to_decide() -> None:
    rows = [
        *runs_of("base", 0.10, seed=1, is_baseline=True),
        *runs_of("hogged", 0.05, seed=2, activity=CPU_HOG),
        *runs_of("steady", 0.09, seed=3),
    ]
    summary = report.summarize(rows)
    assert summary.recommendation.fastest is None
    text = as_plain(answer(summary))
    assert text.startswith("No trial is recommended on speed"), text
    assert "on an idle machine" in text and re.search(r"run each trial \d+ times", text), text


def test_runs_to_decide_grows_as_the_gap_shrinks_and_gives_up_on_no_gap() -> None:
    def runs(gap: float) -> int | None:
        rows = [*runs_of("base", 0.10, seed=1, is_baseline=True), *runs_of("b", 0.10 / (1 + gap), seed=2)]
        return runs_to_decide(report.summarize(rows))

    # The pooled run noise of these runs is 0.6% of a run's samples/s: 2 (2.5 x 0.6 / 1)^2 = 4.7 runs for a 1% gap.
    assert runs(0.20) == runs(0.03) == MIN_RUNS
    assert MIN_RUNS < runs(0.01) < runs(0.007) <= 20
    assert runs(0.004) is None and runs(0.0) is None
    single = report.summarize(constructed_rows())
    assert single.speed.noise.df < 1 and runs_to_decide(single) == MIN_RUNS


@pytest.fixture
def written(tmp_path: Path) -> report.ReportPaths:
    return report.write_report(write_run(tmp_path / "run", constructed_rows(), ENV), memory_budget_bytes=5 * 2**30)


def test_first_screen_order_slim_table_badges_and_folded_definitions(written: report.ReportPaths) -> None:
    md, page = written.markdown.read_text(encoding="utf-8"), written.html.read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", md, flags=re.M)
    assert headings[:4] == ["Answer", "Speed-up and peak memory", "Trials", "Recommendation"]
    assert headings[-1] == "Definitions" and "All measurements" in headings
    slim = {r["trial"]: r for r in md_table(md, "Trials")}
    assert list(next(iter(slim.values()))) == [
        "trial", "strategy", "samples/s (95% interval)", "speed-up vs baseline (x)", "peak memory (GiB)",
        "fits budget", "MFU (%)", "status and flags",
    ]  # fmt: skip
    assert slim["zero3"]["status and flags"].startswith("ok; recommended: the fastest trial that fits the budget")
    assert slim["big_batch"]["status and flags"].startswith("oom: CUDA out of memory")
    assert (slim["zero3"]["fits budget"], slim["baseline"]["fits budget"]) == ("yes", "no")
    assert slim["bf16"]["speed-up vs baseline (x)"] == "1.50 untested"
    # HTML: the answer first in its own section, definitions on the slim headers, badges fold their reasons.
    order = [page.index(f'<section id="{anchor}">') for anchor in ("answer", "ranking", "trials", "measurements")]
    assert order == sorted(order)
    header = r'<th[^>]* title="Steady-state samples/s of all processes[^"]*">samples/s \(95% interval\)</th>'
    assert re.search(header, page)
    assert '<details class="badge"><summary>oom</summary>CUDA out of memory' in page
    definitions = page.split('<section id="definitions">', 1)[1].split("</section>", 1)[0]
    assert "<details><summary>what each column of the trials tables means</summary>" in definitions
    assert definitions.count("<li>") >= 10


def test_a_tie_on_the_first_screen_says_how_far_apart_the_figures_are() -> None:
    """A tie broken by memory can name a trial whose figure is well below another's: the first screen gives each
    tied trial's figure over the recommended one's (a three-run cpu_techniques search named sdpa, tied with
    sdpa-maxbatch at 1.44x its samples/s, and said only "ties")."""
    rows = [
        *runs_of("base", 0.10, seed=1, peak=0.700, drift=0.4, is_baseline=True),
        *runs_of("lean", 0.13, seed=2, peak=0.500, drift=0.4),
    ]
    summary = report.summarize(rows)
    assert summary.recommendation.fastest == "lean" and summary.recommendation.fastest_ties == ("base",)
    ratio = summary.trials.loc["base", "samples_per_s"] / summary.trials.loc["lean", "samples_per_s"]
    assert ratio > 1.2
    text = as_plain(answer(summary))
    assert f"it ties on speed with base ({ratio:.2f}x lean's samples/s)" in text, text


def test_several_ties_on_the_first_screen_are_listed_with_and() -> None:
    rows = [
        *runs_of("base", 0.10, seed=1, peak=0.700, drift=0.4, is_baseline=True),
        *runs_of("lean", 0.13, seed=2, peak=0.500, drift=0.4),
        *runs_of("mid", 0.12, seed=3, peak=0.600, drift=0.4),
    ]
    summary = report.summarize(rows)
    assert summary.recommendation.fastest == "lean" and len(summary.recommendation.fastest_ties) == 2
    first, second = summary.recommendation.fastest_ties
    ratios = [
        summary.trials.loc[name, "samples_per_s"] / summary.trials.loc["lean", "samples_per_s"]
        for name in (first, second)
    ]
    text = as_plain(answer(summary))
    assert (
        f"it ties on speed with {first} ({ratios[0]:.2f}x lean's samples/s) and {second} ({ratios[1]:.2f}x)" in text
    ), text


def test_no_runs_are_advised_where_more_runs_cannot_decide() -> None:
    """Nothing fits the budget, or no ok trial has its figures: more runs change neither, so the answer does not
    ask for them."""
    too_big = [*runs_of("base", 0.10, seed=1, is_baseline=True, peak=10.0), *runs_of("b", 0.05, seed=2, peak=12.0)]
    text = as_plain(answer(report.summarize(too_big, memory_budget_bytes=8 * GIB)))
    assert text.startswith("No ok trial fits within 8 GiB per device"), text
    assert "run each trial" not in text and "More runs cannot change that" in text, text
    unmeasured = [_without_memory(row) for row in too_big]
    text = as_plain(answer(report.summarize(unmeasured)))
    assert text.startswith("No trial qualifies (status ok, throughput and memory measured"), text
    assert "run each trial" not in text and "more minutes" not in text, text


def _without_memory(row):
    import dataclasses

    return dataclasses.replace(row, measured=dataclasses.replace(row.measured, memory=None))


def test_the_runs_advised_are_sized_on_the_trials_that_fit() -> None:
    """Two trials too large for the budget lead by far; the trials that fit are 2.5% apart, and the fastest of
    them may be unstable. Three runs each already ran: the advice is sized on the two that fit (too close to chase),
    never "run each trial 3 times" again."""
    rows = [
        *runs_of("base", 0.10, seed=1, is_baseline=True, drift=0.04, runs=3),
        *runs_of("big", 0.03, seed=5, peak=20.0, drift=0.04, runs=3),
        *runs_of("big2", 0.06, seed=6, peak=20.0, drift=0.04, runs=3),
        *runs_of("hog", 0.080, seed=2, activity=CPU_HOG, drift=0.04, runs=3),
        *runs_of("steady", 0.082, seed=3, drift=0.04, runs=3),
    ]
    summary = report.summarize(rows, memory_budget_bytes=8 * GIB)
    assert summary.recommendation.fastest is None
    assert runs_to_decide(summary) is None
    text = as_plain(answer(summary))
    assert "run each trial 3 times" not in text and "treat them as equal" in text, text


def test_a_cost_under_a_minute_is_said_in_seconds() -> None:
    rows = [*runs_of("base", 0.10, seed=1, is_baseline=True), *runs_of("hogged", 0.05, seed=2, activity=CPU_HOG)]
    text = as_plain(answer(report.summarize(rows)))
    assert "about 0 more minutes" not in text, text
    assert re.search(r"about \d+ more seconds at this sweep's \d+ s per run", text), text
