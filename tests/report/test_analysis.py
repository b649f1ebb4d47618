"""hfscale.report.analysis: the comparison table built from typed rows (repeats, ratios against the baseline, the
estimate's error, parity, Pareto front, recommendation, memory breakdown) and ``hfscale.load_run``."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import pytest
from helpers.paths import REPO
from helpers.report import ENV, constructed_rows, md_table, memory, ok_row, verification, write_run

import hfscale
from hfscale import report
from hfscale.core.units import GIB
from hfscale.records.parity import ParityResult
from hfscale.records.row import TrialResult
from hfscale.report.breakdown import MemoryBreakdown
from hfscale.strategy import DeepSpeedSpec, Strategy


def test_one_row_per_trial_with_the_figures_of_its_typed_row() -> None:
    rows = constructed_rows()
    frame = report.summarize(rows, environment=ENV).trials
    assert list(frame.index) == [r.trial for r in rows]
    base = rows[0]
    for row in rows:
        got = frame.loc[row.trial]
        assert got["status"] == row.status and got["runs"] == (0 if row.status == "skipped" else 1)  # never ran
        if row.measured is None:
            assert math.isnan(got["samples_per_s"]) and math.isnan(got["peak_gib"])
            continue
        assert got["samples_per_s"] == row.throughput.samples_per_s
        assert got["peak_gib"] == row.memory.peak_gib
        assert got["trainer_samples_per_s"] == row.measured.train_samples_per_second
        assert got["speedup_vs_baseline"] == pytest.approx(row.throughput.samples_per_s / base.throughput.samples_per_s)
        assert got["memory_saved_pct"] == pytest.approx(100 * (1 - row.memory.peak_gib / base.memory.peak_gib))
        mfu = row.throughput.mfu
        assert math.isnan(got["mfu_pct"]) if mfu is None else got["mfu_pct"] == pytest.approx(100 * mfu)
    bf16 = frame.loc["bf16"]
    assert bf16["predicted_gib"] == 6.9 and bf16["estimate_error_pct"] == pytest.approx(100 * (6.9 - 6.0) / 6.0)


def test_pareto_front_on_the_constructed_case() -> None:
    summary = report.summarize(constructed_rows())
    assert summary.pareto == ("bf16", "zero3")
    assert list(summary.trials.index[summary.trials["on_pareto_front"]]) == ["bf16", "zero3"]


def test_pareto_front_properties_on_random_points() -> None:
    rng = random.Random(0)
    for _ in range(200):
        points = {f"t{i}": (rng.randint(1, 6), rng.randint(1, 6)) for i in range(rng.randint(1, 12))}
        front = set(report.pareto_front(points))

        def dominates(p: tuple[float, float], q: tuple[float, float]) -> bool:
            return p[0] >= q[0] and p[1] <= q[1] and p != q

        for name in front:
            assert not any(dominates(points[o], points[name]) for o in points), (points, name)
        for name in set(points) - front:
            assert any(dominates(points[f], points[name]) for f in front), (points, name)
    assert report.pareto_front({"a": (2.0, 1.0), "b": (2.0, 1.0), "c": (1.0, 2.0)}) == ["a", "b"]


@pytest.mark.parametrize(
    ("budget", "fastest"),
    [
        (5 * GIB, "zero3"),  # bf16 (6 GiB) is over; zero3 peaks at 3 GiB (3.15 reserved)
        (6 * GIB, "bf16"),  # bf16 peaks (and reserves) exactly 6 GiB: fits
        (100 * GIB, "bf16"),
        (3 * GIB, None),  # zero3 peaks at 3 GiB but reserves 3.15 GiB: nothing fits
    ],
)
def test_recommendation_is_the_fastest_ok_trial_that_fits(budget: int, fastest: str | None) -> None:
    summary = report.summarize(constructed_rows(), memory_budget_bytes=budget)
    rec = summary.recommendation
    assert (rec.fastest, rec.most_frugal, rec.budget_source) == (fastest, "zero3", "--memory-budget")
    first = "".join(s.text for s in rec.lines[0])
    assert (
        first.startswith("No ok trial fits")
        if fastest is None
        else any(s.strong and s.text == fastest for s in rec.lines[0])
    )
    assert fastest is None or bool(summary.row(fastest).fits_budget)


def test_budget_is_checked_against_the_reserved_peak() -> None:
    rows = constructed_rows()
    rows[2].measured.memory = dataclasses.replace(rows[2].memory, peak_reserved_gib=6.5)  # bf16: 6.0 allocated
    summary = report.summarize(rows, memory_budget_bytes=int(6.2 * GIB))
    assert summary.recommendation.fastest == "zero3" and not summary.row("bf16").fits_budget


def test_cuda_context_room_is_the_measured_nvml_gap_or_said_unmeasured() -> None:
    lines = ["".join(s.text for s in line) for line in report.summarize(constructed_rows()).recommendation.lines]
    assert any("not measured here (no NVML reading)" in line for line in lines)
    assert not any("shared/" in line for line in lines)  # nothing printed points outside the repository
    rows = constructed_rows()
    for k, r in enumerate(rows):
        if r.memory:
            gap = 0.4 + 0.1 * k
            r.measured.memory = dataclasses.replace(r.memory, nvml_process_used_gib=r.memory.peak_reserved_gib + gap)
    lines = ["".join(s.text for s in line) for line in report.summarize(rows).recommendation.lines]
    # Qualifying trials: baseline, grad_ckpt, bf16, zero3, adam8bit (k = 0..4); fsdp is not_applied.
    assert any("NVML saw up to 0.800 GiB per process" in line for line in lines), lines


def test_default_budget_is_the_gpu_memory_of_the_environment() -> None:
    rec = report.summarize(constructed_rows(), environment=ENV).recommendation
    assert rec.budget_bytes == int(79.1 * GIB) and "environment.json" in rec.budget_source and rec.fastest == "bf16"
    rec = report.summarize(constructed_rows(), environment={"host": {"memory_total_gib": 62.7}}).recommendation
    assert rec.budget_bytes is None and rec.fastest == "bf16"
    assert rec.lines[0][0].text.startswith("No memory budget")


def test_parity_flagged_trials_are_not_recommended() -> None:
    rows = constructed_rows()
    rows[2].parity = ParityResult(flagged=True, compared=True, reason="final loss 9.1 vs baseline 0.68")
    summary = report.summarize(rows, memory_budget_bytes=100 * GIB)
    assert summary.recommendation.fastest == "zero3"
    last = "".join(s.text for s in summary.recommendation.lines[-1])
    assert "bf16 (final loss 9.1 vs baseline 0.68)" in last
    assert summary.row("bf16").parity_status == "flagged" and summary.row("zero3").parity_status == "ok"


def test_unmarked_baseline_falls_back_to_the_first_ok_trial_as_the_loss_check_does() -> None:
    rows = [dataclasses.replace(r, is_baseline=False) for r in constructed_rows()]
    chosen, note = report.resolve_baseline(rows)
    assert chosen is rows[0] and "No trial is marked as the baseline" in note
    summary = report.summarize(rows)
    assert summary.baseline == "baseline" and summary.row("baseline").parity_status == "baseline"
    assert summary.row("bf16").speedup_vs_baseline == pytest.approx(1.5)


def test_failed_baseline_is_stated_and_comparisons_left_blank() -> None:
    rows = constructed_rows()
    rows[0] = dataclasses.replace(rows[0], status="oom", reason="CUDA out of memory", measured=None)
    summary = report.summarize(rows)
    assert summary.baseline is None
    assert "The baseline trial baseline did not finish every run ok (oom: CUDA out of memory)" in summary.baseline_note
    assert summary.trials["speedup_vs_baseline"].isna().all() and summary.trials["memory_saved_pct"].isna().all()


def test_repeats_make_one_row_of_medians_keeping_each_value() -> None:
    base = Strategy(name="baseline")
    rows = []
    for k, speed in enumerate([9.0, 12.0, 10.0]):
        rows.append(ok_row("baseline", base, speed, 8.0 + k / 10, is_baseline=True, repeat=k, repeats=3))
    flaky = ok_row("bf16", base.replace(name="bf16", precision="bf16"), 30.0, 1.0, repeat=0, repeats=3)
    oom = TrialResult(
        trial="bf16", strategy=flaky.strategy, status="oom", reason="CUDA out of memory", repeat=1, repeats=3
    )
    skipped = TrialResult(
        trial="bf16", strategy=flaky.strategy, status="skipped", reason="not repeated", repeat=2, repeats=3
    )
    summary = report.summarize([*rows, flaky, oom, skipped])
    assert list(summary.trials.index) == ["baseline", "bf16"]
    b = summary.row("baseline")
    assert b.runs == 3 and b.samples_per_s == pytest.approx((9 * 12 * 10) ** (1 / 3))  # geometric mean over runs
    assert b.samples_per_s_values == [9.0, 12.0, 10.0]
    assert b.samples_per_s_spread_pct == pytest.approx(300 / (9 * 12 * 10) ** (1 / 3))  # (12 - 9) / its figure
    assert b.peak_gib == pytest.approx(8.2)  # the largest peak of the three
    f = summary.row("bf16")  # out of memory once: not ok, though one repeat was
    assert f.status == "oom" and f.reason == "repeat 2 of 3: CUDA out of memory; 1 repeat(s) ok"
    assert summary.recommendation.fastest == "baseline" and summary.pareto == ("baseline",)


def test_repeated_trial_names_stay_distinct() -> None:
    rows = constructed_rows()[:2]
    rows.append(dataclasses.replace(rows[1]))
    assert list(report.summarize(rows).trials.index) == ["baseline", "grad_ckpt", "grad_ckpt#2"]


# -- memory breakdown ------------------------------------------------------------------------------------------------


def _breakdown(mem: Any, strategy: Strategy | None = None, states: list[str] | None = None) -> MemoryBreakdown | None:
    strategy = strategy or Strategy(name="t")
    row = ok_row("t", strategy, 10.0, mem.peak_gib, memory=mem, verification=verification(strategy, states or []))
    return MemoryBreakdown.of(row)


def test_memory_breakdown_follows_the_documented_derivation() -> None:
    b = _breakdown(memory(6.0, load=1.0, fwd=3.5, bwd=2.2, opt=4.6))
    assert (b.weights_gib, b.activations_gib, b.gradients_gib, b.optimizer_gib) == pytest.approx((1.0, 2.5, 1.2, 2.4))
    assert b.other_gib == 0.0  # 6.0 - 7.1 is negative: the four are not all held at the peak
    assert _breakdown(memory(10.0, load=1.0, fwd=2.0, bwd=2.0, opt=5.0)).other_gib == pytest.approx(4.0)
    assert _breakdown(memory(3.0, load=1.0, fwd=2.0, bwd=2.0, opt=1.5)).optimizer_gib == 0.0  # never negative
    partial = _breakdown(memory(3.0, load=1.0, fwd=2.0, bwd=2.0, opt=None))
    assert partial.optimizer_gib is None and partial.gradients_gib == pytest.approx(1.0)
    no_load = memory(3.0, load=1.0, fwd=2.0, bwd=2.0, opt=3.0)
    no_load.phases_gib["model_load"] = None
    assert _breakdown(no_load) is None


def test_deepspeed_optimizer_states_are_said_to_be_in_gradients_not_model_load() -> None:
    """Issue 11 item 15: ZeRO's model_load holds 6 bytes/param (16-bit weights + fp32 master), not the states."""
    zero = Strategy(name="z", precision="bf16", deepspeed=DeepSpeedSpec(zero_stage=2))
    b = _breakdown(memory(7.557, load=1.874, fwd=3.513, bwd=4.436, opt=4.436), zero, ["float32"])
    assert b.optimizer_gib is None and b.optimizer_in_gradients and b.gradients_gib == pytest.approx(2.562)
    note = " ".join(b.notes())
    assert "in gradients" in note and "no optimizer states" in note and "are in model_load" not in note
    frame = report.summarize_run(REPO / "results" / "bert_large-h100").trials
    for name in ("zero2-bf16", "zero3-bf16"):
        assert "so they are in model_load" not in frame.loc[name, "memory_notes"]


def test_skipped_first_fp16_step_is_not_shown_as_an_optimizer_of_zero() -> None:
    """Issue 11 item 14: an fp16 first step skipped by the loss scaler allocated no optimizer states; the old
    report showed ``optimizer 0.000`` and put the states in ``other``."""
    fp16 = Strategy(name="h", precision="fp16")
    b = _breakdown(memory(6.31, load=1.249, fwd=1.333, bwd=2.563, opt=2.563), fp16, ["float32"])
    assert b.optimizer_gib is None and b.first_step_skipped and "skipped" in " ".join(b.notes())
    # fp32 with the same phases (an optimizer without states, or one whose states are tiny): shown as measured.
    b = _breakdown(memory(6.31, load=1.249, fwd=1.333, bwd=2.563, opt=2.563), Strategy(name="f"), ["float32"])
    assert b.optimizer_gib == pytest.approx(0.0) and not b.first_step_skipped
    frame = report.summarize_run(REPO / "results" / "bert_large-h100").trials
    skipped = frame.loc["bs1-acc4-ckpt-fp16"]
    assert skipped["first_step_skipped"] and math.isnan(skipped["optimizer_gib"])
    assert frame.loc["bs4-fp16", "optimizer_gib"] == pytest.approx(2.4985, abs=1e-3)  # that step ran


def test_default_budget_reads_the_recorded_gpus() -> None:
    """The budget comes from ``hfscale.results.environment.gpu_memory_bytes`` (the smallest recorded GPU), not from a
    guess over free-form keys."""
    two = {"gpus": [{"memory_total_bytes": 85_899_345_920}, {"memory_total_bytes": 42_949_672_960}]}
    assert report.summarize(constructed_rows(), environment=two).recommendation.budget_bytes == 42_949_672_960
    guessable = {"gpu": {"name": "A100", "memory_total_gib": 39.4}}
    assert report.summarize(constructed_rows(), environment=guessable).recommendation.budget_bytes is None


# -- the pandas API ----------------------------------------------------------------------------------------------------


def test_load_run_equals_the_committed_report() -> None:
    """``hfscale.load_run`` gives the samples/s and peak memory the committed report.md shows."""
    run = REPO / "results" / "bert_large-h100"
    frame = hfscale.load_run(run)
    table = md_table((run / "report.md").read_text(encoding="utf-8"), "All measurements")
    assert list(frame.index) == [r["trial"] for r in table]
    for cells in table:
        row = frame.loc[cells["trial"]]
        assert f"{row['samples_per_s']:.2f}" == cells["samples/s (steady)"]
        assert f"{row['peak_gib']:.3f}" == cells["peak memory (GiB)"]
        assert f"{row['speedup_vs_baseline']:.2f}" == cells["speed-up vs baseline (x)"]
    assert {
        "samples_per_s",
        "peak_gib",
        "peak_reserved_gib",
        "wall_time_s",
        "speedup_vs_baseline",
        "memory_saved_pct",
        "estimate_error_pct",
        "samples_per_s_values",
        "runs",
        "parity_status",
    } <= set(frame)


_READ_A_RUN = """
import sys
import hfscale
from hfscale.commands.main import main
run, out = sys.argv[1], sys.argv[2]
assert len(hfscale.load_run(run)) == 7
assert main(["report", run, "--out", out + "/report"]) == 0
assert main(["compare", run, run, "--out", out + "/compare"]) == 0
print(" ".join(sorted(name for name in ("torch", "transformers") if name in sys.modules)) or "neither")
"""


def test_reading_a_finished_run_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    """``load_run``, ``hfscale report`` and ``hfscale compare`` of a committed run, in a fresh interpreter: reading
    needs the recipe's trial names, not a validated model (issue 28: importing transformers and torch to validate
    each model was about 12 of the 17 seconds of a 5-trial report on 2 cores)."""
    import subprocess
    import sys

    run = REPO / "results" / "cpu_small-cpu2"
    proc = subprocess.run(
        [sys.executable, "-c", _READ_A_RUN, str(run), str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "neither", proc.stdout[-2000:]
    assert "7 of 7 recipe trials have a result" in (tmp_path / "report" / "report.md").read_text(encoding="utf-8")


def test_load_run_of_a_missing_folder_names_it(tmp_path: Path) -> None:
    with pytest.raises(report.ReportError, match=r"nope: no such folder; expected a run folder"):
        hfscale.load_run(tmp_path / "nope")
    write_run(tmp_path / "empty", [])
    assert len(hfscale.load_run(tmp_path / "empty")) == 0


def test_a_lora_fastest_is_said_to_be_a_different_job() -> None:
    """LoRA trains adapters only: recommending it as "fastest" against full training without saying so would
    compare two jobs as if they were one."""
    from hfscale.strategy import LoraSpec

    base = Strategy(name="baseline")
    rows = [
        ok_row("baseline", base, 10.0, 8.0, is_baseline=True),
        ok_row("lora", base.replace(name="lora", lora=LoraSpec()), 14.0, 5.0),
    ]
    rec = report.summarize(rows).recommendation
    lines = ["".join(s.text for s in line) for line in rec.lines]
    assert rec.fastest == "lora"
    assert any("lora trains LoRA adapters with the base frozen, a different job" in line for line in lines), lines
    plain = [
        ok_row("baseline", base, 10.0, 8.0, is_baseline=True),
        ok_row("bf16", base.replace(name="bf16"), 14.0, 5.0),
    ]
    lines = ["".join(s.text for s in line) for line in report.summarize(plain).recommendation.lines]
    assert not any("a different job" in line for line in lines)


def test_a_max_batch_fastest_is_said_to_run_at_another_batch() -> None:
    from hfscale.records.batch import BatchSearchRecord

    base = Strategy(name="baseline")
    bigger = base.replace(name="baseline-maxbatch", per_device_batch_size=32)
    rows = [
        ok_row("baseline", base, 10.0, 8.0, is_baseline=True),
        ok_row(
            "baseline-maxbatch",
            bigger,
            14.0,
            9.0,
            batch_search=BatchSearchRecord(searched=False, max_batch_of="baseline"),
        ),
    ]
    lines = ["".join(s.text for s in line) for line in report.summarize(rows).recommendation.lines]
    assert any("baseline-maxbatch runs baseline at its largest batch" in line for line in lines), lines
