"""hfscale.report: figures with their noise (intervals, ties, stability flags), coverage of the recipe, energy and
cost, on synthetic typed rows with known noise."""

from __future__ import annotations

import dataclasses
import math
import random
import re
from pathlib import Path

import pandas as pd
import pytest
from helpers.hog import CpuShare, assert_named_or_outranked
from helpers.paths import REPO
from helpers.report import CPU_HOG, ENV, md_table, noisy_steps, ok_row, runs_of, with_steps, write_run

from hfscale import report
from hfscale.commands import report as report_command
from hfscale.core.units import GIB
from hfscale.records.activity import GpuActivity, MachineActivity
from hfscale.report.budget import budget_rows
from hfscale.report.compare import regressions, significance
from hfscale.report.text import as_plain
from hfscale.results.run_folder import RunFolder
from hfscale.strategy import Strategy

BASE = Strategy(name="base")


def _trial(name: str, mean_s: float, *, seed: int, peak: float = 4.0, cv: float = 0.03, **kw) -> object:
    strategy = BASE.replace(name=name)
    return with_steps(ok_row(name, strategy, 8 / mean_s, peak, **kw), noisy_steps(mean_s, 40, cv=cv, seed=seed))


def test_two_trials_from_the_same_distribution_tie_and_the_recommendation_says_so() -> None:
    rows = [
        *runs_of("base", 0.10, seed=1, is_baseline=True),
        *runs_of("a", 0.10, seed=2, peak=3.0),
        *runs_of("b", 0.10, seed=3, peak=3.5),
    ]
    summary = report.summarize(rows, memory_budget_bytes=80 * GIB)
    frame = summary.trials
    assert list(frame["verdict"]) == ["baseline", "tie", "tie"]
    for name in ("a", "b"):
        row = frame.loc[name]
        assert row["speedup_low"] < 1 < row["speedup_high"]
        assert row["samples_per_s_low"] < row["samples_per_s"] < row["samples_per_s_high"]
        assert row["steps_n"] == 80 and row["repeats_n"] == 2 and not row["unstable"]
    lines = [as_plain(line) for line in summary.recommendation.lines]
    assert "tie on speed" in lines[0] and "interval" in lines[0]
    # The tie is broken by memory, the other axis: a needs the least.
    assert summary.recommendation.fastest == "a" and "broken by memory" in lines[1]
    assert set(summary.recommendation.fastest_ties) == {"base", "b"}


def test_memory_breaks_a_speed_tie_only_where_it_differs() -> None:
    """Three trials tie on speed (runs 40% apart); two need the same memory within 2% (0.549 and 0.550 GiB, as
    checkpointing and fp32 on cpu_small's CPU runs), the third more. The tie goes to the faster point estimate of
    the two, never to the slower one by a sub-MiB difference."""
    rows = [
        *runs_of("fast", 0.10, seed=1, peak=0.700, drift=0.4, is_baseline=True),
        *runs_of("plain", 0.12, seed=2, peak=0.550, drift=0.4),
        *runs_of("slow", 0.16, seed=3, peak=0.549, drift=0.4),
    ]
    summary = report.summarize(rows)
    lines = [as_plain(line) for line in summary.recommendation.lines]
    assert set(summary.recommendation.fastest_ties) | {summary.recommendation.fastest} == {"fast", "plain", "slow"}
    assert summary.recommendation.fastest == "plain"
    assert "slow needs as little within 2%, and of those plain's point estimate is the highest" in lines[1]


def _spread_runs(name: str, mean_s: float, *, seed: int, peak: float, **kw) -> list:
    """Three runs of ``name`` whose mean step times are 6% either side of ``mean_s``, in no trend."""
    means = (mean_s * 0.94, mean_s * 1.06, mean_s)
    strategy = Strategy(name=name)
    return [
        with_steps(
            ok_row(name, strategy, 8 / m, peak, **kw), noisy_steps(m, 40, seed=seed + 10 * k), repeat=k, repeats=3
        )
        for k, m in enumerate(means)
    ]


def test_memory_never_picks_a_trial_no_faster_than_one_the_leader_beats() -> None:
    """Ties are not transitive, and a comparison with the baseline (Dunnett) is narrower than one between two other
    trials (all pairs). twin runs as fast as the baseline and needs less memory; fast is shown faster than the
    baseline, yet its all-pairs interval against twin holds 1. 0.4.0.dev0 recommended twin by memory, as its
    three-run cpu_techniques grid recommended ddp-x2 (1.00x the baseline) over lora-maxbatch (1.30x, 1.01-1.69)."""
    rows = [
        *_spread_runs("base", 0.1, seed=1, peak=4.0, is_baseline=True),
        *_spread_runs("fast", 0.1 / 1.17, seed=2, peak=5.0),
        *_spread_runs("twin", 0.1005, seed=3, peak=3.0),
        *_spread_runs("c", 0.11, seed=4, peak=4.0),
        *_spread_runs("d", 0.12, seed=5, peak=4.0),
    ]
    summary = report.summarize(rows)
    frame = summary.trials
    assert frame.loc["fast", "verdict"] == "faster" and frame.loc["twin", "verdict"] == "tie"
    assert frame.loc["twin", "samples_per_s"] < frame.loc["base", "samples_per_s"]
    assert summary.recommendation.fastest == "fast" and "twin" not in summary.recommendation.fastest_ties
    text = " ".join(as_plain(line) for line in summary.recommendation.lines)
    assert (
        "twin is not counted as tying for the fastest, although no interval tells it from fast: it is no faster by "
        "its figure than base, which fast is shown faster than." in text
    )
    # The evidence holds whether or not the beaten trial fits the budget: the baseline too large for it.
    large_base = [*_spread_runs("base", 0.1, seed=1, peak=6.0, is_baseline=True), *rows[3:]]
    within = report.summarize(large_base, memory_budget_bytes=int(5.5 * GIB)).recommendation
    assert within.fastest == "fast" and "twin" not in within.fastest_ties


def test_a_trial_faster_than_the_leader_beyond_the_budget_puts_no_tie_out() -> None:
    """big does not fit 4 GiB and is shown faster than base: that says nothing against small, which ties with base
    and needs less memory (c5017dd took any shown difference as the leader's win, and named base)."""
    rows = [
        *_spread_runs("base", 0.1, seed=1, peak=3.0, is_baseline=True),
        *_spread_runs("small", 0.1 / 0.99, seed=2, peak=2.0),
        *_spread_runs("big", 0.1 / 1.5, seed=3, peak=6.0),
    ]
    summary = report.summarize(rows, memory_budget_bytes=4 * GIB)
    assert summary.trials.loc["big", "verdict"] == "faster"
    assert summary.recommendation.fastest == "small" and summary.recommendation.fastest_ties == ("base",)
    assert [row["trial"] for row in budget_rows(summary.trials, summary.speed)] == ["small", "big"]


def _with_fillers(rows: list, count: int) -> list:
    """``rows`` and ``count`` slower trials, which widen the all-pairs family."""
    return rows + [r for k in range(count) for r in _spread_runs(f"f{k}", 0.13 + 0.01 * k, seed=4 + k, peak=4.0)]


def test_the_baseline_as_leader_is_judged_by_the_tables_own_verdict() -> None:
    """dd is slower than the baseline by the table's Dunnett verdict; as the leader, the baseline came from the
    frame with numpy's bool, was not recognised, and was compared with dd on the wider all-pairs family: a tie,
    which memory broke in dd's favour ("Use dd: 0.86x the baseline's samples/s, slower")."""
    rows = _with_fillers(
        [
            *_spread_runs("base", 0.1, seed=1, peak=4.0, is_baseline=True),
            *_spread_runs("dd", 0.1 / 0.86, seed=2, peak=2.0),
        ],
        3,
    )
    summary = report.summarize(rows)
    assert summary.trials.loc["dd", "verdict"] == "slower"
    assert summary.recommendation.fastest == "base" and summary.recommendation.fastest_ties == ()


def test_a_tied_trial_shown_slower_than_another_candidate_is_not_picked_by_memory() -> None:
    """lead ties with base (Dunnett) and with dd (all pairs); base is shown faster than dd. dd needs the least
    memory, but the evidence puts it below base, so the tie is lead and base."""
    rows = _with_fillers(
        [
            *_spread_runs("base", 0.1, seed=1, peak=4.0, is_baseline=True),
            *_spread_runs("lead", 0.1 / 1.02, seed=2, peak=5.0),
            *_spread_runs("dd", 0.1 / 0.86, seed=3, peak=2.0),
        ],
        5,
    )
    summary = report.summarize(rows)
    assert summary.trials.loc["dd", "verdict"] == "slower"
    assert summary.recommendation.fastest == "base" and summary.recommendation.fastest_ties == ("lead",)
    text = " ".join(as_plain(line) for line in summary.recommendation.lines)
    assert "dd is not counted as tying for the fastest, although no interval tells it from lead: base is shown " in text


def test_a_baseline_over_the_budget_still_puts_out_a_trial_it_is_shown_faster_than() -> None:
    """lead ties with the baseline, which does not fit 4 GiB; dd is shown slower than the baseline and ties with
    lead on the wider family. The evidence puts dd below a trial no faster than lead, so memory must not pick it."""
    rows = [
        *_spread_runs("base", 0.1, seed=1, peak=6.0, is_baseline=True),
        *_spread_runs("lead", 0.1 / 1.01, seed=2, peak=3.0),
        *_spread_runs("dd", 0.1 / 0.86, seed=3, peak=2.0),
    ]
    rows += [r for k in range(5) for r in _spread_runs(f"f{k}", 0.13 + 0.01 * k, seed=4 + k, peak=7.0)]
    summary = report.summarize(rows, memory_budget_bytes=4 * GIB)
    assert summary.trials.loc["dd", "verdict"] == "slower"
    assert summary.recommendation.fastest == "lead"
    text = " ".join(as_plain(line) for line in summary.recommendation.lines)
    assert "dd is not counted as tying for the fastest, although no interval tells it from lead: base is shown " in text
    assert [row["trial"] for row in budget_rows(summary.trials, summary.speed)][:2] == ["dd", "lead"]


def test_an_unmarked_baseline_is_judged_by_the_tables_own_verdict_too() -> None:
    """No trial marked: the first ok trial is the baseline (its verdict says so), and comparisons with it are the
    table's, as for a marked one."""
    rows = _with_fillers(
        [*_spread_runs("base", 0.1, seed=1, peak=4.0), *_spread_runs("dd", 0.1 / 0.86, seed=2, peak=2.0)], 3
    )
    summary = report.summarize(rows)
    assert summary.baseline == "base" and summary.trials.loc["dd", "verdict"] == "slower"
    assert summary.recommendation.fastest == "base"


def test_the_budget_table_keeps_pruned_trials_and_says_when_a_row_ties_with_the_one_above() -> None:
    """Below the memory of a search's answer, a pruned trial is the measured answer (the recommendation, with no
    budget, leaves it out). A trial that ties with the row above and needs as little memory within 2% takes over
    on its higher figure, and the note says so rather than "faster"."""
    rows = [
        *_spread_runs("base", 0.1, seed=1, peak=4.0, is_baseline=True),
        *_spread_runs("lean", 0.1 / 0.7, seed=2, peak=2.0),
    ]
    summary = report.summarize(rows)
    frame = summary.trials.copy()
    frame["pruned"] = [None] * len(frame)
    frame.loc["lean", "pruned"] = "slower than base beyond the noise"
    assert [row["trial"] for row in budget_rows(frame, summary.speed)] == ["lean", "base"]
    rows = [
        *_spread_runs("a", 0.1, seed=1, peak=3.0, is_baseline=True),
        *_spread_runs("b", 0.1 / 1.04, seed=2, peak=3.05),
    ]
    summary = report.summarize(rows)
    table = budget_rows(summary.trials, summary.speed)
    assert [row["trial"] for row in table] == ["a", "b"]
    gain = 100 * (summary.trials.loc["b", "samples_per_s"] / summary.trials.loc["a", "samples_per_s"] - 1)
    assert (
        table[1]["budget_note"]
        == f"ties on speed with a and needs as little memory within 2%; its figure {gain:.1f}% above a's"
    )


def test_the_budget_table_names_at_each_budget_what_the_recommendation_names_there() -> None:
    """The same rule at every budget: the twin scenario above (0.4.0.dev0's table named twin at every budget, from
    its memory up, while fast is shown faster than the baseline twin measured no faster than), then random sweeps
    of five trials with unequal noise, budget by budget."""
    rows = [
        *_spread_runs("base", 0.1, seed=1, peak=4.0, is_baseline=True),
        *_spread_runs("fast", 0.1 / 1.17, seed=2, peak=5.0),
        *_spread_runs("twin", 0.1005, seed=3, peak=3.0),
        *_spread_runs("c", 0.11, seed=4, peak=4.0),
        *_spread_runs("d", 0.12, seed=5, peak=4.0),
    ]
    assert _budget_table_agrees_with_the_recommendation(rows) == ["twin", "fast"]
    rng = random.Random(7)
    for sweep in range(6):
        rows = []
        for k in range(5):
            name, mean_s = f"t{k}", 0.1 * rng.uniform(0.8, 1.25)
            spread, peak = rng.choice((0.01, 0.06, 0.12)), rng.uniform(1.0, 6.0)
            means = (mean_s * (1 - spread), mean_s * (1 + spread), mean_s)
            strategy = Strategy(name=name)
            rows += [
                with_steps(
                    ok_row(name, strategy, 8 / m, peak, is_baseline=k == 0),
                    noisy_steps(m, 40, seed=100 * sweep + 10 * k + j),
                    repeat=j,
                    repeats=3,
                )
                for j, m in enumerate(means)
            ]
        _budget_table_agrees_with_the_recommendation(rows)


def _budget_table_agrees_with_the_recommendation(rows: list) -> list[str]:
    """The budget table's trials, each checked against the recommendation at its budget (which names none where
    the fastest that fits may be unstable)."""
    summary = report.summarize(rows)
    table = budget_rows(summary.trials, summary.speed)
    for row in table:
        named = report.summarize(rows, memory_budget_bytes=int(row["budget_gib"] * GIB) + 1).recommendation.fastest
        assert named in (None, row["trial"]), (row["budget_gib"], [r["trial"] for r in table])
    return [row["trial"] for row in table]


def test_memory_within_2_percent_does_not_chain_and_a_missing_figure_breaks_nothing() -> None:
    """0.549, 0.560 and 0.571 GiB: each within 2% of the next, the ends 3.9% apart, so they do not need the same
    memory and the least (its point estimate the highest of those within 2% of it) is recommended. A tied trial
    without a memory figure takes no part in the tie-break and does not stop it."""
    rows = [
        *runs_of("a", 0.12, seed=1, peak=0.549, drift=0.4, is_baseline=True),
        *runs_of("b", 0.11, seed=2, peak=0.560, drift=0.4),
        *runs_of("c", 0.10, seed=3, peak=0.571, drift=0.4),
    ]
    summary = report.summarize(rows)
    lines = [as_plain(line) for line in summary.recommendation.lines]
    assert summary.recommendation.fastest == "b" and "need the same memory too" not in " ".join(lines)
    unknown = [dataclasses.replace(r, measured=dataclasses.replace(r.measured, memory=None)) for r in rows[4:]]
    summary = report.summarize([*rows[:4], *unknown])
    assert summary.recommendation.fastest in ("a", "b")


def test_a_real_speed_up_is_faster_with_an_interval_that_excludes_one() -> None:
    rows = [*runs_of("base", 0.10, seed=1, is_baseline=True), *runs_of("fast", 0.08, seed=2)]
    row = report.summarize(rows).trials.loc["fast"]
    assert row["verdict"] == "faster" and 1.15 < row["speedup_low"] <= row["speedup_vs_baseline"] <= row["speedup_high"]
    assert row["speedup_vs_baseline"] == pytest.approx(1.25, rel=0.03)


def test_one_run_each_is_never_a_ranking() -> None:
    """One run's steps show the noise within the run, not between runs: the same 25% gap is "untested" until
    both trials ran twice, and no interval is made from the steps of one run (0.3 made one, and called an
    identical trial 0.79x (0.73-0.84))."""
    rows = [_trial("base", 0.10, seed=1, is_baseline=True), _trial("fast", 0.08, seed=2)]
    row = report.summarize(rows).trials.loc["fast"]
    assert row["verdict"] == "untested" and "1 run" in row["verdict_reason"]
    assert pd.isna(row["speedup_low"]) and pd.isna(row["samples_per_s_low"])


def test_repeats_give_a_hierarchical_interval_and_a_peak_range() -> None:
    base = ok_row("base", BASE, 80.0, 4.0, is_baseline=True)
    rows = [
        with_steps(
            dataclasses.replace(base, measured=dataclasses.replace(base.measured)),
            noisy_steps(0.1, 30, seed=k),
            repeat=k,
            repeats=3,
        )
        for k in range(3)
    ]
    rows[1].measured.memory = dataclasses.replace(rows[1].memory, peak_gib=4.2)
    row = report.summarize(rows).trials.loc["base"]
    assert row["runs"] == 3 and row["repeats_n"] == 3 and row["steps_n"] == 90
    assert (row["peak_gib_min"], row["peak_gib_max"], row["peak_gib"]) == (4.0, 4.2, 4.2)
    assert row["samples_per_s_low"] < row["samples_per_s"] < row["samples_per_s_high"]


def test_a_row_disturbed_by_a_cpu_hog_is_flagged_and_not_recommended_on_speed() -> None:
    rows = [
        _trial("base", 0.10, seed=1, is_baseline=True),
        _trial("hogged", 0.05, seed=2, activity=CPU_HOG),  # "twice as fast", measured on a busy machine
        _trial("ok", 0.09, seed=3),
    ]
    summary = report.summarize(rows)
    hogged = summary.trials.loc["hogged"]
    assert hogged["unstable"] and "other processes used 0.95 of 2 cores" in hogged["unstable_reason"]
    assert "stress (4242)" in hogged["unstable_reason"]
    # The fastest figure is the disturbed one: no speed claim at all, rather than the slower steady trial.
    assert summary.recommendation.fastest is None
    text = " ".join(as_plain(line) for line in summary.recommendation.lines)
    assert "No trial is recommended on speed" in text and "the fastest by its figure, hogged, may be unstable" in text
    assert "Not recommended on speed because they may be unstable: hogged" in text
    # A disturbed trial that is slower than a steady one does not stand in the way of the steady one.
    rows[1] = _trial("hogged", 0.12, seed=2, activity=CPU_HOG)
    assert report.summarize(rows).recommendation.fastest == "ok"


def test_scattered_step_times_are_a_diagnostic_and_the_verdict_comes_from_theruns_of() -> None:
    """0.3 flagged a trial whose steps scattered (CV 20%) as "may be unstable" and still printed "slower" beside
    it. Steps show how steady one run was; the runs decide the verdict: 2 runs of each, 25% apart, are faster."""
    rows = [*runs_of("base", 0.10, seed=1, is_baseline=True), *runs_of("jumpy", 0.08, seed=2, cv=0.3)]
    row = report.summarize(rows).trials.loc["jumpy"]
    assert row["step_time_cv_pct"] > 20 and row["step_mean_se_pct"] > 0 and not row["unstable"]
    assert row["verdict"] == "faster"


def _steady_and_wild(wild_means: tuple[float, float]) -> list:
    """Five trials of two runs 1% apart (t0 the baseline), and "wild", two runs of these mean step times."""
    steady = [r for k in range(5) for r in runs_of(f"t{k}", 0.10, seed=10 * k, is_baseline=k == 0)]
    wild = [
        with_steps(ok_row("wild", BASE.replace(name="wild"), 80.0, 4.0), noisy_steps(mean, 40, seed=7 + k), repeat=k,
                   repeats=2)
        for k, mean in enumerate(wild_means)
    ]  # fmt: skip
    return steady + wild


def test_a_trial_whose_runs_disagree_beyond_the_sweep_is_flagged_and_gets_no_verdict() -> None:
    """Five trials whose runs agree within about 1%, and one whose two runs are 40% apart: that one is flagged
    and its verdict untested with the reason; the others are still judged, with the sweep's noise."""
    frame = report.summarize(_steady_and_wild((0.08, 0.12))).trials
    assert frame.loc["wild", "unstable"] and "disagree far beyond" in frame.loc["wild", "unstable_reason"]
    assert frame.loc["wild", "verdict"] == "untested"
    assert frame.loc["t1", "verdict"] == "tie"


def test_rows_without_step_times_get_no_invented_interval(tmp_path: Path) -> None:
    base = ok_row("base", BASE, 10.0, 4.0, is_baseline=True)
    close = ok_row("close", BASE.replace(name="close"), 10.1, 4.0)  # 1% apart: a tie by the noise threshold
    far = ok_row("far", BASE.replace(name="far"), 12.0, 4.0)
    run = write_run(tmp_path / "run", [base, close, far], ENV)
    frame = report.load_run(run)
    assert frame[["samples_per_s_low", "samples_per_s_high", "speedup_low", "speedup_high"]].isna().all().all()
    assert list(frame["verdict"]) == ["baseline", "tie", "untested"]
    md = report.write_report(run).markdown.read_text(encoding="utf-8")
    table = {r["trial"]: r for r in md_table(md, "All measurements")}
    assert table["close"]["samples/s 95% interval"] == "single run, no interval"
    assert table["close"]["speed-up vs baseline (x)"] == "≈ 1.01" and table["far"]["speed-up vs baseline (x)"] == "1.20"
    assert "No trial ran twice, so the run-to-run noise is unknown" in md


def test_compare_takes_no_side_on_one_run_a_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The two-run rule of the report holds in compare too: one run a side (whose spread on a shared machine is
    about 20%) cannot fail a CI job, however far apart the figures are."""
    a = write_run(tmp_path / "a", [_trial("base", 0.10, seed=1), _trial("x", 0.10, seed=2)], ENV)
    slow = write_run(tmp_path / "slow", [_trial("base", 0.10, seed=5), _trial("x", 0.12, seed=6)], ENV)
    assert (
        report_command.compare_main([str(a), str(slow), "--out", str(tmp_path / "c"), "--fail-on-regression", "5"]) == 0
    )
    assert "x: B is 20." in (out := capsys.readouterr().out) and "has 1 run (a verdict needs 2 a side))" in out


def test_compare_fails_on_a_significant_slowdown_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(
        tmp_path / "a", [*runs_of("base", 0.10, seed=100, drift=0.0), *runs_of("x", 0.10, seed=1000, drift=0.0)], ENV
    )
    noise = write_run(
        tmp_path / "noise",
        [*runs_of("base", 0.10, seed=2000, drift=0.0), *runs_of("x", 0.10, seed=3000, drift=0.0)],
        ENV,
    )
    slow = write_run(
        tmp_path / "slow",
        [*runs_of("base", 0.10, seed=4000, drift=0.0), *runs_of("x", 0.12, seed=5000, drift=0.0)],
        ENV,
    )
    assert (
        report_command.compare_main([str(a), str(noise), "--out", str(tmp_path / "c1"), "--fail-on-regression", "5"])
        == 0
    )
    assert "x: no significant change" in capsys.readouterr().out
    assert (
        report_command.compare_main([str(a), str(slow), "--out", str(tmp_path / "c2"), "--fail-on-regression", "5"])
        == 1
    )
    out = capsys.readouterr()
    slower = re.search(r"x: B is ([\d.]+)% ± [\d.]+% slower", out.out)  # its steps take 20% longer
    assert slower and abs(float(slower[1]) - 20) < 3 and "regression: x" in out.err, out
    # Without the flag the same comparison is written and exits 0; a threshold above the slowdown passes.
    assert report_command.compare_main([str(a), str(slow), "--out", str(tmp_path / "c3")]) == 0
    assert (
        report_command.compare_main([str(a), str(slow), "--out", str(tmp_path / "c4"), "--fail-on-regression", "30"])
        == 0
    )
    tests = significance(report.summarize_run(a), report.summarize_run(slow))
    row = tests.loc["x"]
    assert row["change"] == "slower" and row["time_ratio_low"] > 1.15 and regressions(tests, 5) == ["x"]
    assert "B is" in (tmp_path / "c2" / "compare.md").read_text(encoding="utf-8")


def test_compare_fails_when_a_trial_that_finished_in_a_did_not_in_b(tmp_path: Path, capsys) -> None:
    """A CI gate must not pass a B that did not finish: a trial ok in A and crashed in B (one of its runs is enough)
    is named as such and fails --fail-on-regression at any threshold; one that failed in A is not tested, and
    says why."""
    a = write_run(
        tmp_path / "a", [*runs_of("base", 0.10, seed=100, drift=0.0), *runs_of("x", 0.10, seed=1000, drift=0.0)], ENV
    )
    crashed = dataclasses.replace(
        runs_of("x", 0.10, seed=3000, drift=0.0)[1], status="crashed", reason="boom", measured=None
    )
    b_rows = [*runs_of("base", 0.10, seed=2000, drift=0.0), runs_of("x", 0.10, seed=3000, drift=0.0)[0], crashed]
    b = write_run(tmp_path / "b", b_rows, ENV)
    argv = [str(a), str(b), "--out", str(tmp_path / "c"), "--fail-on-regression", "50"]
    assert report_command.compare_main(argv) == 1
    out = capsys.readouterr()
    assert "x: B did not finish ok: B crashed (repeat 2 of 2: boom; 1 repeat(s) ok)" in out.out
    assert "regression: x finished ok in A, not in B" in out.err
    md = (tmp_path / "c" / "compare.md").read_text(encoding="utf-8")
    assert "| x | B did not finish ok: B crashed (repeat 2 of 2: boom; 1 repeat(s) ok) |" in md
    # The other way round nothing was measured in A to regress from: not tested, named, and no failure.
    tests = significance(report.summarize_run(b), report.summarize_run(a))
    assert tests.loc["x", "change"] == "not tested" and "A crashed" in tests.loc["x", "change_text"]
    assert regressions(tests, 5) == [] and tests.loc["base", "change"] == "no significant change"
    # A trial B did not run (a search skipped it on its estimate) did not fail: not tested, and no failure either.
    skipped = dataclasses.replace(crashed, status="skipped", reason="predicted peak 9 GiB", repeat=0, repeats=1)
    c = write_run(tmp_path / "c", [*runs_of("base", 0.10, seed=4000, drift=0.0), skipped], ENV)
    tests = significance(report.summarize_run(a), report.summarize_run(c))
    assert (
        tests.loc["x", "change"] == "not tested" and "B skipped (predicted peak 9 GiB)" in tests.loc["x", "change_text"]
    )
    assert regressions(tests, 5) == []


def test_compare_help_states_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert report_command.compare_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--fail-on-regression PCT" in text and "1 --fail-on-regression PCT was given" in text


def test_energy_and_cost_are_shown_only_where_measured(tmp_path: Path) -> None:
    gpu = MachineActivity(samples=10, duration_s=10.0, cpu_count=16, gpus=[GpuActivity(index=0, energy_j=5000.0)])
    rows = [_trial("base", 0.10, seed=1, is_baseline=True, activity=gpu), _trial("other", 0.1, seed=2)]
    frame = report.summarize(rows, price_per_hour=2.0).trials
    assert frame.loc["base", "energy_j"] == 5000.0 and math.isnan(frame.loc["other", "energy_j"])
    tokens_per_s = frame.loc["base", "tokens_per_s"]
    assert frame.loc["base", "cost_per_m_tokens"] == pytest.approx(2.0 / 3600 * 1e6 / tokens_per_s)
    assert report.summarize(rows).trials["cost_per_m_tokens"].isna().all()
    with pytest.raises(report.ReportError, match="price_per_hour: expected a positive number"):
        report.summarize(rows, price_per_hour=0)
    run = write_run(tmp_path / "run", rows, ENV)
    assert report_command.main([str(run), "--price-per-hour", "2.5"]) == 0
    md = (run / "report.md").read_text(encoding="utf-8")
    table = {r["trial"]: r for r in md_table(md, "All measurements")}
    assert table["base"]["energy per run (J)"] == "5000" and table["other"]["energy per run (J)"] == "—"
    assert "2.5 per device-hour" in md and table["base"]["cost per M tokens"] != "—"


def test_a_committed_search_under_a_noise_floor_flags_nothing_within_the_floor() -> None:
    """results/cpu_budget-cpu2-floor: fp32's two runs are 21% apart (13.5% in sd of ln), ddp-x2's (close together)
    0.1% in sd. Against those alone fp32 was flagged and ddp-x2 recommended, untested; against the grid's 9.3% floor
    nothing is flagged and fp32 is recommended, tied with ddp-x2, as by the grid before it."""
    summary = report.summarize_run(REPO / "results" / "cpu_budget-cpu2-floor")
    assert summary.speed.floor is not None and summary.speed.floor.sd == pytest.approx(0.093, abs=0.001)
    assert summary.speed.flagged == {}
    assert summary.recommendation.fastest == "fp32" and "ddp-x2" in summary.recommendation.fastest_ties
    grid = report.summarize_run(REPO / "results" / "cpu_budget-cpu2-grid")
    assert grid.recommendation.fastest == "fp32" and grid.speed.floor is None


def test_committed_h100_run_shows_its_coverage_and_its_tie() -> None:
    summary = report.summarize_run(REPO / "results" / "bert_large-h100")
    sentence = summary.coverage.sentence()
    assert sentence.startswith("11 of 16 recipe trials have a result.")
    interrupted = {i.trial: i.progress for i in summary.coverage.interrupted}
    assert set(interrupted) == {"bs1-acc4-ckpt-fp16-adafactor", "fsdp2-bf16"}
    assert interrupted["bs1-acc4-ckpt-fp16-adafactor"].startswith("logged 122 training steps")
    assert "signal 15" in interrupted["fsdp2-bf16"]
    assert summary.coverage.never_started == ("zero1-bf16", "zero3-offload-bf16", "fsdp2-shard-grad-op-bf16")
    first = as_plain(summary.recommendation.lines[0])
    assert "bs4-fp16 and bs4-bf16 tie on speed" in first and "no interval" in first
    assert summary.recommendation.fastest_ties == ("bs4-bf16",)
    row = summary.row("bs4")
    assert row["compute_dtype"] == "fp32" and row["peak_tflops"] == pytest.approx(66.9)
    # By hand from the run's stored throughput: 492 samples x 512 tokens in 15.261 s = 16,507 tokens/s, x 1.9712e9
    # FLOPs per token = 32.54 TFLOP/s on its one H100, 48.6% of the 66.9 TFLOP/s fp32 peak.
    assert row["achieved_tflops"] == pytest.approx(32.54, abs=0.005)
    assert row["mfu_pct"] == pytest.approx(48.64, abs=0.005)


# -- real sweeps: the same verdicts twice, and a busy machine flagged ----------------------------------------------


def _sweep_again(tmp_path: Path, *only: str, name: str = "again") -> Path:
    import yaml
    from helpers.runs import TINY_SWEEP_RECIPE

    from hfscale.launch.plan import SweepSettings
    from hfscale.sweep.loop import run_sweep

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY_SWEEP_RECIPE), encoding="utf-8")
    run = tmp_path / name
    run_sweep(recipe, run_dir=run, settings=SweepSettings(only=only), report=False, progress=lambda line: None)
    return run


@pytest.mark.slow
def test_the_same_recipe_swept_twice_gives_the_same_verdicts(tiny_sweep_run: Path, tmp_path: Path) -> None:
    """The shared tiny sweep and a second sweep of the same recipe on the same machine. Its trials ran once (ckpt
        twice, against a baseline that ran once), so no verdict may rank them: the 0.1 sweep ranked bf16 0.69x in one
        run and 1.03x in the next. Between "tie" (the point estimates within the 2% noise threshold) and "untested"
        either may come out; what must never happen is a ranking, or two runs that claim different rankings. A verdict
    between trials of several runs each, on a shipped recipe swept twice: docs/statistics.md."""
    again = _sweep_again(tmp_path, "fp32", "bf16", "ckpt")
    first, second = report.load_run(tiny_sweep_run), report.load_run(again)
    for trial in ("bf16", "ckpt"):
        verdicts = {first.loc[trial, "verdict"], second.loc[trial, "verdict"]}
        assert verdicts <= {"tie", "untested"}, (trial, verdicts)  # one run each: never faster or slower
        for frame in (first, second):  # the figures are there; no interval from one baseline run's steps
            assert frame.loc[trial, "speedup_vs_baseline"] > 0 and pd.isna(frame.loc[trial, "speedup_low"])


@pytest.mark.slow
def test_a_real_cpu_hog_during_a_sweep_flags_its_rows_and_no_speed_claim_is_made(tmp_path: Path) -> None:
    import subprocess
    import sys

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        share = CpuShare(hog.pid)
        run = _sweep_again(tmp_path, "fp32", "bf16", name="busy")
        hog_share = share.so_far()
    finally:
        hog.kill()
        hog.wait()
    summary = report.summarize_run(run)
    activity = {row.trial: row.activity for row in RunFolder(run).rows()}
    for trial in ("fp32", "bf16"):
        row = summary.trials.loc[trial]
        assert row["unstable"], trial
        assert "other processes used" in row["unstable_reason"]
        # The hog among the busiest others, unless five others were as busy (helpers.hog).
        assert_named_or_outranked(activity[trial].busy_processes, hog.pid, hog_share)
    assert summary.recommendation.fastest is None


def test_trials_that_do_not_share_their_noise_are_judged_on_their_own_and_the_report_says_so() -> None:
    """cpu_small on 2 cores: single-process trials 1-2% apart run to run, multi-process ones 15-20%. Pooled, the
    noisy trials' variance made fast's 7% lead a tie; each pair's own noise decides it."""
    from hfscale.report.model import noise_sentence

    rows = [
        *runs_of("base", 0.100, seed=1, runs=5, is_baseline=True),
        *runs_of("fast", 0.093, seed=2, runs=5),
        *(row for k in range(3) for row in runs_of(f"multi-{k}", 0.2, seed=3 + k, runs=5, drift=0.15)),
    ]
    summary = report.summarize(rows)
    assert not summary.speed.shared and summary.speed.shared_p < 0.01
    assert summary.trials.loc["fast", "verdict"] == "faster" and summary.trials.loc["fast", "speedup_low"] > 1.03
    assert summary.recommendation.fastest == "fast"
    assert summary.trials.loc["base", "run_noise_pct"] < 2 < 15 < summary.trials.loc["multi-0", "run_noise_pct"]
    sentence = noise_sentence(summary)
    assert "differs beyond chance (Bartlett's test" in sentence and "(Welch)" in sentence, sentence
    assert "Dunnett's T3" in sentence


def test_a_single_run_lead_is_said_to_be_untested() -> None:
    """One run each (with step times): the fastest is named, and its lead is said not to be tested."""
    rows = [_trial("base", 0.10, seed=1, is_baseline=True), _trial("fast", 0.09, seed=2)]
    text = " ".join(as_plain(line) for line in report.summarize(rows).recommendation.lines)
    assert "fast" in text and "is not tested against the noise" in text


def test_a_memory_tie_is_decided_on_the_figure_it_prints() -> None:
    from hfscale.report.noise import memory_tie

    a = {"fit_gib": 10.0, "peak_gib": 8.0, "peak_gib_min": 7.0, "peak_gib_max": 9.0}
    b = {"fit_gib": 12.0, "peak_gib": 8.5, "peak_gib_min": 8.0, "peak_gib_max": 9.5}
    assert not memory_tie(a, b)  # 10 and 12 GiB of fit are 17% apart; the peaks' overlap does not decide it
    assert memory_tie(a, b, key="peak_gib")


def test_a_non_finite_step_leaves_that_trial_without_an_interval_and_the_report_goes_on() -> None:
    """0.3 raised for the whole report on one NaN step time."""
    rows = [
        *runs_of("base", 0.10, seed=1, is_baseline=True),
        *runs_of("x", 0.10, seed=2),
        *runs_of("bad", 0.10, seed=3),
    ]
    broken = rows[-1].throughput.step_times_s
    broken[3] = math.nan
    frame = report.summarize(rows).trials
    assert frame.loc["bad", "repeats_n"] == 1 and frame.loc["bad", "verdict"] in ("tie", "untested")
    assert frame.loc["x", "verdict"] == "tie" and frame.loc["x", "speedup_low"] < 1


def test_a_flagged_trial_is_never_called_a_tie_either() -> None:
    """A trial whose runs disagree far beyond the sweep's noise is no evidence of anything: not "faster", and not
    "tie" either, even when its geometric mean lands within 2% of the baseline's."""
    frame = report.summarize(_steady_and_wild((0.0833, 0.12))).trials
    assert abs(frame.loc["wild", "speedup_vs_baseline"] - 1) < 0.02
    assert frame.loc["wild", "verdict"] == "untested" and frame.loc["wild", "unstable"]


def test_a_disturbed_baseline_gives_no_verdict_to_anyone() -> None:
    rows = [*runs_of("base", 0.10, seed=1, is_baseline=True, activity=CPU_HOG), *runs_of("fast", 0.05, seed=2)]
    row = report.summarize(rows).trials.loc["fast"]
    assert row["verdict"] == "untested" and "base may be unstable" in row["verdict_reason"]


def test_the_noise_threshold_is_the_same_either_way_round() -> None:
    from hfscale.results.stats import within_threshold

    assert within_threshold(0.9804) and within_threshold(1 / 0.9804)
    assert not within_threshold(0.979) and not within_threshold(1 / 0.979)
