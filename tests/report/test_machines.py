"""A multi-machine run in the report: each machine's environment record (written and read), the "Machines" table,
the budget from the smallest GPU of any machine, and the per-rank memory of a 2 machines x 2 processes trial with
the machine of each rank. Synthetic rows: no launch."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers.report import ENV, H100, md_table, memory, ok_row, write_run

from hfscale import report
from hfscale.core.units import GIB
from hfscale.estimate import MemoryEstimate
from hfscale.measure.verify import VerificationRecord
from hfscale.records.measurements import MemorySummary, RankMemory
from hfscale.report.analysis import ReportError, summarize, summarize_run
from hfscale.report.ranks import rank_peaks
from hfscale.results.environment import (
    MachineEnvironment,
    read_machine_environments,
    write_machine_environment,
)
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy

A100_40 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total_gib": 39.4, "memory_total_bytes": 42_298_834_944}


def _machine(rank: int, host: str, gpus: list[dict], driver: str, torch: str = "2.6.0") -> dict:
    return {
        **ENV,
        "host": host,
        "gpus": [{"index": i, **g} for i, g in enumerate(gpus)],
        "gpu_count": len(gpus),
        "driver_version": driver,
        "packages": {**ENV["packages"], "torch": torch},
    }


# -- the record: written by every machine, read back typed --------------------------------------------------------


def test_write_and_read_machine_environments(tmp_path: Path) -> None:
    written = [
        write_machine_environment(tmp_path, 1, record=_machine(1, "node-b", [A100_40] * 2, "535.1")),
        write_machine_environment(tmp_path, 0, record=_machine(0, "node-a", [H100] * 2, "550.54.15")),
    ]
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        "machines/machine-1.json",
        "machines/machine-0.json",
    ]
    assert sorted(p.name for p in (tmp_path / "machines").iterdir()) == ["machine-0.json", "machine-1.json"]
    machines = read_machine_environments(tmp_path)
    assert [m.machine_rank for m in machines] == [0, 1]
    assert all(isinstance(m, MachineEnvironment) for m in machines)
    # the host name is this process's (the record passed in said node-a/node-b under "host")
    assert {m.hostname for m in machines} == {socket.gethostname()}
    assert machines[1].record["driver_version"] == "535.1"
    assert machines[1].gpu_memory_bytes == A100_40["memory_total_bytes"]


def test_write_collects_the_record_when_none_is_given(tmp_path: Path) -> None:
    path = write_machine_environment(tmp_path, 0)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["machine_rank"] == 0 and data["hostname"] == socket.gethostname()
    assert "packages" in data and data["gpu_count"] == 0  # this machine has no GPU


def test_a_rewrite_replaces_the_record_whole(tmp_path: Path) -> None:
    write_machine_environment(tmp_path, 1, record={"driver_version": "1"})
    write_machine_environment(tmp_path, 1, record={"driver_version": "2"})
    assert [m.record["driver_version"] for m in read_machine_environments(tmp_path)] == ["2"]
    assert [p.name for p in (tmp_path / "machines").iterdir()] == ["machine-1.json"]  # no temporary file left


def test_machine_zero_writes_a_record_another_machine_sent(tmp_path: Path) -> None:
    """Without a shared filesystem machine 1 cannot write into machine 0's run folder: machine 0 writes the record
    it was sent, under that machine's host name."""
    sent = _machine(1, "node-b", [A100_40], "535.1")
    write_machine_environment(tmp_path, 1, record=sent, hostname=sent["host"])
    (machine,) = read_machine_environments(tmp_path)
    assert (machine.machine_rank, machine.hostname) == (1, "node-b")


@pytest.mark.parametrize("rank", [-1, True, "1"])
def test_write_rejects_a_bad_machine_rank(tmp_path: Path, rank: object) -> None:
    with pytest.raises(ValueError, match="machine_rank: expected a non-negative integer"):
        write_machine_environment(tmp_path, rank, record={})  # type: ignore[arg-type]


def test_unreadable_machine_record_names_its_file(tmp_path: Path) -> None:
    write_run(tmp_path, [ok_row("ddp", Strategy(name="ddp"), 10.0, 2.0)], ENV)
    (tmp_path / "machines").mkdir()
    (tmp_path / "machines" / "machine-1.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"machine-1\.json: cannot be read"):
        read_machine_environments(tmp_path)
    with pytest.raises(ReportError, match=r"machine-1\.json"):
        summarize_run(tmp_path)
    (tmp_path / "machines" / "machine-1.json").write_text(json.dumps({"hostname": "x"}), encoding="utf-8")
    with pytest.raises(ValueError, match="machine_rank: expected a non-negative integer, got None"):
        read_machine_environments(tmp_path)


def test_no_machines_folder_reads_as_none(tmp_path: Path) -> None:
    assert read_machine_environments(tmp_path) == []


# -- the report: a Machines table, and the budget every machine holds -------------------------------------------


def _two_machine_folder(tmp_path: Path, rows: list) -> Path:
    folder = write_run(tmp_path / "run", rows, ENV)
    write_machine_environment(folder, 0, record=_machine(0, "node-a", [H100] * 2, "550.54.15"))
    write_machine_environment(folder, 1, record=_machine(1, "node-b", [A100_40] * 2, "535.1", torch="2.5.1"))
    return folder


def test_report_lists_every_machine(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = _two_machine_folder(
        tmp_path, [ok_row("ddp", Strategy(name="ddp", num_processes=4, num_machines=2), 10.0, 2.0)]
    )
    text = report.write_report(folder).markdown.read_text(encoding="utf-8")
    table = md_table(text, "Machines")
    assert [r["machine"] for r in table] == ["0", "1"]
    assert table[0]["GPUs"] == "2 x NVIDIA H100 80GB HBM3 (79.1 GiB)"
    assert table[1]["GPUs"] == "2 x NVIDIA A100-SXM4-40GB (39.4 GiB)"
    assert table[1]["driver / CUDA"].startswith("driver 535.1")
    assert table[0]["libraries (vs machine 0)"] == "—"
    assert table[1]["libraries (vs machine 0)"] == "torch 2.5.1"
    # the budget: machine 1's 39.4 GiB GPU, not machine 0's 79.1 GiB that environment.json records
    summary = summarize_run(folder)
    assert summary.recommendation.budget_bytes == A100_40["memory_total_bytes"]


def test_one_machine_record_adds_no_machines_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = write_run(tmp_path / "run", [ok_row("bf16", Strategy(name="bf16"), 10.0, 2.0)], ENV)
    write_machine_environment(folder, 0, record=_machine(0, "node-a", [H100], "550.54.15"))
    text = report.write_report(folder).markdown.read_text(encoding="utf-8")
    assert "## Machines" not in text and "## Memory per rank" not in text
    assert summarize_run(folder).recommendation.budget_bytes == int(79.1 * GIB)


# -- a 2 machines x 2 processes trial: per-rank lists of length 4 ------------------------------------------------


def _ranks(peaks: list[float]) -> MemorySummary:
    base = memory(max(peaks), load=0.2, fwd=0.5, bwd=0.7, opt=0.9, world_size=len(peaks))
    rows = [
        RankMemory(
            rank=r,
            device="cuda",
            peak_gib=p,
            peak_reserved_gib=p * 1.05,
            phases_gib=base.phases_gib,
            phase_peaks_gib=base.phase_peaks_gib,
            alloc_retries=0,
            ooms=0,
            nvml_process_used_gib=None,
            nvml_device_used_gib=None,
        )
        for r, p in enumerate(peaks)
    ]
    return MemorySummary.from_ranks(rows)


def _verification(strategy: Strategy, params: list[int]) -> VerificationRecord:
    return VerificationRecord(
        distributed_type="FSDP",
        world_size=4,
        device="cuda",
        mixed_precision="bf16",
        wrapper="FSDP2",
        wrapper_class="FSDPBertForSequenceClassification",
        params_total=1000,
        params_local_per_rank=params,
        machine_rank_per_rank=[0, 0, 1, 1],
        hostname_per_rank=["node-a", "node-a", "node-b", "node-b"],
    )


def _estimate(total: float) -> MemoryEstimate:
    return MemoryEstimate(
        weights_gib=0.5, gradients_gib=0.5, optimizer_gib=1.0, activations_gib=0.5, overhead_gib=0.3, total_gib=total
    )


def _two_by_two_rows() -> list:
    hsdp = Strategy(
        name="hsdp", precision="bf16", num_processes=4, num_machines=2, fsdp=FsdpSpec(sharding="hybrid_shard")
    )
    zero3 = Strategy(
        name="zero3", precision="bf16", num_processes=4, num_machines=2, deepspeed=DeepSpeedSpec(zero_stage=3)
    )
    return [
        # HSDP: each rank holds half of the 1000 elements (one machine's share); rank 3 has the largest peak
        ok_row(
            "hsdp",
            hsdp,
            12.0,
            3.2,
            memory=_ranks([3.0, 3.1, 2.9, 3.2]),
            verification=_verification(hsdp, [500, 500, 500, 500]),
            estimate=_estimate(2.4),
        ),
        # ZeRO-3 over all 4 ranks: a quarter each; rank 0 (machine 0) has the largest peak
        ok_row(
            "zero3",
            zero3,
            10.0,
            2.5,
            memory=_ranks([2.5, 2.0, 2.1, 2.2]),
            verification=_verification(zero3, [250, 250, 250, 250]),
            estimate=_estimate(2.75),
        ),
    ]


def test_rank_peaks_pair_each_rank_with_its_machine() -> None:
    row = _two_by_two_rows()[0]
    ranks = rank_peaks(row)
    assert [(r.rank, r.machine_rank, r.hostname, r.peak_gib, r.params_local) for r in ranks] == [
        (0, 0, "node-a", 3.0, 500),
        (1, 0, "node-a", 3.1, 500),
        (2, 1, "node-b", 2.9, 500),
        (3, 1, "node-b", 3.2, 500),
    ]


def test_estimate_check_holds_for_a_two_by_two_run() -> None:
    """The trials table compares the per-device estimate with the largest rank's peak: hsdp (2.4 - 3.2) / 3.2 =
    -25.0 %, zero3 (2.75 - 2.5) / 2.5 = +10.0 %; the per-rank records say which rank on which machine that was."""
    summary = summarize(_two_by_two_rows(), environment=ENV)
    assert summary.row("hsdp").peak_gib == pytest.approx(3.2)
    assert summary.row("hsdp").estimate_error_pct == pytest.approx(-25.0)
    assert summary.row("zero3").estimate_error_pct == pytest.approx(10.0)
    records = {r["trial"]: r for r in summary.rank_memory}
    assert records["hsdp"]["largest"] == "rank 3 (machine 1, node-b)"
    assert records["hsdp"]["estimate_error_pct"] == pytest.approx(-25.0)
    assert (
        records["hsdp"]["per_machine"]
        == "machine 0 (node-a): r0 3.000, r1 3.100; machine 1 (node-b): r2 2.900, r3 3.200"
    )
    assert records["zero3"]["largest"] == "rank 0 (machine 0, node-a)"
    assert records["zero3"]["machines"] == 2 and records["zero3"]["ranks"] == 4


def test_report_renders_memory_per_rank_with_machines(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = _two_machine_folder(tmp_path, _two_by_two_rows())
    paths = report.write_report(folder)
    text = paths.markdown.read_text(encoding="utf-8")
    table = {r["trial"]: r for r in md_table(text, "Memory per rank")}
    assert table["hsdp"]["largest peak on"] == "rank 3 (machine 1, node-b)"
    assert table["hsdp"]["parameters held per rank"] == "500, 500, 500, 500"
    assert table["hsdp"]["estimate vs largest (%)"] == "-25.0"
    assert "machine 1 (node-b): r2 2.900, r3 3.200" in table["hsdp"]["peak per rank (GiB), by machine"]
    assert "Memory per rank" in paths.html.read_text(encoding="utf-8")


def test_one_machine_rows_have_no_per_rank_table() -> None:
    row = ok_row("ddp", Strategy(name="ddp", num_processes=2), 10.0, 2.0)
    assert summarize([row], environment=ENV).rank_memory == ()
