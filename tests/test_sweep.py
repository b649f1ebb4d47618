"""The sweep runner: process groups, the run folder, and a real end-to-end sweep with real failures.

The end-to-end test launches ``accelerate launch --multi_gpu --num_processes 2 -m hfscale.sweep`` (two outer
processes: only one may drive), with trials that succeed (one and two processes), run out of memory under a
memory limit, are killed by a signal from outside, run past their timeout, and one that is interrupted by SIGINT
to the whole outer launch and then completed with ``hfscale sweep --resume``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hfscale.process import (
    ProcessOutcome,
    classify,
    clean_environment,
    free_port,
    group_members,
    run_process_group,
    stderr_excerpt,
    tail,
)
from hfscale.recipe import load_recipe
from hfscale.results import read_results
from hfscale.sweep import (
    LOCK_FILE,
    LaunchInfo,
    SweepError,
    acquire_lock,
    create_run_dir,
    main,
    plan_runs,
)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


# -- process groups ------------------------------------------------------------------------------------------------


def test_timeout_kills_the_whole_group_grandchildren_included(tmp_path):
    # The launcher starts a grandchild (as accelerate launch starts the trial) and both would sleep for a minute.
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('started', flush=True); time.sleep(60)"
    )
    outcome = run_process_group(
        [PY, "-c", code],
        env=clean_environment(),
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
        timeout_s=1.5,
        pid_file=tmp_path / "pid",
        kill_grace_s=1.0,
    )
    assert outcome.timed_out
    assert 1.5 <= outcome.wall_time_s < 10
    assert outcome.returncode < 0  # ended by SIGTERM
    assert group_members(outcome.pid) == []  # the grandchild is gone too
    assert not (tmp_path / "pid").exists()
    verdict = classify(outcome, tail(tmp_path / "err"), timeout_s=1.5)
    assert verdict.status == "timeout"


def test_memory_limit_makes_a_real_out_of_memory(tmp_path):
    outcome = run_process_group(
        [PY, "-c", "x = bytearray(3 * 2**30)"],
        env=clean_environment(),
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
        memory_limit_bytes=1 * 2**30,
    )
    assert outcome.returncode == 1 and not outcome.timed_out
    stderr = tail(tmp_path / "err")
    assert "MemoryError" in stderr
    verdict = classify(outcome, stderr, memory_limit_bytes=2**30)
    assert verdict.status == "oom"
    assert "memory limit 1 GiB" in verdict.reason


def test_a_signal_is_a_crash_named_by_the_signal(tmp_path):
    outcome = run_process_group(
        [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
        env=clean_environment(),
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
    )
    assert outcome.returncode == -signal.SIGSEGV
    verdict = classify(outcome, tail(tmp_path / "err"))
    assert verdict.status == "crashed"
    assert "SIGSEGV" in verdict.reason


@pytest.mark.parametrize(
    ("stderr", "status", "words"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom", "CUDA out of memory"),
        ("[rank1]: RuntimeError: DefaultCPUAllocator: can't allocate memory", "oom", "host out of memory"),
        ("Signal 9 (SIGKILL) received by PID 123", "crashed", "a process of the trial was killed by SIGKILL"),
        ("ValueError: bad config\nsubprocess.CalledProcessError: ...", "crashed", "exit code 1: ValueError: bad"),
    ],
)
def test_classify_reads_what_launchers_print(stderr, status, words):
    verdict = classify(ProcessOutcome(returncode=1, timed_out=False, wall_time_s=1.0, pid=1), stderr)
    assert verdict.status == status
    assert words in verdict.reason


def test_the_worker_traceback_is_kept_when_torchrun_prints_its_table_after_it():
    worker = [f"[rank0]:   File 'x.py', line {i}" for i in range(30)] + ["[rank0]: TypeError: the real cause"]
    table = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "] + [f"  row {i}" for i in range(60)]
    text = "\n".join(worker + table)
    excerpt = stderr_excerpt(text)
    assert "[rank0]: TypeError: the real cause" in excerpt and "  row 59" in excerpt
    assert len(excerpt.splitlines()) == 15 + 1 + 40
    verdict = classify(ProcessOutcome(returncode=1, timed_out=False, wall_time_s=1.0, pid=1), text)
    assert verdict.reason == "exit code 1: TypeError: the real cause"


def test_clean_environment_drops_the_outer_launch():
    outer = {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_PORT": "29500",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "TORCHELASTIC_ERROR_FILE": "/tmp/x",
        "FSDP_VERSION": "2",
    }
    env = clean_environment(outer, {"EXTRA": "1"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "EXTRA": "1"}


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- launch, plan, run folder --------------------------------------------------------------------------------------


def test_launch_info_from_torchrun_environment():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    info = LaunchInfo.from_env({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (info.launched, info.world_size, info.num_machines, info.machine_rank) == (True, 4, 2, 1)
    assert not info.is_driver and info.master_port == 29500
    assert LaunchInfo.from_env({}) == LaunchInfo()
    assert LaunchInfo().is_driver


def _recipe(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_plan_skips_what_cannot_run_here_with_the_reason(tmp_path, monkeypatch):
    import importlib.util

    data = {
        "device": "cuda",
        "trials": [
            {"name": "gpu"},
            {"name": "zero2", "deepspeed": {"zero_stage": 2}},
            {"name": "two-machines", "num_machines": 2, "num_processes": 2},
        ],
        "measure": {"repeats": 2},
    }
    recipe = load_recipe(_recipe(tmp_path, data))
    runs = plan_runs(recipe.trials, gpu_count=0, num_machines=1)
    assert [(r.name, r.repeat) for r in runs] == [(n, k) for n in ("gpu", "zero2", "two-machines") for k in (0, 1)]
    assert "no CUDA device" in runs[0].skip_reason
    assert "needs 2 machines" in runs[4].skip_reason
    assert plan_runs(recipe.trials, gpu_count=1, num_machines=1)[0].skip_reason is None

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    runs = plan_runs(recipe.trials, gpu_count=1, num_machines=1, only=["zero2"])
    assert [r.name for r in runs] == ["zero2", "zero2"]
    assert runs[0].skip_reason == "deepspeed is not installed (pip install 'hfscale[deepspeed]')"
    with pytest.raises(SweepError, match="--only: no trial named nope"):
        plan_runs(recipe.trials, gpu_count=1, num_machines=1, only=["nope"])


def test_run_folders_are_exclusive_and_locked(tmp_path):
    a = create_run_dir(out_dir=tmp_path, name="r")
    b = create_run_dir(out_dir=tmp_path, name="r")
    assert a != b and a.is_dir() and b.is_dir()
    lock = acquire_lock(a)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(SweepError, match=r"is being written by another sweep \(pid \d+"):
        acquire_lock(a)
    # A lock left by a process that is gone is taken over.
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "time": "then"}))
    assert json.loads(acquire_lock(a).read_text())["pid"] == os.getpid()


def test_run_dir_that_exists_is_refused(tmp_path, capsys):
    recipe = REPO / "recipes" / "cpu_small.yaml"
    (tmp_path / "taken").mkdir()
    assert main([str(recipe), "--run-dir", str(tmp_path / "taken"), "--no-report"]) == 2
    assert "exists; continue it with --resume" in capsys.readouterr().err


def test_dry_run_prints_each_trial_and_its_launch_command_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([str(REPO / "recipes" / "cpu_small.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    recipe = load_recipe(REPO / "recipes" / "cpu_small.yaml")
    for name in recipe.trial_names:
        assert f"- {name}: " in out
        assert f"--config_file RUN/trials/{name}/accelerate.yaml -m hfscale.trial RUN/trials/{name}/trial.json" in out
    assert "ZeRO-2" in out and "x 2 proc" in out
    assert not (tmp_path / "runs").exists()


# -- end to end ----------------------------------------------------------------------------------------------------

E2E_RECIPE = {
    "name": "e2e",
    "device": "cpu",
    "model": {
        "type": "bert",
        "task": "classification",
        "config": {
            "vocab_size": 1000,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "max_position_embeddings": 64,
        },
    },
    # Enough samples for the out-of-memory trial's one batch; the others train 3 steps of 4.
    "data": {"num_samples": 16384, "seq_len": 32, "token_high": 1000},
    "training_args": {"report_to": "none"},
    "measure": {"max_steps": 3, "warmup_steps": 1, "timeout_s": 300},
    "defaults": {"per_device_batch_size": 4},
    "trials": [
        {"name": "fp32", "num_processes": 1},
        # Not pinned: takes the outer launch's 2 processes (DDP).
        {"name": "ddp"},
        # 16384 x 32 tokens in one batch needs several GiB; the limit leaves room for the imports only.
        {"name": "oom", "num_processes": 1, "per_device_batch_size": 16384, "run": {"memory_limit_gib": 3.5}},
        {"name": "killed", "num_processes": 1, "measure": {"max_steps": 100000}},
        {"name": "slow", "num_processes": 1, "measure": {"max_steps": 100000, "timeout_s": 4}},
        {"name": "ckpt", "num_processes": 1, "gradient_checkpointing": True},
    ],
}


def _hfscale_command() -> list[str]:
    script = Path(PY).parent / "hfscale"
    return [str(script)] if script.exists() else [PY, "-m", "hfscale.cli"]


@pytest.mark.slow
def test_end_to_end_sweep_with_real_failures_interrupt_and_resume(tmp_path):
    t0 = time.monotonic()
    recipe = _recipe(tmp_path, E2E_RECIPE)
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    outer_cmd = [
        PY, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        "-m", "hfscale.sweep", str(recipe), "--run-dir", str(run_dir),
    ]  # fmt: skip
    log = open(tmp_path / "outer.log", "w+b")  # noqa: SIM115 (read after the process ends)
    outer = subprocess.Popen(outer_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    groups: dict[str, int] = {}  # trial -> its process group, seen through its pid file
    killed_at = interrupted_at = None
    try:
        deadline = time.monotonic() + 480
        while outer.poll() is None and time.monotonic() < deadline:
            for pid_file in (run_dir / "trials").glob("*/pid"):
                try:
                    groups.setdefault(pid_file.parent.name, int(pid_file.read_text()))
                except (OSError, ValueError):
                    continue
            # Act once the trial's launcher has started its trial process: the whole group must go.
            if killed_at is None and len(group_members(groups.get("killed", -1))) >= 2:
                os.killpg(groups["killed"], signal.SIGKILL)
                killed_at = time.monotonic()
            if interrupted_at is None and len(group_members(groups.get("ckpt", -1))) >= 2:
                os.killpg(outer.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole outer launch
                interrupted_at = time.monotonic()
            time.sleep(0.1)
        outer.wait(timeout=60)
    finally:
        if outer.poll() is None:
            os.killpg(outer.pid, signal.SIGKILL)
        log.seek(0)
        outer_log = log.read().decode(errors="replace")
        log.close()
    first_s = time.monotonic() - t0
    assert killed_at is not None and interrupted_at is not None, outer_log[-4000:]

    # One driver: rank 1 stood down, and every trial ran once.
    assert "rank 1 (local rank 1): the driver on local rank 0 runs the sweep; exiting" in outer_log
    assert "interrupted: finished trials are kept" in outer_log
    rows = read_results(run_dir)
    assert [r.trial for r in rows] == ["fp32", "ddp", "oom", "killed", "slow"], outer_log[-4000:]
    assert not (run_dir / LOCK_FILE).exists()
    # Nothing of any trial is left running: not the killed one, the timed-out one, nor the interrupted one.
    assert {"killed", "slow", "ckpt"} <= set(groups)
    assert all(group_members(pgid) == [] for pgid in groups.values()), groups
    assert not (run_dir / "report.md").exists()  # an interrupted sweep writes nothing partial

    # Resume with the third entry point; only the interrupted trial runs, with the first run's settings.
    t1 = time.monotonic()
    resumed = subprocess.run(
        [*_hfscale_command(), "sweep", "--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    resume_s = time.monotonic() - t1
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "1 of 6 runs to do (5 already in" in resumed.stderr
    rows = {r.trial: r for r in read_results(run_dir)}
    assert sorted(rows) == sorted(t["name"] for t in E2E_RECIPE["trials"])
    assert len(read_results(run_dir)) == 6

    for name in ("fp32", "ddp", "ckpt"):
        row = rows[name]
        assert row.status == "ok", (name, row.reason, row.stderr_tail)
        assert row.exit_code == 0 and row.stderr_tail is None
        assert len(row.loss_curve) == 3 and math.isfinite(row.final_loss)
        assert row.throughput["samples_per_s"] > 0
        assert row.memory["peak_gib"] > 0
        assert row.wall_time_s > row.train_runtime_s > 0
        assert (run_dir / "trials" / name / "accelerate.yaml").exists()
        assert (run_dir / "trials" / name / "stdout.log").exists()
    assert rows["fp32"].is_baseline and not rows["ddp"].is_baseline
    # The unpinned trial ran with the outer launch's two processes, and both trained.
    assert rows["ddp"].strategy["num_processes"] == 2 and rows["ddp"].extra["world_size"] == 2
    assert rows["fp32"].extra["world_size"] == 1
    assert rows["ckpt"].strategy["gradient_checkpointing"] is True

    oom = rows["oom"]
    assert oom.status == "oom", (oom.reason, oom.stderr_tail)
    assert "memory limit 3.5 GiB" in oom.reason and "allocate" in oom.stderr_tail
    killed = rows["killed"]
    assert killed.status == "crashed" and killed.exit_code == -signal.SIGKILL
    assert "killed by SIGKILL" in killed.reason
    slow = rows["slow"]
    assert slow.status == "timeout" and "4 s" in slow.reason
    assert 4 <= slow.wall_time_s < 4 + 15
    for row in (oom, killed, slow):
        assert row.stderr_tail is not None

    env_record = json.loads((run_dir / "environment.json").read_text())
    assert env_record["packages"]["torch"] and env_record["gpu_count"] == 0
    assert env_record["sweep"]["num_processes"] == 2 and env_record["launch"]["world_size"] == 2
    assert len(env_record["resumed"]) == 1
    assert (run_dir / "recipe.yaml").read_text() == recipe.read_text()
    assert (run_dir / "report.md").exists()
    print(f"\nend-to-end: first sweep {first_s:.1f} s, resume {resume_s:.1f} s")


def test_a_failing_report_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hfscale.report
    from hfscale.sweep import _write_report

    def broken(run_dir: Path, **kwargs: object) -> None:
        raise ZeroDivisionError("report bug")

    monkeypatch.setattr(hfscale.report, "write_report", broken)
    paths, error = _write_report(tmp_path, lambda line: None)
    assert paths == [] and error is not None and "ZeroDivisionError: report bug" in error
