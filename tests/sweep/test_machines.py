"""A sweep across machines (hfscale.sweep.machines) and its cluster launcher (hfscale.sweep.slurm).

Two "machines" on one host (two drivers, machine ranks 0 and 1, main address 127.0.0.1, gloo on CPU) stand in for
two nodes: the drivers' channel, the trials' rendezvous, the ranks and the run folder are the same code. Three real
sweeps: the sbatch script itself run with stand-ins for ``srun``/``scontrol`` (2 trials), a ``--resume`` of it by
the per-node commands (1 trial), and a second machine killed mid-trial.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.runs import write_recipe

from hfscale.launch.group import LaunchInfo
from hfscale.launch.plan import SweepError, SweepSettings
from hfscale.records.row import LaunchRecord, TrialResult
from hfscale.results.run_folder import RunFolder
from hfscale.strategy import Strategy
from hfscale.sweep.channel import SILENT_AFTER_S, Coordinator, Follower
from hfscale.sweep.machines import machine_ranks, merge_machine_reports
from hfscale.sweep.messages import MachineReport, StartDecision, SweepPlan
from hfscale.sweep.slurm import PORT_BASE, PORT_BLOCK, PORT_JOBS, SlurmJob
from hfscale.trial.train import import_training_stack

TINY = {
    "vocab_size": 1000,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "num_labels": 2,
}


def _recipe(path: Path, *, first_steps: int = 4) -> Path:
    """Two DDP trials, 2 machines x 1 process each."""
    recipe = {
        "name": "two-machines",
        "device": "cpu",
        "model": {"type": "bert", "task": "classification", "config": TINY},
        "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
        "training_args": {"report_to": "none", "seed": 0},
        "measure": {"warmup_steps": 1, "max_steps": 4, "timeout_s": 240, "repeats": 1},
        "run": {"env": {"OMP_NUM_THREADS": "1"}},
        "baseline": "ddp",
        "defaults": {"per_device_batch_size": 4, "num_processes": 2, "num_machines": 2, "optimizer": "adamw_torch"},
        "trials": [
            {"name": "ddp", "measure": {"max_steps": first_steps}},
            {"name": "ddp-ckpt", "gradient_checkpointing": True},
        ],
    }
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def _free_port_block(lo: int | None = None, hi: int | None = None, width: int = 4) -> int:
    """A port p in [lo, hi) with p .. p + width - 1 free (the drivers' port and the trials'); by default the start
    of one of the Slurm jobs' blocks."""
    import random

    for _ in range(200):
        if lo is None or hi is None:
            port = PORT_BASE + random.randrange(PORT_JOBS) * PORT_BLOCK
        else:
            port = random.randrange(lo, hi - width)
        try:
            for p in range(port, port + width):
                with socket.socket() as s:
                    s.bind(("", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port block")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    return env


def _rows(run_dir: Path) -> dict[str, TrialResult]:
    return {row.trial: row for row in RunFolder(run_dir).rows()}


# -- merging what the machines report (no launch) ---------------------------------------------------------------


def _row(
    status: str = "crashed", reason: str | None = "exit code 1: RuntimeError: Connection closed by peer"
) -> TrialResult:
    strategy = Strategy(name="ddp", device="cpu", num_processes=4, num_machines=2)
    return TrialResult(
        trial="ddp", strategy=strategy, status=status, reason=reason, launch=LaunchRecord(trial_dir="trials/ddp")
    )  # type: ignore[arg-type]


def _report(machine: int = 1, status: str = "ok", **kw: object) -> MachineReport:
    ranks = machine_ranks(machine, 4, 2)
    return MachineReport(machine=machine, status=status, ranks=ranks, host="node1", **kw)  # type: ignore[arg-type]


def test_a_silent_machine_is_the_first_failure_and_named_with_its_ranks() -> None:
    merged = merge_machine_reports(_row(), {}, {1: "its driver stopped (last heard 12 s ago)"})
    assert merged.status == "crashed"
    assert merged.reason.startswith("machine 1 (ranks 2-3): its driver stopped (last heard 12 s ago); then machine 0")
    assert (merged.launch.failed_machine, merged.launch.failed_ranks) == (1, [2, 3])


def test_a_rank_own_error_is_the_cause_and_a_lost_peer_its_consequence() -> None:
    report = _report(status="crashed", reason="exit code 1: ValueError: bad batch", failed_rank=3)
    merged = merge_machine_reports(_row(), {1: report}, {}, dirs=["machines/machine-1/trials/ddp"])
    assert merged.reason.startswith("machine 1 (rank 3, node1): crashed: exit code 1: ValueError: bad batch; then")
    assert (merged.launch.failed_machine, merged.launch.failed_ranks) == (1, [3])
    assert merged.launch.machine_dirs == ["machines/machine-1/trials/ddp"]
    # Machine 0's own OOM comes before another machine's lost peer.
    oom = _row("oom", "CPU out of memory on rank 1: RuntimeError: ...")
    lost = _report(status="crashed", reason="exit code 1: Connection reset by peer")
    merged = merge_machine_reports(oom, {1: lost}, {})
    assert merged.status == "oom" and merged.launch.failed_machine == 0 and merged.launch.failed_ranks == [1]


def test_a_measured_row_stays_ok_and_notes_another_machine_failing_to_exit() -> None:
    merged = merge_machine_reports(_row("ok", None), {1: _report(status="crashed", reason="exit code 1")}, {})
    assert merged.status == "ok" and merged.launch.failed_machine is None
    assert "machine 1 (ranks 2-3, node1): crashed: exit code 1" in merged.launch.after_result
    assert merge_machine_reports(_row("ok", None), {1: _report()}, {}).launch.after_result is None


# -- the drivers' channel ---------------------------------------------------------------------------------------


def test_coordinator_waits_a_bounded_time_and_names_who_never_came() -> None:
    port = _free_port_block(40000, 50000, 1)
    coordinator = Coordinator(port)
    try:
        follower = Follower("127.0.0.1", port, 1)
        assert follower.get("plan") is None
        coordinator.publish("plan", {"runs": []})
        assert follower.wait_for("plan", timeout_s=5) == {"runs": []}
        assert follower.put("ready/0/1", True)
        start = time.monotonic()
        missing = coordinator.wait_for({1: "ready/0/1", 2: "ready/0/2"}, timeout_s=1.0)
        assert time.monotonic() - start < 5
        assert {m: a.why for m, a in missing.items()} == {
            2: "its driver never contacted machine 0 (waited 1 s, --machine-wait-s)"
        }
        # A machine that spoke and went silent is not waited for.
        coordinator.store.last_seen[1] -= SILENT_AFTER_S + 1
        start = time.monotonic()
        missing = coordinator.wait_for({1: "report/0/1"}, timeout_s=60)
        assert time.monotonic() - start < 5 and missing[1].why.startswith("its driver stopped (last heard")
    finally:
        coordinator.close()


def test_another_machine_without_machine_0_stops_after_machine_wait_s(tmp_path: Path) -> None:
    from hfscale.sweep.loop import run_sweep

    port = _free_port_block(40000, 50000, 1)
    launch = LaunchInfo(machine_rank=1, num_machines=2, master_addr="127.0.0.1", master_port=port)
    with pytest.raises(SweepError, match=r"machine 1: nothing from machine 0's driver .* within 1 s: start machine 0"):
        run_sweep(None, out_dir=tmp_path, settings=SweepSettings(machine_wait_s=1), launch=launch, report=False)
    assert not any(tmp_path.iterdir())


def test_a_machine_that_never_comes_is_a_timeout_row_naming_it(tmp_path: Path) -> None:
    """Machine 0 alone: it waits --machine-wait-s before each trial, then records it as not launched."""
    from hfscale.sweep.loop import run_sweep

    port = _free_port_block(40000, 50000, 1)
    launch = LaunchInfo(machine_rank=0, num_machines=2, master_addr="127.0.0.1", master_port=port)
    import_training_stack()  # before the clock: a first import of transformers took 67 s on a loaded CI host
    start = time.monotonic()
    outcome = run_sweep(
        _recipe(tmp_path / "two.yaml"),
        run_dir=tmp_path / "run",
        settings=SweepSettings(num_machines=2, machine_wait_s=1),
        launch=launch,
        report=False,
    )
    assert time.monotonic() - start < 60
    assert [(r.trial, r.status) for r in outcome.rows] == [("ddp", "timeout"), ("ddp-ckpt", "timeout")]
    for row in outcome.rows:
        assert (
            row.reason == "not launched: machine 1: its driver never contacted machine 0 (waited 1 s, --machine-wait-s)"
        )
        assert (row.launch.failed_machine, row.launch.failed_ranks) == (1, [1])
    assert RunFolder(tmp_path / "run").sweep_id_path.is_file()
    assert (tmp_path / "run/machines/machine-0.json").is_file()


def test_another_machine_keeps_its_logs_in_machine_0s_folder_only_where_it_sees_it(tmp_path: Path) -> None:
    from hfscale.sweep.follow import _own_folder

    run = RunFolder(tmp_path / "run")
    plan = SweepPlan(sweep_id="abc", host="elsewhere", run_dir=str(run.path), recipe="two", settings=SweepSettings(),
                     runs=())  # fmt: skip
    # Not visible here (another machine's disk): a run folder of its own, next to the one it was given.
    assert _own_folder(plan, 1, out_dir="runs", run_dir=tmp_path / "x", resume=None) == (
        Path(f"{tmp_path}/x-machine1"),
        False,
    )
    assert _own_folder(plan, 1, out_dir=tmp_path, run_dir=None, resume=None) == (tmp_path / "two-machine1-abc", False)
    run.sweep_id_path.parent.mkdir(parents=True)
    run.sweep_id_path.write_text("an earlier sweep's id\n")
    assert _own_folder(plan, 1, out_dir="runs", run_dir=None, resume=None)[1] is False
    run.sweep_id_path.write_text("abc\n")
    assert _own_folder(plan, 1, out_dir="runs", run_dir=None, resume=None) == (run.path / "machines/machine-1", True)


def test_machine_flags_are_checked_together() -> None:
    from hfscale.commands.sweep import build_parser, machine_launch, settings_from_args

    def place(*argv: str) -> LaunchInfo:
        args = build_parser().parse_args(["r.yaml", *argv])
        return machine_launch(args, settings_from_args(args), LaunchInfo())

    got = place("--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.1")
    assert (got.machine_rank, got.num_machines, got.master_addr, got.master_port) == (1, 2, "10.0.0.1", 29500)
    with pytest.raises(ValueError, match="need --num-machines N, --machine-rank K and --main-process-ip HOST"):
        place("--machine-rank", "1", "--main-process-ip", "10.0.0.1")
    with pytest.raises(ValueError, match="--machine-rank 2 is out of range for --num-machines 2"):
        place("--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "h")
    args = build_parser().parse_args(["r.yaml", "--num-machines", "2", "--machine-rank", "0", "--main-process-ip", "h"])
    with pytest.raises(ValueError, match="started by accelerate launch/torchrun"):
        machine_launch(args, settings_from_args(args), LaunchInfo(launched=True, world_size=2, local_world_size=1))


# -- hfscale slurm: the script ------------------------------------------------------------------------------------


def test_sbatch_script_asks_for_the_nodes_and_starts_one_driver_per_node() -> None:
    job = SlurmJob(
        recipe="recipes/zero.yaml", nodes=4, gpus_per_node=8, time="02:00:00", partition="gpu",
        setup=("module load x",), sweep_args=("--timeout-s", "900"),
    )  # fmt: skip
    script = job.sbatch_script()
    for header in ("--job-name=hfscale-zero", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
                   "--time=02:00:00", "--partition=gpu"):  # fmt: skip
        assert f"#SBATCH {header}\n" in script
    assert "#SBATCH --account" not in script
    assert "#SBATCH --cpus-per-task=64\n" in script  # 8 per GPU
    assert "\nset -eo pipefail\n" in script and "set -u" not in script and "pipefail" not in script.split("-eo")[0]
    assert script.index("module load x") < script.index("srun")
    assert 'HFSCALE_MAIN_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"' in script
    assert "HFSCALE_MAIN_PORT=$(( 10000 + (SLURM_JOB_ID % 110) * 200 ))" in script
    assert "export HFSCALE_PORT_BLOCK=200\n" in script
    assert "export HFSCALE_SWEEP_TOKEN=\"$(od -An -tx1 -N16 /dev/urandom | tr -d ' \\n')\"\n" in script
    assert script.index("HFSCALE_SWEEP_TOKEN") < script.index("srun ")
    assert 'HFSCALE_RUN_DIR="${HFSCALE_RUN_DIR:-runs/zero-$SLURM_JOB_ID}"' in script
    srun = script[script.index("srun ") :].replace("\\\n", " ")
    assert " ".join(srun.split()) == (
        'srun --nodes=4 --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=0 --wait=0 '
        'bash -c \'exec "$@" --machine-rank "$SLURM_NODEID"\' hfscale-driver '
        'python -m hfscale.sweep recipes/zero.yaml --run-dir "$HFSCALE_RUN_DIR" --num-machines 4 --num-processes 32 '
        '--timeout-s 900 --main-process-ip "$HFSCALE_MAIN_ADDR" --main-process-port "$HFSCALE_MAIN_PORT"'
    )
    nodes = job.node_commands(main_addr="10.0.0.1", port=29500)
    assert [c[c.index("--machine-rank") + 1] for c in nodes] == ["0", "1", "2", "3"]
    assert nodes[3][-4:] == ["--main-process-ip", "10.0.0.1", "--main-process-port", "29500"]


def test_slurm_job_errors_name_the_option() -> None:
    with pytest.raises(ValueError, match="--gpus-per-node 0 \\(a CPU sweep\\) needs --processes-per-node N"):
        SlurmJob(recipe="r.yaml", nodes=2, gpus_per_node=0)
    with pytest.raises(ValueError, match="--nodes must be at least 1, got 0"):
        SlurmJob(recipe="r.yaml", nodes=0, gpus_per_node=8)
    with pytest.raises(ValueError, match="--cpus-per-task must be at least 1, got 0"):
        SlurmJob(recipe="r.yaml", nodes=2, gpus_per_node=8, cpus_per_task=0)
    assert SlurmJob(recipe="r.yaml", nodes=2, gpus_per_node=0, processes_per_node=2).cpus == 4
    assert (
        "#SBATCH --cpus-per-task=6\n"
        in SlurmJob(recipe="r.yaml", nodes=2, gpus_per_node=1, cpus_per_task=6).sbatch_script()
    )
    resumed = SlurmJob(recipe="runs/r-1", nodes=2, gpus_per_node=8, resume=True).sbatch_script()
    assert "export HFSCALE_RUN_DIR=runs/r-1\n" in resumed and "--resume runs/r-1 --num-machines 2" in resumed


def test_hfscale_slurm_command_writes_the_script_and_prints_each_node(tmp_path: Path, capsys, monkeypatch) -> None:
    from hfscale.commands.main import main

    out = tmp_path / "job.sbatch"
    monkeypatch.chdir(tmp_path)
    recipe = {"name": "r", "device": "cuda", "measure": {"max_steps": 10, "warmup_steps": 2}}
    write_recipe(tmp_path, {**recipe, "trials": [{"name": "a"}, {"name": "b"}]}, "r.yaml")
    assert (
        main(["slurm", "r.yaml", "--nodes", "2", "--gpus-per-node", "8", "--out", str(out), "--", "--only", "a"]) == 0
    )
    assert out.read_text().startswith("#!/bin/bash\n")
    printed = capsys.readouterr().out
    assert f"sbatch {out}" in printed
    assert "node 1: python -m hfscale.sweep r.yaml --run-dir runs/r --num-machines 2 --num-processes 16 --only a " \
        "--machine-rank 1 --main-process-ip MAIN_HOST --main-process-port 29500" in printed  # fmt: skip


def test_hfscale_slurm_refuses_what_every_driver_would_refuse_before_the_job_queues(tmp_path: Path, capsys) -> None:
    """Each of these wrote a script and exited 0; every node's driver then refused to start, after the queue."""
    from hfscale.commands.slurm import main as slurm

    cases = [
        (["nope", "--nodes", "2", "--gpus-per-node", "1"], "nope: no such recipe file"),
        (["cpu_small", "--nodes", "2", "--gpus-per-node", "0", "--processes-per-node", "1", "--", "--bogus-flag"],
         "the options after -- are not hfscale sweep's: --bogus-flag"),
        (["cpu_small", "--nodes", "2", "--gpus-per-node", "0", "--processes-per-node", "1", "--", "--timeout-s", "-5"],
         "the options after --: --timeout-s must be more than 0, got -5"),
        (["cpu_small", "--nodes", "2", "--gpus-per-node", "0", "--processes-per-node", "1"],
         "strategy.num_processes=1 is not a multiple of strategy.num_machines=2"),
        (["--resume", str(tmp_path / "no-run"), "--nodes", "2", "--gpus-per-node", "1"],
         f"--resume {tmp_path / 'no-run'}: no recipe.yaml there; is it a run folder?"),
        # The drivers' own refusals of --script and what follows a second --.
        (["cpu_techniques", "--nodes", "1", "--gpus-per-node", "0", "--processes-per-node", "2", "--", "--only",
          "sdpa", "--", "--lr", "1"], "the options after --: arguments after -- are the --script's: give --script"),
        (["--resume", str(tmp_path), "--nodes", "2", "--gpus-per-node", "1", "--", "--script", "train.py"],
         "the options after --: --script needs a RECIPE"),
        # What the sweep's start refuses beyond the recipe (its own search checks): a batch axis under its limit.
        (["cpu_techniques", "--nodes", "1", "--gpus-per-node", "0", "--processes-per-node", "2", "--",
          "--max-batch-limit", "1"], "the largest-batch search's limit 1"),
    ]  # fmt: skip
    for argv, says in cases:
        assert slurm(["--out", str(tmp_path / "job.sbatch"), *argv]) == 2, argv
        assert says in capsys.readouterr().err, argv
        assert not (tmp_path / "job.sbatch").exists()
    # A recipe run with the user's script (--script) is checked as the driver runs it: without hfscale's data, whose
    # 512 samples at 16 a device on 16 processes (2 steps an epoch) would leave no step after a warm-up of 10.
    from helpers.paths import SCRIPTS

    measure = {"num_epochs": 1, "warmup_steps": 10}
    data = {"name": "r", "device": "cuda", "defaults": {"per_device_batch_size": 16}, "measure": measure}
    recipe = write_recipe(tmp_path, {**data, "trials": [{"name": "a"}]})
    argv = ["--out", str(tmp_path / "job.sbatch"), str(recipe), "--nodes", "2", "--gpus-per-node", "8"]
    assert slurm(argv) == 2 and "a warm-up of 10 leaves fewer than the two" in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()
    assert slurm([*argv, "--", "--script", str(SCRIPTS / "hf_example.py"), "--", "--num_samples", "64"]) == 0


def test_every_resume_hint_names_the_command_that_works_for_its_run() -> None:
    import shlex

    from hfscale.sweep.slurm import resume_command

    assert resume_command("runs/r") == "hfscale sweep --resume runs/r"
    slurm = resume_command(
        "/shared/r", num_machines=2, num_processes=16, gpus_per_node=8, environ={"SLURM_JOB_ID": "7"}
    )
    assert slurm.startswith("hfscale slurm /shared/r --resume --nodes 2 --gpus-per-node 8 --out r-resume.sbatch ")
    assert slurm.endswith(", then sbatch r-resume.sbatch")
    # Slurm's own count of GPUs wins; a sweep of fewer processes than GPUs says how many per node.
    gres = {"SLURM_JOB_ID": "7", "SLURM_GPUS_PER_NODE": "h100:4"}
    assert " --gpus-per-node 4 --processes-per-node 1 " in resume_command("/r", num_machines=2, num_processes=2,
                                                                          environ=gres)  # fmt: skip
    by_hand = resume_command(
        "/shared/r", num_machines=2, num_processes=2, main_addr="10.0.0.1", port=29600, python="python", environ={}
    )
    # Exactly the drivers `hfscale slurm /shared/r --resume` prints for a cluster without Slurm.
    job = SlurmJob(recipe="/shared/r", nodes=2, gpus_per_node=0, processes_per_node=1, resume=True)
    for k, command in enumerate(job.node_commands(main_addr="10.0.0.1", port=29600)):
        assert f"machine {k}: {shlex.join(command)}" in by_hand
        assert "--resume /shared/r --num-machines 2 --num-processes 2 --machine-rank" in shlex.join(command)


def test_another_machines_stop_message_points_at_machine_0s_folder_and_the_resume_that_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: after scancel, machine 1 said "continue with: hfscale sweep --resume RUN/machines/machine-1", a
    folder of logs only; what works resumes machine 0's folder with every machine's driver."""
    import dataclasses

    import hfscale.results.environment
    import hfscale.sweep.follow
    from hfscale.launch.plan import PlannedRun
    from hfscale.recipes.recipe import load_recipe
    from hfscale.sweep.follow import follow_sweep
    from hfscale.sweep.outcome import SweepInterrupted

    def scancel(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(hfscale.results.environment, "collect_environment", lambda **_: {"gpu_count": 0})
    monkeypatch.setattr(hfscale.sweep.follow, "launch_group", scancel)
    monkeypatch.delenv("SLURM_GPUS_PER_NODE", raising=False)
    trial = load_recipe(_recipe(tmp_path / "two.yaml")).trials[0]
    planned = PlannedRun(trial=trial, repeat=0, index=0)
    run0 = RunFolder(tmp_path / "run")
    run0.sweep_id_path.parent.mkdir(parents=True)
    run0.sweep_id_path.write_text("1" * 32 + "\n")  # a shared filesystem: machine 1 keeps its logs in machine 0's
    port = _free_port_block(40000, 50000, 1)
    coordinator = Coordinator(port)
    try:
        settings = SweepSettings(num_processes=2, num_machines=2)
        plan = dataclasses.replace(_typed_plan(tmp_path), settings=settings, runs=(planned,), sweep_id="1" * 32)
        coordinator.publish("plan", plan.to_json())
        coordinator.publish("start/0", StartDecision(action="launch").to_json())
        launch = LaunchInfo(machine_rank=1, num_machines=2, master_addr="127.0.0.1", master_port=port)
        monkeypatch.setenv("SLURM_JOB_ID", "7")
        with pytest.raises(SweepInterrupted) as caught:
            follow_sweep(launch, out_dir=tmp_path / "out")
        stop = caught.value
        assert (stop.run_dir, stop.rows_in) == (run0.machine_dir(1), run0.path)
        assert stop.resume.startswith(
            f"hfscale slurm {run0.path} --resume --nodes 2 --gpus-per-node 0 --processes-per-node 1 --out "
        )
        monkeypatch.delenv("SLURM_JOB_ID")
        with pytest.raises(SweepInterrupted) as caught:
            follow_sweep(launch, out_dir=tmp_path / "out")
        for k in (0, 1):
            assert (
                f"machine {k}: {sys.executable} -m hfscale.sweep --resume {run0.path} --num-machines 2 --num-processes "
                f"2 --machine-rank {k} --main-process-ip 127.0.0.1 --main-process-port {port}"
            ) in caught.value.resume
        assert "machines/machine-1" not in caught.value.resume
    finally:
        coordinator.close()


# -- real sweeps on two "machines" ------------------------------------------------------------------------------

_FAKE_SRUN = """#!/bin/bash
# Stand-in for srun on one host: the command once per node, SLURM_NODEID set, each node's output in a file.
nodes=1
while [[ "$1" == --* ]]; do case "$1" in --nodes=*) nodes="${1#--nodes=}";; esac; shift; done
pids=()
for ((k = 0; k < nodes; k++)); do
  SLURM_NODEID=$k SLURM_PROCID=$k "$@" > "$HFSCALE_TEST_LOGS/node$k.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def _fake_slurm_bin(folder: Path) -> Path:
    folder.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", "#!/bin/sh\necho 127.0.0.1\n")):
        path = folder / name
        path.write_text(text, encoding="utf-8")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


REAL_SLURM = os.environ.get("HFSCALE_REQUIRE_SLURM") == "1"
"""The sbatch script runs under a real Slurm in tests/sweep/test_slurm_cluster.py, required to (``.ci/run`` as
root): the stand-in run below and the resume of it add nothing there."""


@pytest.fixture(scope="module")
def sbatch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    """The sbatch script of a 2-trial recipe on 2 nodes x 1 process, run as Slurm would (srun and scontrol stood in
    for); returns the run folder, the nodes' log folder and the wall time."""
    if REAL_SLURM:
        pytest.skip("HFSCALE_REQUIRE_SLURM=1: the script runs under a real Slurm (test_slurm_cluster.py), resume too")
    root = tmp_path_factory.mktemp("slurm")
    recipe = _recipe(root / "two.yaml")
    job = SlurmJob(
        recipe=str(recipe), nodes=2, gpus_per_node=0, processes_per_node=1, run_dir=str(root / "run"),
        python=sys.executable, sweep_args=("--machine-wait-s", "180"),
    )  # fmt: skip
    script = root / "job.sbatch"
    script.write_text(job.sbatch_script(), encoding="utf-8")
    port = _free_port_block()
    env = _env() | {
        "PATH": f"{_fake_slurm_bin(root / 'bin')}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": str((port - PORT_BASE) // PORT_BLOCK + 7 * PORT_JOBS),
        "SLURM_JOB_NODELIST": "localhost",
        "HFSCALE_TEST_LOGS": str(root),
    }
    start = time.monotonic()
    done = subprocess.run(["bash", str(script)], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    logs = "\n".join(f"--- node{k}\n" + (root / f"node{k}.log").read_text()[-3000:] for k in (0, 1))
    assert done.returncode == 0, done.stderr[-2000:] + logs
    return root / "run", root, wall


@pytest.mark.slow
def test_sbatch_script_runs_a_sweep_on_two_machines(sbatch_run: tuple[Path, Path, float]) -> None:
    run_dir, root, wall = sbatch_run
    print(f"sbatch script, 2 trials on 2 machines x 1 process: {wall:.1f} s wall")
    rows = _rows(run_dir)
    assert [(r.trial, r.status) for r in rows.values()] == [("ddp", "ok"), ("ddp-ckpt", "ok")], rows
    for name, row in rows.items():
        assert row.measured.world_size == 2
        assert row.verification.machine_rank_per_rank == [0, 1]
        assert row.launch.machine_dirs == [f"machines/machine-1/trials/{name}"]
        # The same port for the trial on both machines: the drivers' port + 1 + the run's index.
        machine1 = yaml.safe_load((run_dir / "machines/machine-1/trials" / name / "accelerate.yaml").read_text())
        machine0 = yaml.safe_load((run_dir / "trials" / name / "accelerate.yaml").read_text())
        assert machine0["main_process_port"] == machine1["main_process_port"] == row.launch.main_process_port
        assert (machine0["machine_rank"], machine1["machine_rank"]) == (0, 1)
        assert (run_dir / "machines/machine-1/trials" / name / "stderr.log").is_file()
    # Only machine 0 writes rows and the report; every machine records its environment.
    assert (run_dir / "report.md").is_file()
    assert not list((run_dir / "machines").rglob("results.jsonl")) and not list((run_dir / "machines").rglob("report*"))
    assert {p.name for p in (run_dir / "machines").glob("machine-*.json")} == {"machine-0.json", "machine-1.json"}
    assert "machine 1: 2 runs on several machines; logs in" in (root / "node1.log").read_text()


@pytest.mark.slow
def test_resume_on_two_machines_runs_only_what_machine_0_lacks(
    sbatch_run: tuple[Path, Path, float], tmp_path: Path
) -> None:
    """Machine 1 launches exactly the runs machine 0 resumes (it follows machine 0's published plan)."""
    source, _, _ = sbatch_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    results = run_dir / "results.jsonl"
    first = results.read_text().splitlines()[0]
    results.write_text(first + "\n")
    kept = run_dir / "machines/machine-1/trials/ddp/stderr.log"
    before = kept.stat().st_mtime_ns
    job = SlurmJob(recipe=str(run_dir), nodes=2, gpus_per_node=0, processes_per_node=1, resume=True,
                   python=sys.executable, sweep_args=("--machine-wait-s", "180", "--no-report"))  # fmt: skip
    port = _free_port_block(40000, 50000)
    start = time.monotonic()
    procs = [
        subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in job.node_commands(main_addr="127.0.0.1", port=port)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    wall = time.monotonic() - start
    print(f"--resume on 2 machines, 1 trial: {wall:.1f} s wall")
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "1 of 2 runs to do" in outs[0]
    assert "machine 1: 1 runs on several machines" in outs[1] and "ddp-ckpt: launching" in outs[1]
    assert "ddp: launching" not in outs[1]
    assert kept.stat().st_mtime_ns == before
    rows = _rows(run_dir)
    assert [(r.trial, r.status) for r in rows.values()] == [("ddp", "ok"), ("ddp-ckpt", "ok")]
    assert len(json.loads((run_dir / "environment.json").read_text())["resumed"]) == 1


@pytest.mark.slow
def test_a_killed_second_machine_is_a_failure_row_and_the_sweep_finishes(tmp_path: Path) -> None:
    """Driver 1's whole process group is killed while the first trial trains: machine 0 records that trial as
    failed on machine 1, the next as not launched (machine 1 is gone), and finishes."""
    recipe = _recipe(tmp_path / "two.yaml", first_steps=400)
    job = SlurmJob(recipe=str(recipe), nodes=2, gpus_per_node=0, processes_per_node=1, run_dir=str(tmp_path / "run"),
                   python=sys.executable, sweep_args=("--machine-wait-s", "180", "--no-report"))  # fmt: skip
    port = _free_port_block(40000, 50000)
    cmds = job.node_commands(main_addr="127.0.0.1", port=port)
    logs = [open(tmp_path / f"node{k}.log", "w") for k in (0, 1)]  # noqa: SIM115 (closed below)
    # Device locks of its own: in the session's folder machine 0's driver waits for the other tests' trials while
    # machine 1's rank waits for it at the rendezvous, both idle (tests/helpers/slurm.py says the same of Slurm's).
    env = {**_env(), "HFSCALE_LOCK_DIR": str(tmp_path / "locks")}
    start = time.monotonic()
    try:
        procs = [
            subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for cmd, log in zip(cmds, logs, strict=True)
        ]
        # Mid-trial: once machine 1's rank has run a backward pass (DDP's reducer speaks then), or after 90 s.
        stderr1 = tmp_path / "run/machines/machine-1/trials/ddp/stderr.log"
        deadline = time.monotonic() + 300
        started = None
        while time.monotonic() < deadline and procs[0].poll() is None:
            text = stderr1.read_text(errors="replace") if stderr1.exists() else ""
            started = started or (time.monotonic() if text else None)
            if "reducer" in text or (started and time.monotonic() - started > 90):
                break
            time.sleep(0.5)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic() - start
        out0 = procs[0].wait(timeout=600)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    wall = time.monotonic() - start
    print(f"killed machine 1 at {killed_at:.1f} s; machine 0's sweep ended at {wall:.1f} s")
    text0 = (tmp_path / "node0.log").read_text()
    assert out0 == 0, text0[-3000:]
    rows = _rows(tmp_path / "run")
    assert list(rows) == ["ddp", "ddp-ckpt"], text0[-3000:]
    first, second = rows["ddp"], rows["ddp-ckpt"]
    assert first.status in ("crashed", "timeout") and first.launch.failed_machine == 1, first.reason
    assert first.launch.failed_ranks == [1]
    assert first.reason.startswith("machine 1 (rank 1): its driver stopped"), first.reason
    assert second.status == "crashed" and second.launch.failed_machine == 1
    assert second.reason.startswith("not launched: machine 1: its driver stopped"), second.reason
    assert "done:" in text0


# -- the drivers' channel: liveness, retries, access (issue 13's review) -------------------------------------------


def _typed_plan(tmp_path: Path) -> SweepPlan:
    return SweepPlan(sweep_id="0" * 32, host="elsewhere", run_dir=str(tmp_path / "run"), recipe="two",
                     settings=SweepSettings(), runs=())  # fmt: skip


def _plan(tmp_path: Path, **kw: object) -> dict:
    """Machine 0's plan as it goes over the channel, with ``kw`` put in as any sender could."""
    return {**_typed_plan(tmp_path).to_json(), **kw}


def test_a_slow_start_on_another_machine_is_not_taken_for_a_dead_driver(tmp_path: Path, monkeypatch) -> None:
    """The environment probe (10 s+ on a CUDA build) runs after the plan came: the heartbeat must already beat;
    the record it collects reaches machine 0, which writes it into its run folder."""
    import threading

    import hfscale.results.environment
    import hfscale.sweep.channel as mc
    from hfscale.sweep.follow import follow_sweep
    from hfscale.sweep.machines import write_received_environments

    monkeypatch.setattr(mc, "SILENT_AFTER_S", 1.0)
    monkeypatch.setattr(mc, "HEARTBEAT_S", 0.2)
    port = _free_port_block(40000, 50000, 1)
    coordinator = Coordinator(port)
    silent: list[float | None] = []

    def slow_probe(**_: object) -> dict:
        time.sleep(mc.SILENT_AFTER_S + 1)
        silent.append(coordinator.silent_for(1))
        return {"python": "3.x", "gpu_count": 0}

    monkeypatch.setattr(hfscale.results.environment, "collect_environment", slow_probe)
    try:
        coordinator.publish("plan", _plan(tmp_path))
        launch = LaunchInfo(machine_rank=1, num_machines=2, master_addr="127.0.0.1", master_port=port)
        follow_sweep(launch, out_dir=tmp_path / "out")
        assert silent and silent[0] is not None and silent[0] < mc.SILENT_AFTER_S, silent
        assert not any(t.name == "hfscale-heartbeat" and t.is_alive() for t in threading.enumerate())
        (tmp_path / "run").mkdir()
        assert [p.name for p in write_received_environments(coordinator, tmp_path / "run")] == ["machine-1.json"]
        written = json.loads((tmp_path / "run/machines/machine-1.json").read_text())
        assert written["hostname"] == socket.gethostname() and written["python"] == "3.x"
        assert write_received_environments(coordinator, tmp_path / "run") == []  # already there: left as it is
    finally:
        coordinator.close()


def test_a_late_machine_is_a_consequence_and_machine_0s_own_oom_stays_first() -> None:
    from hfscale.sweep.channel import Absent

    port = _free_port_block(40000, 50000, 1)
    coordinator = Coordinator(port)
    try:
        coordinator.store.last_seen[1] = time.monotonic()  # its driver beats: alive, its part still running
        coordinator.store.last_seen[2] = time.monotonic() - SILENT_AFTER_S - 1
        missing = coordinator.wait_for({1: "report/0/1", 2: "report/0/2", 3: "report/0/3"}, timeout_s=0.5)
        assert {m: a.kind for m, a in missing.items()} == {1: "late", 2: "stopped", 3: "never"}
    finally:
        coordinator.close()
    oom = _row("oom", "CPU out of memory on rank 1: RuntimeError: ...")
    merged = merge_machine_reports(oom, {}, {1: missing[1]})
    assert merged.status == "oom" and (merged.launch.failed_machine, merged.launch.failed_ranks) == (0, [1])
    assert merged.reason.startswith("machine 0 (rank 1): oom: CPU out of memory")
    assert "then machine 1 (ranks 2-3): its part was still running (its driver is alive" in merged.reason
    # Machine 0 lost its peer and machine 1 is late: machine 0's row, not machine 1, is the first failure.
    merged = merge_machine_reports(_row(), {}, {1: missing[1]})
    assert merged.status == "crashed" and merged.launch.failed_machine == 0
    # A stopped driver still comes first.
    stopped = Absent(kind="stopped", why="its driver stopped (last heard 12 s ago)")
    assert merge_machine_reports(oom, {}, {1: stopped}).launch.failed_machine == 1


def test_put_until_retries_and_gives_up_when_machine_0_is_gone(monkeypatch) -> None:
    import hfscale.sweep.channel as mc
    from hfscale.sweep.channel import MachineZeroGone

    monkeypatch.setattr(mc, "SILENT_AFTER_S", 1.0)
    port = _free_port_block(40000, 50000, 1)
    follower = Follower("127.0.0.1", port, 1)
    start = time.monotonic()
    with pytest.raises(MachineZeroGone, match=r"did not take 'report/0/1': no answer for \d+ s"):
        follower.put_until("report/0/1", {"status": "ok"})
    assert time.monotonic() - start < 10
    coordinator = Coordinator(port)
    try:
        follower.put_until("ready/0/1", True)
        assert coordinator.value("ready/0/1") is True
    finally:
        coordinator.close()


def test_the_channel_needs_the_shared_token_and_takes_only_a_machines_own_keys(tmp_path: Path, monkeypatch) -> None:
    import http.client

    from hfscale.sweep.channel import MAX_BODY_BYTES, TOKEN_ENV, ChannelRefused, machine_credential
    from hfscale.sweep.follow import follow_sweep

    port = _free_port_block(40000, 50000, 1)
    coordinator = Coordinator(port, token="s3cret")
    try:
        coordinator.publish("plan", _plan(tmp_path))
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        with pytest.raises(
            ChannelRefused,
            match="refused 'plan' \\(403\\): not machine 1's credential: set the same HFSCALE_SWEEP_TOKEN",
        ):
            Follower("127.0.0.1", port, 1).get("plan")
        monkeypatch.setenv(TOKEN_ENV, "wrong")
        with pytest.raises(ChannelRefused):
            Follower("127.0.0.1", port, 1).put("ready/0/1", True)
        assert coordinator.value("ready/0/1") is None and 1 not in coordinator.store.last_seen
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        follower = Follower("127.0.0.1", port, 1)
        assert follower.get("plan")["recipe"] == "two" and follower.put("ready/0/1", True)
        for key in ("plan", "start/0", "ready/0/1/x", "alive/../plan"):  # machine 0's keys, or none
            with pytest.raises(ChannelRefused):
                follower.put(key, {"action": "launch"})
        assert coordinator.value("plan")["recipe"] == "two" and coordinator.value("start/0") is None
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.putrequest("PUT", "/env/1")
        connection.putheader("X-Hfscale-Machine", "1")
        connection.putheader("X-Hfscale-Token", machine_credential("s3cret", 1))
        connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        connection.endheaders()
        assert connection.getresponse().status == 413
        connection.close()
        # A plan whose recipe name is a path is refused before it names a folder.
        coordinator.store.values["plan"] = _plan(tmp_path, recipe="../../etc")
        launch = LaunchInfo(machine_rank=1, num_machines=2, master_addr="127.0.0.1", master_port=port)
        with pytest.raises(SweepError, match=r"machine 1: machine 0's plan names recipe '\.\./\.\./etc'"):
            follow_sweep(launch, out_dir=tmp_path / "out")
    finally:
        coordinator.close()


def test_a_sweep_with_more_runs_than_the_jobs_port_block_is_refused(monkeypatch) -> None:
    from hfscale.sweep.machines import PORT_BLOCK_ENV, check_port_block

    check_port_block(list(range(199)), 10000)  # no block: by hand, any port
    monkeypatch.setenv(PORT_BLOCK_ENV, str(PORT_BLOCK))
    check_port_block([0, 5, 198], 10000)
    with pytest.raises(SweepError, match="run 199 on several machines would rendezvous on port 10200, beyond this job"):
        check_port_block([0, 199], 10000)
    assert PORT_BASE + (PORT_JOBS - 1) * PORT_BLOCK + PORT_BLOCK - 1 < 32768  # below the ephemeral ports
