"""hfscale.report.compare: two runs' trials matched by name, with B/A ratios (``hfscale.compare_runs`` and
``hfscale compare``)."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import pytest
from helpers.report import ENV, constructed_rows, md_table, ok_row, throughput, write_run

import hfscale
from hfscale.commands import report as report_command
from hfscale.strategy import Strategy

pytest.importorskip("matplotlib", reason="reports need the report extra: pip install 'hfscale[report]'")


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    rows_b = [dataclasses.replace(r) for r in constructed_rows() if r.trial != "adam8bit"]
    for r in rows_b:
        if r.measured is not None:
            r.measured = dataclasses.replace(r.measured, throughput=throughput(r.samples_per_s * 1.5))
    rows_b.append(ok_row("sgd", Strategy(name="sgd", optimizer="sgd"), 11.0, 4.0))
    env_b = {**ENV, "packages": {**ENV["packages"], "torch": "2.7.0"}, "host": "node-9", "time": "2026-11-21"}
    return write_run(tmp_path / "h100-torch26", constructed_rows(), ENV), write_run(
        tmp_path / "h100-torch27", rows_b, env_b
    )


def test_compare_runs_puts_the_same_trials_side_by_side(runs: tuple[Path, Path]) -> None:
    a, b = runs
    both = hfscale.compare_runs(a, b)
    assert list(both.index) == [r.trial for r in constructed_rows()] + ["sgd"]
    assert math.isnan(both.loc["adam8bit", "samples_per_s_b"]) and both["status_a"].isna()["sgd"]
    assert both.loc["bf16", "samples_per_s_ratio"] == pytest.approx(1.5)
    assert both.loc["bf16", "peak_gib_ratio"] == pytest.approx(1.0)
    # The same from two tables already loaded.
    assert both.equals(hfscale.compare_runs(hfscale.load_run(a), hfscale.load_run(b)))


def test_compare_cli_writes_the_tables_of_both_runs(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = runs
    out = tmp_path / "cmp"
    assert report_command.compare_main([str(a), str(b), "--out", str(out)]) == 0
    md = (out / "compare.md").read_text(encoding="utf-8")
    table = {r["trial"]: r for r in md_table(md, "Trials")}
    assert set(table) == {r.trial for r in constructed_rows()} - {"adam8bit"}
    assert "Only in h100-torch26: adam8bit." in md and "Only in h100-torch27: sgd." in md
    env = {r[""]: r for r in md_table(md, "Environments")}
    assert "torch 2.6.0" in env["* libraries"]["h100-torch26"] and "torch 2.7.0" in env["* libraries"]["h100-torch27"]
    assert env["* packages.torch"]["h100-torch27"] == "2.7.0"
    assert env["GPUs"]["h100-torch26"] == env["GPUs"]["h100-torch27"] == "2 x NVIDIA H100 80GB HBM3 (79.1 GiB)"
    assert "packages.transformers" not in env and "* packages.transformers" not in env
    with open(out / "compare.csv", encoding="utf-8", newline="") as fh:
        records = {r["trial"]: r for r in csv.DictReader(fh)}
    for name in ("baseline", "bf16", "zero3"):
        assert float(records[name]["samples_per_s_ratio"]) == pytest.approx(1.5)
        assert table[name]["samples/s B/A (x)"] == "1.50"
    assert records["sgd"]["status_a"] == "" and records["sgd"]["status_b"] == "ok"
    assert table["big_batch"]["status h100-torch26"].startswith("oom: ")
    page = (out / "compare.html").read_text(encoding="utf-8")
    assert "2.7.0" in page and 'class="warn"' in page


def test_compare_names_the_bad_argument(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report_command.compare_main([str(runs[0]), str(tmp_path / "nope")]) == 2
    assert "argument RUN_B" in capsys.readouterr().err


def test_compare_refuses_runs_of_different_workloads_unless_asked(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23: the same trial name in two runs of different models (or scripts) names two different jobs."""
    a, b = runs
    (a / "recipe.yaml").write_text("model: {type: bert}\ntrials: [{name: baseline}]\n", encoding="utf-8")
    (b / "recipe.yaml").write_text("workload: {script: train.py, args: [--bf16]}\ntrials: [{name: baseline}]\n",
                                   encoding="utf-8")  # fmt: skip
    assert report_command.compare_main([str(a), str(b), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "trained different workloads" in err and "--allow-different-workloads" in err and "train.py" in err
    allowed = [str(a), str(b), "--out", str(tmp_path / "c"), "--allow-different-workloads"]
    assert report_command.compare_main(allowed) == 0
    assert "Compared although" in (tmp_path / "c" / "compare.md").read_text(encoding="utf-8")
    # The same workload written with other trials compares as before.
    (b / "recipe.yaml").write_text("model: {type: bert}\ntrials: [{name: sgd}]\n", encoding="utf-8")
    assert report_command.compare_main([str(a), str(b), "--out", str(tmp_path / "d")]) == 0
