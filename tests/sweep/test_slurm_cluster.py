"""``hfscale slurm``'s scripts under a real Slurm: ``sbatch``, ``srun`` across two nodes, ``scancel``, a resume job.

One cluster (:mod:`helpers.slurm`: munged, slurmctld and two ``slurmd -N`` on this machine) and one chain of two
jobs give the evidence of every test here:

1. the script ``hfscale slurm`` writes for a 3-trial recipe on 2 nodes is submitted with ``sbatch``; once the first
   trial's row is on disk the job is cancelled with ``scancel``;
2. the script ``hfscale slurm RUN --resume`` writes is submitted and finishes the sweep.

Node 2 (machine 1) runs under a smaller address space than node 1 (its ``slurmd`` started with ``RLIMIT_AS``, which
every task there inherits): the trial with the 4096-sample batch fits on machine 0 and not on machine 1, so it is
one failed row naming machine 1, while the other trials run on both.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers.slurm import SlurmCluster, start_cluster, unavailable

from hfscale.records.row import TrialResult, row_from_json
from hfscale.results.run_folder import RunFolder
from hfscale.sweep.slurm import SlurmJob

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

MACHINE_1_ADDRESS_SPACE = int(3.25 * (1 << 30))
"""Node 2's ``RLIMIT_AS``: above a tiny-BERT DDP worker's peak address space (about 2.3 GB measured on this kind of
machine), below the 4096-sample batch's (about 4.3 GB)."""
TRIALS = ("ddp", "ddp-b4096", "ddp-ckpt")
TINY = {"vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 64, "num_labels": 2}  # fmt: skip


def _recipe(path: Path) -> Path:
    recipe = {
        "name": "slurm-two-nodes",
        "device": "cpu",
        "model": {"type": "bert", "task": "classification", "config": TINY},
        "data": {"num_samples": 8192, "seq_len": 64, "token_high": 1000},
        "training_args": {"report_to": "none", "seed": 0},
        "measure": {"warmup_steps": 1, "max_steps": 4, "timeout_s": 240, "repeats": 1},
        "run": {"env": {"OMP_NUM_THREADS": "1"}},
        "baseline": "ddp",
        "defaults": {"per_device_batch_size": 4, "num_processes": 2, "num_machines": 2, "optimizer": "adamw_torch"},
        "trials": [
            {"name": "ddp"},
            {"name": "ddp-b4096", "per_device_batch_size": 4096},
            {"name": "ddp-ckpt", "gradient_checkpointing": True},
        ],
    }
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@dataclass
class Chain:
    """What the two jobs left: the run folder, each job's fields and output, and what was seen in between."""

    run_dir: Path
    first: dict[str, str]
    first_out: str
    second: dict[str, str]
    second_out: str
    rows_at_cancel: list[str]
    """``results.jsonl``'s lines when ``scancel`` was sent."""
    kept_mtimes: dict[str, int]
    """The first trial's log files (both machines) and their modification times at the cancel."""
    walls_s: tuple[float, float]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = unavailable()
    if why is not None:
        if os.environ.get("HFSCALE_REQUIRE_SLURM") == "1":
            pytest.fail(f"HFSCALE_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm-cluster")
    try:
        running = start_cluster(root, address_space={1: MACHINE_1_ADDRESS_SPACE})
    except RuntimeError as exc:
        if os.environ.get("HFSCALE_REQUIRE_SLURM") == "1":
            raise
        pytest.skip(f"Slurm did not start here: {exc}")
    yield running
    running.stop()


def _job_env() -> dict[str, str]:
    """The submitting shell's environment (sbatch exports it to the job), less any Slurm or rank variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    return env | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _submit(cluster: SlurmCluster, job: SlurmJob, folder: Path, name: str) -> int:
    script = folder / name
    script.write_text(job.sbatch_script(), encoding="utf-8")
    return cluster.sbatch(script, env=_job_env())


def _output(folder: Path, job_id: int) -> str:
    return "\n".join(p.read_text(errors="replace") for p in folder.glob(f"*-{job_id}.out"))


def _wait_for_rows(results: Path, count: int, cluster: SlurmCluster, job_id: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = results.read_text().splitlines() if results.exists() else []
        if len(lines) >= count:
            return lines
        if cluster.job(job_id).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.5)
    raise AssertionError(f"{count} row(s) not written; job {cluster.job(job_id).get('JobState')}")


@pytest.fixture(scope="module")
def chain(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Chain:
    folder = tmp_path_factory.mktemp("slurm-jobs")
    recipe = _recipe(folder / "two-nodes.yaml")
    run_dir = folder / "run"
    options = {"nodes": 2, "gpus_per_node": 0, "processes_per_node": 1, "cpus_per_task": 1, "python": sys.executable,
               "sweep_args": ("--machine-wait-s", "120")}  # fmt: skip
    start = time.monotonic()
    first_id = _submit(cluster, SlurmJob(recipe=str(recipe), run_dir=str(run_dir), **options), folder, "job.sbatch")
    rows = _wait_for_rows(run_dir / "results.jsonl", 1, cluster, first_id, timeout_s=300)
    kept = [run_dir / "trials/ddp/stderr.log", run_dir / "machines/machine-1/trials/ddp/stderr.log"]
    mtimes = {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in kept}
    cluster.run("scancel", str(first_id))
    first = cluster.wait(first_id, timeout_s=120)
    first_wall = time.monotonic() - start

    start = time.monotonic()
    resume = SlurmJob(recipe=str(run_dir), resume=True, **options)
    second_id = _submit(cluster, resume, folder, "resume.sbatch")
    second = cluster.wait(second_id, timeout_s=600)
    return Chain(
        run_dir=run_dir, first=first, first_out=_output(folder, first_id), second=second,
        second_out=_output(folder, second_id), rows_at_cancel=rows, kept_mtimes=mtimes,
        walls_s=(first_wall, time.monotonic() - start),
    )  # fmt: skip


def _rows(run_dir: Path) -> list[TrialResult]:
    return list(RunFolder(run_dir).rows())


def test_sbatch_runs_the_sweep_on_both_nodes_and_scancel_stops_it(chain: Chain) -> None:
    print(f"first job {chain.walls_s[0]:.1f} s (cancelled after 1 row); resume job {chain.walls_s[1]:.1f} s")
    assert chain.first["JobState"] == "CANCELLED", chain.first_out[-3000:]
    assert chain.first["NodeList"] and chain.first["NumNodes"] == "2"
    first_row = row_from_json(json.loads(chain.rows_at_cancel[0]))
    assert (first_row.trial, first_row.status) == ("ddp", "ok"), first_row.reason
    # Both drivers, started by srun on the two nodes, took their part: the ranks came from two machines.
    assert first_row.verification.machine_rank_per_rank == [0, 1]
    assert first_row.measured.world_size == 2
    # scancel's SIGTERM reached both drivers: each stopped its trial and named the job that resumes machine 0's folder.
    hint = f"continue with: hfscale slurm {chain.run_dir} --resume --nodes 2 --gpus-per-node 0 --processes-per-node 1"
    assert chain.first_out.count(hint) == 2, chain.first_out[-3000:]


def test_the_resume_job_finishes_with_nothing_lost_and_nothing_run_twice(chain: Chain) -> None:
    assert chain.second["JobState"] == "COMPLETED", chain.second_out[-3000:]
    results = (chain.run_dir / "results.jsonl").read_text().splitlines()
    # The cancelled job's row is kept byte for byte, and the first trial was not launched again on either machine.
    assert results[0] == chain.rows_at_cancel[0]
    for name, mtime in chain.kept_mtimes.items():
        assert (chain.run_dir / name).stat().st_mtime_ns == mtime, name
    assert "3 of 3 runs to do" in chain.first_out and "2 of 3 runs to do" in chain.second_out
    assert "ddp: launching" not in chain.second_out
    assert [r.trial for r in _rows(chain.run_dir)] == list(TRIALS)
    assert (chain.run_dir / "report.md").is_file()
    resumed = json.loads((chain.run_dir / "environment.json").read_text())["resumed"]
    assert len(resumed) == 1


def test_a_trial_that_does_not_fit_on_one_node_is_one_row_naming_it(chain: Chain) -> None:
    rows = {r.trial: r for r in _rows(chain.run_dir)}
    failed = rows["ddp-b4096"]
    # Machine 1's rank ran out of its address space; machine 0's rank lost its peer, the consequence.
    assert failed.status == "oom", (failed.status, failed.reason)
    assert failed.launch.failed_machine == 1 and failed.launch.failed_ranks == [1], failed.reason
    assert failed.reason.startswith("machine 1 (rank 1") and "then machine 0 (rank 0)" in failed.reason, failed.reason
    assert rows["ddp-ckpt"].status == "ok", rows["ddp-ckpt"].reason
    # Machine 1's logs of every trial are in machine 0's run folder (one filesystem), its failure among them.
    for name in TRIALS:
        assert (chain.run_dir / "machines/machine-1/trials" / name / "stderr.log").is_file(), name
    machine1 = (chain.run_dir / "machines/machine-1/trials/ddp-b4096/stderr.log").read_text(errors="replace")
    assert "memory" in machine1.lower(), machine1[-2000:]
