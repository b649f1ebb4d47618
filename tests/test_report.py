"""Reports from run folders: the tables match the JSON lines, the Pareto front and the recommendation are right on a
hand-made case, failed trials are shown with their reason, bad input exits 2 with a message naming the argument."""

from __future__ import annotations

import base64
import csv
import dataclasses
import html
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest

from hfscale import report
from hfscale.results import ENVIRONMENT_FILE, RESULTS_FILE, TrialResult, append_result
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy

pytest.importorskip("matplotlib", reason="reports need the report extra: pip install 'hfscale[report]'")

GIB = 2**30

# -- building run folders ------------------------------------------------------------------------------------------


def memory(
    peak_gib: float,
    *,
    load: float,
    fwd: float,
    bwd: float,
    opt: float,
    reserved: float | None = None,
    world_size: int = 1,
) -> dict[str, Any]:
    """A MemorySummary.to_dict() as the callbacks write it."""
    phases = {"model_load": load, "forward": fwd, "backward": bwd, "optimizer_step": opt}
    return {
        "device": "cuda",
        "world_size": world_size,
        "peak_gib": peak_gib,
        "peak_reserved_gib": reserved,
        "phases_gib": phases,
        "phase_peaks_gib": {k: v * 1.1 for k, v in phases.items()},
        "alloc_retries": 0,
        "ooms": 0,
        "nvml_process_used_gib": None,
        "nvml_device_used_gib": None,
        "per_rank": [],
        "notes": [],
    }


def throughput(samples_per_s: float, *, world_size: int = 1, mfu: float | None = None) -> dict[str, Any]:
    """A ThroughputSummary.to_dict() as the callbacks write it."""
    return {
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * 512,
        "step_time_median_s": 8 / samples_per_s,
        "step_time_p90_s": 9 / samples_per_s,
        "step_time_mean_s": 8.5 / samples_per_s,
        "measured_steps": 20,
        "warmup_steps": 5,
        "samples_per_step": 8,
        "tokens_per_sample": 512,
        "world_size": world_size,
        "flops_per_token": 2.0e9,
        "mfu": mfu,
        "peak_flops_per_s": None if mfu is None else 989.5e12,
        "device_name": "NVIDIA H100 80GB HBM3",
    }


def ok_row(name: str, strategy: Strategy, speed: float, peak: float, **kw: Any) -> TrialResult:
    # weights 0.2, activations 0.2, gradients 0.2, optimizer 0.3 of the peak: 0.1 left for the rest
    mem = memory(
        peak,
        load=0.2 * peak,
        fwd=0.4 * peak,
        bwd=0.4 * peak,
        opt=0.7 * peak,
        reserved=kw.pop("reserved", peak * 1.05),
        world_size=strategy.num_processes,
    )
    return TrialResult(
        trial=name,
        strategy=strategy.to_dict(),
        description=strategy.describe(),
        status="ok",
        wall_time_s=100.0 / speed + 7.25,
        train_runtime_s=100.0 / speed,
        train_samples_per_second=speed * 0.93,
        final_loss=0.6931 - speed / 1000,
        loss_curve=[0.75, 0.72, 0.70 - speed / 1000],
        memory=mem,
        throughput=throughput(speed, world_size=strategy.num_processes, mfu=kw.pop("mfu", 0.31)),
        **kw,
    )


def constructed_rows() -> list[TrialResult]:
    """Hand-made case: bf16 (15/s, 6 GiB) and zero3 (12/s, 3 GiB) form the Pareto front; fsdp (not_applied) is
    faster and smaller than both but must never count."""
    base = Strategy(name="baseline")
    return [
        ok_row("baseline", base, 10.0, 8.0, is_baseline=True),
        ok_row("grad_ckpt", base.replace(name="grad_ckpt", gradient_checkpointing=True), 7.0, 5.0),
        ok_row(
            "bf16",
            base.replace(name="bf16", precision="bf16"),
            15.0,
            6.0,
            reserved=6.0,
            estimate={
                "total_gib": 6.9,
                "weights_gib": 1.5,
                "gradients_gib": 1.5,
                "optimizer_gib": 3.0,
                "activations_gib": 0.6,
                "overhead_gib": 0.3,
            },
        ),
        ok_row(
            "zero3",
            base.replace(name="zero3", deepspeed=DeepSpeedSpec(zero_stage=3), num_processes=2),
            12.0,
            3.0,
            extra={"parity": {"flagged": False, "reason": None}},
        ),
        ok_row("adam8bit", base.replace(name="adam8bit", optimizer="adamw_bnb_8bit"), 9.0, 7.0, mfu=None),
        dataclasses.replace(
            ok_row("fsdp", base.replace(name="fsdp", fsdp=FsdpSpec(), num_processes=2), 20.0, 2.0),
            status="not_applied",
            reason="asked for FSDP2 full_shard, ran DDP: accelerate does not switch to FSDP on MULTI_CPU",
        ),
        TrialResult(
            trial="big_batch",
            strategy=base.replace(name="big_batch", per_device_batch_size=64).to_dict(),
            status="oom",
            reason="CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)",
            exit_code=1,
            stderr_tail="Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory",
        ),
        TrialResult(
            trial="ddp",
            strategy=base.replace(name="ddp", num_processes=2).to_dict(),
            status="crashed",
            reason="exit code -9 (SIGKILL)",
            exit_code=-9,
        ),
        TrialResult(
            trial="offload",
            strategy=base.replace(
                name="offload", deepspeed=DeepSpeedSpec(zero_stage=2, offload_optimizer="cpu")
            ).to_dict(),
            status="skipped",
            reason="deepspeed is not installed: pip install 'hfscale[deepspeed]'",
        ),
    ]


H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_gib": 79.1}
ENV = {  # as hfscale.environment.collect_environment writes it
    "time": "2026-11-20T10:00:00+00:00",
    "host": "node-7",
    "platform": "Linux-5.15-x86_64-with-glibc2.35",
    "python": "3.11.7",
    "cpu_model": "Intel(R) Xeon(R) Platinum 8480+",
    "cpu_count": 224,
    "host_memory_total_gib": 2015.6,
    "driver_version": "550.54.15",
    "cuda_driver_version": "12.4",
    "gpus": [{"index": 0, **H100}, {"index": 1, **H100}],
    "gpu_count": 2,
    "cuda_version": "12.4",
    "packages": {"hfscale": "0.1.0", "torch": "2.6.0", "transformers": "4.56.0", "bitsandbytes": None},
    "git": {"commit": "abc1234def5678", "dirty": False},
    "env": {"CUDA_VISIBLE_DEVICES": "0,1"},
}


def write_run(folder: Path, rows: list[TrialResult], environment: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULTS_FILE).touch()
    for row in rows:
        append_result(folder / RESULTS_FILE, row)
    if environment is not None:
        (folder / ENVIRONMENT_FILE).write_text(json.dumps(environment), encoding="utf-8")
    return folder


def json_lines(folder: Path) -> list[dict[str, Any]]:
    """The rows as written, read back without hfscale."""
    return [json.loads(line) for line in (folder / RESULTS_FILE).read_text(encoding="utf-8").splitlines()]


def md_table(text: str, heading: str) -> list[dict[str, str]]:
    """The first Markdown table under ``## heading``, as one dict per row keyed by header."""
    lines = text.split(f"## {heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = _takewhile(lines[start:])
    split = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table]
    headers, rows = split[0], split[2:]
    return [dict(zip(headers, row, strict=True)) for row in rows]


def _takewhile(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if not line.startswith("|"):
            break
        out.append(line)
    return out


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", constructed_rows(), ENV)


# -- the tables ----------------------------------------------------------------------------------------------------


def test_every_trial_is_in_every_file_with_the_numbers_of_its_json_line(run: Path) -> None:
    paths = report.write_report(run, memory_budget_bytes=5 * GIB)
    lines = json_lines(run)
    md = paths.markdown.read_text(encoding="utf-8")
    table = md_table(md, "Trials")
    assert [r["trial"] for r in table] == [line["trial"] for line in lines]

    base = next(line for line in lines if line["is_baseline"])
    for cells, line in zip(table, lines, strict=True):
        assert cells["status"].split(":")[0] == line["status"]
        if line["status"] != "ok":
            continue
        tp, mem = line["throughput"], line["memory"]
        assert cells["strategy"] == Strategy.from_dict(line["strategy"]).describe()
        assert cells["samples/s (steady)"] == f"{tp['samples_per_s']:.2f}"
        assert cells["samples/s (Trainer)"] == f"{line['train_samples_per_second']:.2f}"
        assert cells["tokens/s"] == f"{tp['tokens_per_s']:.0f}"
        assert cells["wall time (s)"] == f"{line['wall_time_s']:.2f}"
        assert cells["train time (s)"] == f"{line['train_runtime_s']:.2f}"
        assert cells["peak memory (GiB)"] == f"{mem['peak_gib']:.3f}"
        assert cells["final loss"] == f"{line['final_loss']:.4f}"
        assert cells["MFU (%)"] == ("—" if tp["mfu"] is None else f"{100 * tp['mfu']:.1f}")
        speedup = tp["samples_per_s"] / base["throughput"]["samples_per_s"]
        assert cells["speed-up vs baseline (x)"] == f"{speedup:.2f}"
        saved = 100 * (1 - mem["peak_gib"] / base["memory"]["peak_gib"])
        assert cells["memory saved vs baseline (%)"] == f"{saved:.1f}"

    with open(paths.csv, encoding="utf-8", newline="") as fh:
        records = list(csv.DictReader(fh))
    assert [r["trial"] for r in records] == [line["trial"] for line in lines]
    for record, line in zip(records, lines, strict=True):
        assert record["status"] == line["status"]
        assert record["reason"] == (line["reason"] or "")
        if line["throughput"]:
            assert math.isclose(float(record["samples_per_s"]), line["throughput"]["samples_per_s"], rel_tol=1e-12)
            assert math.isclose(float(record["peak_gib"]), line["memory"]["peak_gib"], rel_tol=1e-12)
            reserved = line["memory"]["peak_reserved_gib"]
            assert math.isclose(float(record["peak_reserved_gib"]), reserved, rel_tol=1e-12)
        else:
            assert record["samples_per_s"] == record["peak_gib"] == ""

    html_text = paths.html.read_text(encoding="utf-8")
    for line in lines:
        assert f"<td>{line['trial']}</td>" in html_text


def test_failed_trials_are_shown_with_status_and_reason(run: Path) -> None:
    paths = report.write_report(run)
    md = paths.markdown.read_text(encoding="utf-8")
    html_text = paths.html.read_text(encoding="utf-8")
    table = {r["trial"]: r for r in md_table(md, "Trials")}
    failed = [line for line in json_lines(run) if line["status"] != "ok"]
    assert {line["status"] for line in failed} == {"oom", "crashed", "skipped", "not_applied"}
    for line in failed:
        cell = table[line["trial"]]["status"]
        assert cell.startswith(f"{line['status']}: "), cell
        assert line["reason"].startswith(cell.split(": ", 1)[1].rstrip("…"))
        # The full reason is in the failures section of both files.
        assert f"### {line['trial']}: {line['status']}" in md
        assert f"Reason: {line['reason']}" in md
        assert line["reason"].replace("'", "&#x27;") in html_text
    assert "torch.OutOfMemoryError: CUDA out of memory" in md


def test_memory_breakdown_follows_the_documented_derivation() -> None:
    mem = memory(6.0, load=1.0, fwd=3.5, bwd=2.2, opt=4.6)
    b = report.MemoryBreakdown.from_memory(mem)
    assert b is not None
    assert b.weights_gib == pytest.approx(1.0)
    assert b.activations_gib == pytest.approx(2.5)  # forward - model_load
    assert b.gradients_gib == pytest.approx(1.2)  # backward - model_load
    assert b.optimizer_gib == pytest.approx(2.4)  # optimizer_step - backward
    assert b.other_gib == 0.0  # 6.0 - 7.1 is negative: the four are not all held at the peak

    b = report.MemoryBreakdown.from_memory(memory(10.0, load=1.0, fwd=2.0, bwd=2.0, opt=5.0))
    assert b is not None and b.other_gib == pytest.approx(10.0 - (1.0 + 1.0 + 1.0 + 3.0))

    # A library releasing memory between phases shows as 0, never negative.
    b = report.MemoryBreakdown.from_memory(memory(3.0, load=1.0, fwd=2.0, bwd=2.0, opt=1.5))
    assert b is not None and b.optimizer_gib == 0.0

    partial = memory(3.0, load=1.0, fwd=2.0, bwd=2.0, opt=0.0)
    del partial["phases_gib"]["optimizer_step"]
    b = report.MemoryBreakdown.from_memory(partial)
    assert b is not None and b.optimizer_gib is None and b.gradients_gib == pytest.approx(1.0)

    # DeepSpeed (from the strategy or the callback's notes): the optimizer states are in model_load.
    ds = memory(3.0, load=1.5, fwd=2.0, bwd=2.0, opt=2.5)
    assert report.MemoryBreakdown.from_memory(ds).optimizer_gib == pytest.approx(0.5)
    for b in (
        report.MemoryBreakdown.from_memory(ds, deepspeed=True),
        report.MemoryBreakdown.from_memory({**ds, "notes": ["DeepSpeed: engine.step() runs inside backward"]}),
    ):
        assert b is not None and b.optimizer_in_weights and b.optimizer_gib is None and b.weights_gib == 1.5

    no_load = memory(3.0, load=1.0, fwd=2.0, bwd=2.0, opt=3.0)
    del no_load["phases_gib"]["model_load"]
    assert report.MemoryBreakdown.from_memory(no_load) is None
    assert report.MemoryBreakdown.from_memory(None) is None


def test_memory_table_and_csv_hold_the_breakdown(run: Path) -> None:
    paths = report.write_report(run)
    table = {r["trial"]: r for r in md_table(paths.markdown.read_text(encoding="utf-8"), "Memory")}
    with open(paths.csv, encoding="utf-8", newline="") as fh:
        records = {r["trial"]: r for r in csv.DictReader(fh)}
    for line in json_lines(run):
        phases = (line["memory"] or {}).get("phases_gib")
        cells = table[line["trial"]]
        if not phases:
            assert cells["weights (GiB)"] == "—"
            assert records[line["trial"]]["weights_gib"] == ""
            continue
        if line["estimate"]:
            error = 100 * (line["estimate"]["total_gib"] / line["memory"]["peak_gib"] - 1)
            assert cells["estimate (GiB)"] == f"{line['estimate']['total_gib']:.3f}"
            assert cells["estimate vs peak (%)"] == f"{error:.1f}"
        grads = phases["backward"] - phases["model_load"]
        assert cells["weights (GiB)"] == f"{phases['model_load']:.3f}"
        assert cells["gradients (GiB)"] == f"{grads:.3f}"
        if line["strategy"]["deepspeed"]:  # ZeRO allocates its optimizer states with the model
            assert cells["optimizer (GiB)"] == "—"
        else:
            assert cells["optimizer (GiB)"] == f"{phases['optimizer_step'] - phases['backward']:.3f}"
        assert cells["activations (GiB)"] == f"{phases['forward'] - phases['model_load']:.3f}"
        assert math.isclose(float(records[line["trial"]]["gradients_gib"]), grads, rel_tol=1e-12)
    assert any(p.name == "report_memory.png" for p in paths.figures)


# -- Pareto front and recommendation --------------------------------------------------------------------------------


def test_pareto_front_on_the_constructed_case(run: Path) -> None:
    summary = report.load_run(run)
    assert summary.pareto == ("bf16", "zero3")
    assert [r.trial for r in summary.rows if r.on_pareto_front] == ["bf16", "zero3"]
    assert "fsdp" not in summary.pareto  # not_applied: faster and smaller, but not what was asked for


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


def test_identical_points_are_all_on_the_front() -> None:
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
def test_recommendation_is_the_fastest_ok_trial_that_fits(run: Path, budget: int, fastest: str | None) -> None:
    summary = report.load_run(run, memory_budget_bytes=budget)
    rec = summary.recommendation
    assert rec.fastest == fastest
    assert rec.most_frugal == "zero3"
    assert rec.budget_source == "--memory-budget"
    if fastest is None:
        assert "No ok trial fits" in rec.lines[0]
    else:
        assert f"**{fastest}**" in rec.lines[0]
    fits = {r.trial for r in summary.rows if r.fits_budget}
    assert fastest is None or fastest in fits


def test_budget_is_checked_against_the_reserved_peak(tmp_path: Path) -> None:
    rows = constructed_rows()
    rows[2].memory["peak_reserved_gib"] = 6.5  # bf16: allocated 6.0, reserved 6.5
    summary = report.load_run(write_run(tmp_path / "r", rows), memory_budget_bytes=int(6.2 * GIB))
    assert summary.recommendation.fastest == "zero3"
    assert summary.row("bf16").fits_budget is False


def test_cuda_context_room_is_the_measured_nvml_gap_or_labelled_assumed(tmp_path: Path) -> None:
    rows = constructed_rows()
    for r in rows:
        if r.memory and r.memory.get("peak_reserved_gib") is None:
            r.memory["peak_reserved_gib"] = r.memory["peak_gib"] + 0.25
    unmeasured = report.load_run(write_run(tmp_path / "a", rows)).recommendation
    assert any("not measured here" in line and "assumption" in line for line in unmeasured.lines)
    for k, r in enumerate(rows):
        if r.memory:
            r.memory["nvml_process_used_gib"] = r.memory["peak_reserved_gib"] + 0.4 + 0.1 * k
    summary = report.load_run(write_run(tmp_path / "b", rows))
    ok = [row for row in summary.rows if row.ok and not row.parity_flagged and row.samples_per_s is not None]
    measured = max(row.nvml_process_used_gib - row.peak_reserved_gib for row in ok)
    assert any(f"up to {measured:.3f} GiB per process" in line for line in summary.recommendation.lines)
    assert not any("0.3-0.5" in line or "not measured here" in line for line in summary.recommendation.lines)


def test_default_budget_is_the_gpu_memory_of_the_environment(run: Path) -> None:
    rec = report.load_run(run).recommendation
    assert rec.budget_bytes == int(79.1 * GIB)
    assert "environment.json" in rec.budget_source
    assert rec.fastest == "bf16"


def test_without_budget_the_fastest_overall_is_named_with_a_note(tmp_path: Path) -> None:
    summary = report.load_run(write_run(tmp_path / "r", constructed_rows(), {"host": {"memory_total_gib": 62.7}}))
    rec = summary.recommendation
    assert rec.budget_bytes is None and rec.fastest == "bf16"
    assert rec.lines[0].startswith("No memory budget")


def test_parity_flagged_trials_are_not_recommended(tmp_path: Path) -> None:
    rows = constructed_rows()
    rows[2].extra["parity"] = {"flagged": True, "reason": "final loss 9.1 vs baseline 0.68"}
    summary = report.load_run(write_run(tmp_path / "r", rows), memory_budget_bytes=100 * GIB)
    assert summary.recommendation.fastest == "zero3"
    assert any("bf16 (final loss 9.1 vs baseline 0.68)" in line for line in summary.recommendation.lines)
    md = report.write_report(tmp_path / "r").markdown.read_text(encoding="utf-8")
    notes = {r["trial"]: r["notes"] for r in md_table(md, "Trials")}
    assert "loss flagged: final loss 9.1" in notes["bf16"]
    assert "loss parity ok" in notes["zero3"]


def test_nothing_to_recommend_when_no_trial_finished(tmp_path: Path) -> None:
    rows = [r for r in constructed_rows() if r.status != "ok"]
    paths = report.write_report(write_run(tmp_path / "r", rows))
    md = paths.markdown.read_text(encoding="utf-8")
    assert "nothing can be recommended" in md
    assert len(md_table(md, "Trials")) == len(rows)


# -- baseline --------------------------------------------------------------------------------------------------------


def test_missing_baseline_is_stated_and_comparisons_left_blank(tmp_path: Path) -> None:
    rows = [dataclasses.replace(r, is_baseline=False) for r in constructed_rows()]
    md = report.write_report(write_run(tmp_path / "r", rows)).markdown.read_text(encoding="utf-8")
    assert "No trial is marked as the baseline" in md
    assert {r["speed-up vs baseline (x)"] for r in md_table(md, "Trials")} == {"—"}


def test_failed_baseline_is_stated(tmp_path: Path) -> None:
    rows = constructed_rows()
    rows[0] = dataclasses.replace(rows[0], status="oom", reason="CUDA out of memory", throughput=None)
    summary = report.load_run(write_run(tmp_path / "r", rows))
    assert summary.baseline is None
    assert "The baseline trial baseline did not finish (oom: CUDA out of memory)" in summary.baseline_note
    assert all(r.speedup_x is None and r.memory_saved_pct is None for r in summary.rows)


def test_repeats_make_one_row_of_medians(tmp_path: Path) -> None:
    base = Strategy(name="baseline")
    rows = []
    for k, speed in enumerate([9.0, 12.0, 10.0]):
        row = ok_row("baseline", base, speed, 8.0 + k / 10, is_baseline=True)
        row.extra.update(repeat=k, repeats=3)
        rows.append(row)
    flaky = ok_row("bf16", base.replace(name="bf16", precision="bf16"), 30.0, 1.0)
    flaky.extra.update(repeat=0, repeats=3)
    oom = TrialResult(
        trial="bf16",
        strategy=flaky.strategy,
        status="oom",
        reason="CUDA out of memory",
        extra={"repeat": 1, "repeats": 3},
    )
    skipped = TrialResult(
        trial="bf16",
        strategy=flaky.strategy,
        status="skipped",
        reason="repeat 2 ended oom; not repeated",
        extra={"repeat": 2, "repeats": 3},
    )
    rows += [flaky, oom, skipped]
    run = write_run(tmp_path / "r", rows)
    summary = report.load_run(run)
    assert [r.trial for r in summary.rows] == ["baseline", "bf16"]
    b = summary.row("baseline")
    assert b.runs == 3 and b.samples_per_s == 10.0  # median of 9, 12, 10
    assert b.samples_per_s_spread_pct == pytest.approx(30.0)  # (12 - 9) / 10
    assert b.peak_gib == pytest.approx(8.2)  # the largest peak of the three
    # A trial that ran out of memory once is not ok, though one repeat was.
    f = summary.row("bf16")
    assert f.status == "oom" and f.reason == "repeat 2 of 3: CUDA out of memory; 1 repeat(s) ok"
    assert summary.recommendation.fastest == "baseline" and summary.pareto == ("baseline",)
    md = report.write_report(run).markdown.read_text(encoding="utf-8")
    cells = {r["trial"]: r for r in md_table(md, "Trials")}
    assert cells["baseline"]["runs"] == "3" and cells["baseline"]["samples/s spread (%)"] == "30.0"


def test_repeated_trial_names_stay_distinct(tmp_path: Path) -> None:
    rows = constructed_rows()[:2]
    rows.append(dataclasses.replace(rows[1]))
    summary = report.load_run(write_run(tmp_path / "r", rows))
    assert [r.trial for r in summary.rows] == ["baseline", "grad_ckpt", "grad_ckpt#2"]


# -- environment and HTML -------------------------------------------------------------------------------------------


def test_environment_header_is_on_every_report(run: Path, tmp_path: Path) -> None:
    paths = report.write_report(run)
    md = paths.markdown.read_text(encoding="utf-8")
    html_text = paths.html.read_text(encoding="utf-8")
    header = {
        "machine": "node-7, Intel(R) Xeon(R) Platinum 8480+, 224 CPUs, 2015.6 GiB RAM",
        "GPUs": "2 x NVIDIA H100 80GB HBM3 (79.1 GiB)",
        "driver / CUDA": "driver 550.54.15, driver CUDA 12.4, torch CUDA 12.4",
        "libraries": "hfscale 0.1.0, torch 2.6.0, transformers 4.56.0",  # bitsandbytes: not installed
        "commit": "abc1234def56",
        "started": "2026-11-20T10:00:00+00:00",
    }
    top = md.split("## Trials", 1)[0]
    for key, value in header.items():
        assert f"| {key} | {value} |" in top
        assert f"<td>{key}</td><td>{html.escape(value)}</td>" in html_text
    # The whole record too, at the end.
    assert "| packages.torch | 2.6.0 |" in md.split("## Environment (full record)", 1)[1]
    assert "<td>env.CUDA_VISIBLE_DEVICES</td><td>0,1</td>" in html_text

    free_form = {"gpu": {"name": "A100", "memory_total_gib": 39.4}, "torch": "2.5.1"}
    md = report.write_report(write_run(tmp_path / "free", constructed_rows(), free_form)).markdown.read_text()
    assert "| gpu.name | A100 |" in md and "| torch | 2.5.1 |" in md

    no_env = report.write_report(write_run(tmp_path / "bare", constructed_rows()))
    assert "No environment.json" in no_env.markdown.read_text(encoding="utf-8")
    assert "No environment.json" in no_env.html.read_text(encoding="utf-8")


def test_html_is_self_contained(run: Path) -> None:
    paths = report.write_report(run, out_dir=run / "out")
    html_text = paths.html.read_text(encoding="utf-8")
    # No reference that a browser would fetch: every src is inline, no link/script/@import/url().
    assert not re.search(r"<(link|script)\b|@import|url\(", html_text, re.IGNORECASE)
    srcs = re.findall(r'\b(?:src|href)="([^"]*)"', html_text)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    # The embedded images are the plots written beside report.md.
    embedded = [base64.b64decode(s.split(",", 1)[1]) for s in srcs]
    assert embedded == [p.read_bytes() for p in paths.figures]
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in embedded)
    md = paths.markdown.read_text(encoding="utf-8")
    for fig in paths.figures:
        assert f"]({fig.name})" in md


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        (ENV, int(79.1 * GIB)),
        ({"gpu": {"name": "H100", "memory_total_gib": 79.1}}, int(79.1 * GIB)),
        (
            {"gpus": [{"name": "A", "total_memory": 85_899_345_920}, {"name": "B", "total_memory": 42_949_672_960}]},
            42_949_672_960,
        ),
        ({"gpu_memory_mib": 16384}, 16 * GIB),
        ({"nvml": {"memory_total": "81559 MiB"}}, 81559 * 2**20),
        ({"cuda": {"device_memory_bytes": 17_179_869_184}}, 16 * GIB),
        ({"host": {"memory_total_gib": 62.7}, "gpu": {"count": 0}}, None),
        ({"gpu": {"memory_used_gib": 3.0, "peak_memory_gib": 2.0}}, None),
        ({}, None),
    ],
)
def test_gpu_memory_from_environment(environment: dict[str, Any], expected: int | None) -> None:
    assert report.gpu_memory_from_environment(environment) == expected


# -- sizes and the command line --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("16GiB", 16 * GIB),
        ("16 GB", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5gib", int(1.5 * GIB)),
        ("80GB", 80 * 10**9),
        ("2TiB", 2 * 2**40),
        ("100 MB", 10**8),
    ],
)
def test_parse_memory_size(text: str, size: int) -> None:
    assert report.parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["16", "16G", "sixteen GiB", "-1GiB", "GiB", "16 GiB extra", "0GiB"])
def test_parse_memory_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"cannot read .* as a memory size"):
        report.parse_memory_size(text)


def test_cli_writes_the_report(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hfscale.cli import main as hfscale_main

    out = tmp_path / "out"
    assert hfscale_main(["report", str(run), "--memory-budget", "5GiB", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(out / "report.md") in printed and str(out / "report.html") in printed
    assert (out / "results.csv").is_file()
    assert "Fastest within 5 GiB per device (--memory-budget): **zero3**" in (out / "report.md").read_text()


def test_cli_bad_budget_names_the_argument(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(run), "--memory-budget", "16G"]) == 2
    err = capsys.readouterr().err
    assert "--memory-budget" in err and "GiB" in err and "'16G'" in err
    assert not (run / "report.md").exists()


@pytest.mark.parametrize("what", ["missing", "empty_folder"])
def test_cli_folder_without_results(tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str) -> None:
    folder = tmp_path / what
    if what == "empty_folder":
        folder.mkdir()
    assert report.main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert "RUN_FOLDER" in err and str(folder) in err and "hfscale sweep" in err


def test_cli_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--help"]) == 0
    assert "--memory-budget" in capsys.readouterr().out


def test_empty_run_still_reports(tmp_path: Path) -> None:
    paths = report.write_report(write_run(tmp_path / "r", []))
    assert "0 trials" in paths.markdown.read_text(encoding="utf-8")
    assert paths.figures == ()


# -- compare ---------------------------------------------------------------------------------------------------------


def test_compare_matches_trials_by_name(tmp_path: Path) -> None:
    rows_a = constructed_rows()
    rows_b = [dataclasses.replace(r) for r in constructed_rows() if r.trial != "adam8bit"]
    for r in rows_b:
        if r.throughput:
            r.throughput = throughput(r.throughput["samples_per_s"] * 1.5)
    rows_b.append(ok_row("sgd", Strategy(name="sgd", optimizer="sgd"), 11.0, 4.0))
    env_b = {**ENV, "packages": {**ENV["packages"], "torch": "2.7.0"}, "host": "node-9", "time": "2026-11-21"}
    run_a = write_run(tmp_path / "h100-torch26", rows_a, ENV)
    run_b = write_run(tmp_path / "h100-torch27", rows_b, env_b)

    out = tmp_path / "cmp"
    assert report.compare_main([str(run_a), str(run_b), "--out", str(out)]) == 0
    md = (out / "compare.md").read_text(encoding="utf-8")
    table = {r["trial"]: r for r in md_table(md, "Trials")}
    assert set(table) == {r.trial for r in rows_a} - {"adam8bit"}
    assert "Only in h100-torch26: adam8bit." in md
    assert "Only in h100-torch27: sgd." in md
    env = {r[""]: r for r in md_table(md, "Environments")}
    libraries = env["* libraries"]
    assert "torch 2.6.0" in libraries["h100-torch26"] and "torch 2.7.0" in libraries["h100-torch27"]
    assert env["* packages.torch"]["h100-torch27"] == "2.7.0"
    assert env["GPUs"]["h100-torch26"] == env["GPUs"]["h100-torch27"] == "2 x NVIDIA H100 80GB HBM3 (79.1 GiB)"
    assert "packages.transformers" not in env and "* packages.transformers" not in env  # same on both: header only

    lines_a = {line["trial"]: line for line in json_lines(run_a)}
    lines_b = {line["trial"]: line for line in json_lines(run_b)}
    with open(out / "compare.csv", encoding="utf-8", newline="") as fh:
        records = {r["trial"]: r for r in csv.DictReader(fh)}
    for name in ("baseline", "bf16", "zero3"):
        ratio = lines_b[name]["throughput"]["samples_per_s"] / lines_a[name]["throughput"]["samples_per_s"]
        assert math.isclose(float(records[name]["samples_per_s_ratio"]), ratio, rel_tol=1e-12)
        assert table[name]["samples/s B/A (x)"] == f"{ratio:.2f}"
    assert records["sgd"]["status_a"] == "" and records["sgd"]["status_b"] == "ok"
    assert table["big_batch"]["status h100-torch26"].startswith("oom: ")
    assert "2.7.0" in (out / "compare.html").read_text(encoding="utf-8")


def test_compare_names_the_bad_argument(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.compare_main([str(run), str(tmp_path / "nope")]) == 2
    assert "argument RUN_B" in capsys.readouterr().err


# -- a real sweep ----------------------------------------------------------------------------------------------------

TINY_RECIPE = """
name: tiny
device: cpu
model:
  type: bert
  task: classification
  config: {vocab_size: 1000, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 128,
           max_position_embeddings: 64, num_labels: 2}
data: {num_samples: 48, seq_len: 32, token_high: 1000}
training_args: {report_to: none, seed: 0}
measure: {warmup_steps: 1, num_epochs: 1, timeout_s: 300}
baseline: fp32
defaults: {per_device_batch_size: 8, num_processes: 1}
trials:
  - name: fp32
  - {name: ckpt, gradient_checkpointing: true}
"""


@pytest.mark.slow
def test_report_of_a_real_tiny_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two one-process CPU trials through ``hfscale sweep``, which writes the report at its end."""
    sweep = pytest.importorskip("hfscale.sweep")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE, encoding="utf-8")
    run = tmp_path / "run"
    outcome = sweep.run_sweep(recipe, run_dir=run, progress=lambda line: None)
    assert {p.name for p in outcome.report_paths} >= {"report.md", "report.html", "results.csv"}

    lines = json_lines(run)
    assert [line["status"] for line in lines] == ["ok", "ok"], [line["reason"] for line in lines]
    md = (run / "report.md").read_text(encoding="utf-8")
    table = md_table(md, "Trials")
    assert [r["trial"] for r in table] == ["fp32", "ckpt"]
    for cells, line in zip(table, lines, strict=True):
        assert cells["samples/s (steady)"] == f"{line['throughput']['samples_per_s']:.2f}"
        assert cells["samples/s (Trainer)"] == f"{line['train_samples_per_second']:.2f}"
        assert cells["peak memory (GiB)"] == f"{line['memory']['peak_gib']:.3f}"
        assert cells["final loss"] == f"{line['final_loss']:.4f}"
    ratio = lines[1]["throughput"]["samples_per_s"] / lines[0]["throughput"]["samples_per_s"]
    assert table[1]["speed-up vs baseline (x)"] == f"{ratio:.2f}"
    # CPU: no GPU memory in environment.json, so no budget, and the report says so.
    assert "No memory budget" in md
    environment = json.loads((run / ENVIRONMENT_FILE).read_text(encoding="utf-8"))
    assert f"torch {environment['packages']['torch']}" in md.split("## Trials", 1)[0]
    # The CPU phases were measured, so every trial has a breakdown (process RSS: weights hold the interpreter).
    memory_rows = {r["trial"]: r for r in md_table(md, "Memory")}
    for line in lines:
        load = line["memory"]["phases_gib"]["model_load"]
        assert memory_rows[line["trial"]]["weights (GiB)"] == f"{load:.3f}"
    assert {p.name for p in outcome.report_paths} >= {"report_pareto.png", "report_memory.png", "report_loss.png"}
