"""Trials on several machines, as two machines on this host: node ranks 0 and 1, rendezvous on 127.0.0.1, gloo.

Three real launches of 2 machines x 2 processes (DDP, ZeRO-3, FSDP2 ``hybrid_shard``) through
:func:`hfscale.launch.machines.launch_machines_here`, each checked from the verification record the trial read
from inside the run (world size, the node rank and host of each rank, FSDP2's mesh and shard groups, parameters
per rank); unit tests of :func:`hfscale.techniques.multi_machine.check` on records that a fallback would produce (a
flat mesh under
``hybrid_shard``, node ranks missing); and the launcher's handling of a machine that fails, with a stand-in
interpreter (no training).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import stat
import time
from pathlib import Path

import pytest
from helpers.teardown import TEARDOWN_ABORT, exited_or_aborted_at_teardown

from hfscale.launch.machines import MACHINE_DIR, MachineLaunch, PeerTiming, launch_machines_here, machines_failure
from hfscale.launch.plan import SweepSettings
from hfscale.measure.verify import check
from hfscale.recipes.schema import RecipeTrial, RunSpec
from hfscale.records.measurements import VerificationRecord
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy
from hfscale.techniques.multi_machine import check as check_machines
from hfscale.techniques.multi_machine import expected_fsdp_mesh, machine_rank_from_env
from hfscale.trial.train import import_training_stack
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

MACHINES, PROCESSES = 2, 4
STEPS = 4
# Four ranks on two shared cores; a first DeepSpeed use also builds its CPU ops (cached under TORCH_EXTENSIONS_DIR).
TIMEOUT_S = 600.0
TINY = dict(
    vocab_size=1000,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    num_labels=2,
)


def two_by_two(name: str, **fields) -> Strategy:
    return Strategy(
        name=name,
        device="cpu",
        per_device_batch_size=2,
        num_processes=PROCESSES,
        num_machines=MACHINES,
        optimizer="adamw_torch",
        **fields,
    )


def recipe_trial(strategy: Strategy) -> RecipeTrial:
    spec = TrialSpec(
        name=strategy.name,
        strategy=strategy,
        model=ModelSpec(type="bert", config=TINY),
        data=DataSpec(num_samples=64, seq_len=32, token_high=1000),
        measure=MeasureSpec(max_steps=STEPS, warmup_steps=1, timeout_s=TIMEOUT_S),
    )
    return RecipeTrial(spec=spec, run=RunSpec(env={"OMP_NUM_THREADS": "1"}))


def launch_2x2(tmp_path: Path, strategy: Strategy) -> tuple[list[MachineLaunch], VerificationRecord, float]:
    """Both machines' launches, machine 0's verification record, and the wall time of the whole launch (s)."""
    start = time.monotonic()
    machines = launch_machines_here(
        recipe_trial(strategy), tmp_path / "configs", tmp_path / "files", settings=SweepSettings()
    )
    wall_s = time.monotonic() - start
    stderr = {m.machine_rank: m.launched.stderr_text[-3000:] for m in machines if m.launched is not None}
    launched = [m.launched for m in machines if m.launched is not None]
    assert len(launched) == len(machines), stderr
    # Machine 0's result, checked below, is the evidence; a rank may abort at exit after it (helpers.teardown).
    assert all(exited_or_aborted_at_teardown(g.outcome.returncode, g.stderr_text) for g in launched), stderr
    measured = machines[0].launched.measured
    assert measured is not None, stderr
    # Only the main process (global rank 0, on machine 0) writes the result.
    assert machines[1].launched.measured is None
    assert measured.status == "ok", measured.mismatches
    assert check(strategy, measured.verification) == []
    assert len(measured.loss_curve) == STEPS
    return machines, measured.verification, wall_s


@pytest.fixture(scope="module")
def ddp_2x2(tmp_path_factory):
    return launch_2x2(tmp_path_factory.mktemp("ddp"), two_by_two("ddp"))


@pytest.fixture(scope="module")
def zero3_2x2(tmp_path_factory):
    return launch_2x2(tmp_path_factory.mktemp("zero3"), two_by_two("zero3", deepspeed=DeepSpeedSpec(zero_stage=3)))


@pytest.fixture(scope="module")
def hsdp_2x2(tmp_path_factory):
    return launch_2x2(
        tmp_path_factory.mktemp("hsdp"), two_by_two("hsdp", fsdp=FsdpSpec(version=2, sharding="hybrid_shard"))
    )


def assert_two_machines(rec: VerificationRecord) -> None:
    assert rec.world_size == PROCESSES
    assert rec.machine_rank_per_rank == [0, 0, 1, 1]
    assert rec.hostname_per_rank == [socket.gethostname()] * PROCESSES


# -- the three real launches ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_on_two_machines(ddp_2x2):
    machines, rec, wall_s = ddp_2x2
    assert_two_machines(rec)
    assert rec.distributed_type == "MULTI_CPU" and rec.wrapper == "DDP"
    assert rec.params_local_per_rank == [rec.params_total] * PROCESSES  # replicated on every rank
    assert rec.fsdp_mesh is None and rec.fsdp_shard_groups == []
    # Each machine ran its own launcher with its own machine rank, on one port.
    for m in machines:
        assert (m.files_dir.name, m.ended_after) == (MACHINE_DIR.format(rank=m.machine_rank), None)
    assert machines[0].launched.port == machines[1].launched.port
    if all(m.ok for m in machines):
        assert machines_failure(machines) is None
    else:  # a rank aborted at exit: the failure names a machine whose stderr says so
        rank, _ = machines_failure(machines)
        assert TEARDOWN_ABORT in machines[rank].launched.stderr_text
    print(f"DDP 2x2 launch: {wall_s:.1f} s wall")


@pytest.mark.slow
def test_zero3_on_two_machines(zero3_2x2):
    _, rec, wall_s = zero3_2x2
    assert_two_machines(rec)
    assert rec.wrapper == "DeepSpeedEngine" and rec.zero_stage == 3
    # ZeRO-3 partitions every parameter over all four ranks, across both machines.
    assert rec.params_local_max <= 1.25 * rec.params_total / PROCESSES
    print(f"ZeRO-3 2x2 launch: {wall_s:.1f} s wall")


@pytest.mark.slow
def test_hsdp_on_two_machines(hsdp_2x2):
    _, rec, wall_s = hsdp_2x2
    assert_two_machines(rec)
    assert rec.distributed_type == "FSDP" and rec.wrapper == "FSDP2" and rec.fsdp_sharding == "hybrid_shard"
    # Replicated across the two machines, sharded over the two processes of each.
    assert rec.fsdp_mesh == {"dp_replicate": 2, "dp_shard": 2}
    assert rec.fsdp_shard_groups == [[0, 1], [2, 3]]
    per_machine = PROCESSES // MACHINES
    assert rec.params_total / per_machine / 1.25 <= rec.params_local_max <= 1.25 * rec.params_total / per_machine
    print(f"HSDP 2x2 launch: {wall_s:.1f} s wall")


@pytest.mark.slow
def test_fp32_loss_curves_agree_between_ddp_and_hsdp(ddp_2x2, hsdp_2x2):
    """Same seed, data and global batch: DDP and HSDP on 2 x 2 train the same model, so their fp32 loss curves
    agree to float tolerance (a loss scaled by the world size, ranks that saw the wrong data, or a shard that
    never synchronised would show here)."""
    ddp, hsdp = (fixture[0][0].launched.measured.loss_curve for fixture in (ddp_2x2, hsdp_2x2))
    assert hsdp == pytest.approx(ddp, rel=2e-3)


# -- what a fallback would look like, caught by the check ----------------------------------------------------------

HSDP = two_by_two("hsdp", fsdp=FsdpSpec(version=2, sharding="hybrid_shard"))
TOTAL = 52_000


def hsdp_record(**changes) -> VerificationRecord:
    """What a correct 2 x 2 HSDP run records."""
    rec = VerificationRecord(
        distributed_type="FSDP",
        world_size=4,
        device="cpu",
        mixed_precision="no",
        wrapper="FSDP2",
        wrapper_class="FSDPBertForSequenceClassification",
        params_total=TOTAL,
        params_local_per_rank=[TOTAL // 2] * 4,
        fsdp_sharding="hybrid_shard",
        machine_rank_per_rank=[0, 0, 1, 1],
        hostname_per_rank=["host-a", "host-a", "host-b", "host-b"],
        fsdp_mesh={"dp_replicate": 2, "dp_shard": 2},
        fsdp_shard_groups=[[0, 1], [2, 3]],
    )
    return dataclasses.replace(rec, **changes)


def test_a_correct_hsdp_record_passes():
    assert check_machines(HSDP, hsdp_record()) == []
    # Fields an older record never read are not compared.
    assert check_machines(HSDP, hsdp_record(machine_rank_per_rank=[], fsdp_mesh=None, fsdp_shard_groups=[])) == []


def test_a_flat_mesh_under_hybrid_shard_is_reported():
    flat = hsdp_record(
        fsdp_mesh={"dp_shard": 4}, fsdp_shard_groups=[[0, 1, 2, 3]], params_local_per_rank=[TOTAL // 4] * 4
    )
    problems = check_machines(HSDP, flat)
    assert any("mesh of dp_shard 4, expected dp_replicate 2 x dp_shard 2" in p for p in problems), problems
    assert any("span machines [0, 1]" in p for p in problems), problems
    assert any("sharded further than hybrid_shard asks" in p for p in problems), problems
    # ... and through hfscale.measure.verify.check, which a trial runs.
    assert any("expected dp_replicate 2 x dp_shard 2" in p for p in check(HSDP, flat))


def test_missing_node_ranks_are_reported():
    one_machine = hsdp_record(machine_rank_per_rank=[0, 0, 0, 0], hostname_per_rank=["host-a"] * 4)
    problems = check_machines(HSDP, one_machine)
    assert any("machine rank(s) [1] took no part" in p for p in problems), problems
    ddp = two_by_two("ddp")
    assert any("took no part" in p for p in check_machines(ddp, one_machine))


def test_unequal_machines_and_split_hosts_are_reported():
    problems = check_machines(HSDP, hsdp_record(machine_rank_per_rank=[0, 1, 1, 1]))
    assert any("processes per machine are {0: 1, 1: 3}, expected 2" in p for p in problems), problems
    split = hsdp_record(hostname_per_rank=["host-a", "host-c", "host-b", "host-b"])
    assert check_machines(HSDP, split) == ["the ranks of machine 0 ran on several hosts ['host-a', 'host-c']"]


def test_expected_fsdp_mesh():
    assert expected_fsdp_mesh(HSDP) == {"dp_replicate": 2, "dp_shard": 2}
    assert expected_fsdp_mesh(two_by_two("fsdp", fsdp=FsdpSpec(version=2))) == {"dp_shard": 4}
    assert expected_fsdp_mesh(two_by_two("ddp")) is None


def test_collect_in_one_process(monkeypatch):
    import torch

    from hfscale.techniques import multi_machine

    for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert multi_machine.collect(torch.nn.Linear(2, 2), 1) == {
        "machine_rank_per_rank": [0],
        "hostname_per_rank": [socket.gethostname()],
        "fsdp_mesh": None,
        "fsdp_shard_groups": [],
    }


def test_machine_rank_from_env():
    assert machine_rank_from_env({"GROUP_RANK": "1", "NODE_RANK": "0"}) == 1
    assert machine_rank_from_env({"NODE_RANK": "2"}) == 2
    assert machine_rank_from_env({"SLURM_NODEID": "3", "RANK": "0"}) == 3
    assert machine_rank_from_env({"RANK": "5", "LOCAL_WORLD_SIZE": "2"}) == 2
    assert machine_rank_from_env({"RANK": "5"}) is None


# -- a machine that fails: the others are ended, not left waiting -------------------------------------------------


def fake_python(tmp_path: Path) -> str:
    """An interpreter stand-in: the launch of machine 1 fails at once, machine 0's would wait for it for 5 min."""
    path = tmp_path / "python"
    path.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in *.yaml) config="$a";; esac; done\n'
        'if grep -q "^machine_rank: 1" "$config"; then echo "machine 1 lost" >&2; exit 3; fi\n'
        "exec sleep 300\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_failed_machine_ends_the_others(tmp_path, monkeypatch):
    # Its own device locks: the clock must not count a trial of another of the suite's workers holding the CPU.
    monkeypatch.setenv("HFSCALE_LOCK_DIR", str(tmp_path / "locks"))
    import_training_stack()  # before the clock: a first import of transformers took 67 s on a loaded CI host
    start = time.monotonic()
    machines = launch_machines_here(
        recipe_trial(two_by_two("ddp")),
        tmp_path / "configs",
        tmp_path / "files",
        settings=SweepSettings(),
        python=fake_python(tmp_path),
        timing=PeerTiming(peer_grace_s=1.0),
    )
    assert time.monotonic() - start < 120  # machine 0's stand-in would have run for 300 s
    first, second = machines
    assert second.launched.outcome.returncode == 3 and second.ended_after is None
    assert "machine 1 lost" in second.launched.stderr_text
    assert not first.ok and first.ended_after == 1
    assert first.launched.outcome.returncode < 0  # ended by a signal
    assert not os.path.exists(first.files_dir / "pid")
    # One row's worth: the machine that failed first, and what became of the other.
    rank, failure = machines_failure(machines)
    assert rank == 1 and failure.status == "crashed"
    assert failure.reason == "machine 1: exit code 3 (see stderr.log); machine 0 was ended after it"


def test_a_machine_not_started_after_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSCALE_LOCK_DIR", str(tmp_path / "locks"))
    machines = launch_machines_here(
        recipe_trial(two_by_two("ddp")),
        tmp_path / "configs",
        tmp_path / "files",
        settings=SweepSettings(),
        python=fake_python(tmp_path),
        timing=PeerTiming(peer_grace_s=0.0, start_delay_s={0: 600.0}),  # ends as soon as machine 1 fails
    )
    assert machines[0].launched is None and not machines[0].ok
    assert machines[1].launched.outcome.returncode == 3
    assert machines_failure(machines)[1].reason.endswith("; machine 0 was not started")


def test_one_machine_is_refused(tmp_path):
    one = Strategy(name="one", device="cpu", per_device_batch_size=2)
    with pytest.raises(ValueError, match=r"strategy.num_machines=1; it runs 2 or more machines"):
        launch_machines_here(recipe_trial(one), tmp_path, tmp_path, settings=SweepSettings())


def _running(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker in cmdline and state not in ("Z", "X"):
                pids.append(int(entry.name))
    return pids


def test_a_killed_launcher_leaves_no_workers(tmp_path):
    """torchrun starts each worker in a session of its own: when a machine's launcher dies at once (SIGKILL, the
    OOM killer, the machine's agent lost), killing its process group does not reach them, and they trained on."""
    import signal
    import sys
    import threading

    from hfscale.launch.process import GroupLimits, clean_environment, free_port, run_process_group

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, pathlib, sys, time\n"
        "pathlib.Path(sys.argv[1], 'up-' + os.environ['LOCAL_RANK']).touch()\n"
        "time.sleep(120)\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(worker), str(tmp_path)]  # fmt: skip

    def kill_launcher_once_up() -> None:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("up-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_launcher_once_up, daemon=True)
    killer.start()
    outcome = run_process_group(
        cmd,
        env=clean_environment(extra={"OMP_NUM_THREADS": "1"}),
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
        pid_file=tmp_path / "pid",
        limits=GroupLimits(timeout_s=150),
    )
    killer.join()
    left = _running(str(worker))
    for pid in left:  # no leak into the rest of the suite, whatever the outcome
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert outcome.signal_name == "SIGKILL" and not outcome.timed_out
    assert left == [], f"workers {left} outlived their killed launcher"
