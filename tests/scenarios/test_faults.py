"""Faults a long sweep meets (issue 15), each injected for real where that is the point, and what is left after.

- the driver killed with SIGKILL: its running trial dies with it (the trial's watchdog), and ``--resume`` ends a
  trial of its folder that still runs before it starts (the pid file and ``/proc/PID/environ``);
- a 2-process trial leaves nothing in the temporary folder (torchrun's ``torchelastic_*`` goes to the trial's own
  TMPDIR, removed after), and two sweeps started at once on one machine take turns on its device;
- a read-only run folder and a full one: a clear error naming the path, every row kept, ``--resume`` finishes
  once it is writable again (a real tmpfs mount where this machine allows it).

The corrupt middle line and SIGHUP are in ``tests/sweep/test_loop.py``; the watchdog, orphaned groups and the row writes
one by one in ``test_process.py`` and ``test_run_folder.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers.runs import write_recipe

from hfscale.commands.sweep import main
from hfscale.launch.device_lock import DeviceBusyError, hold_devices
from hfscale.launch.process import PID_FILE_ENV, clean_environment, group_members
from hfscale.results.run_folder import RunFolder, read_results
from hfscale.sweep.loop import run_sweep
from hfscale.sweep.outcome import NOTHING_RAN_EXIT, STOPPED_EXIT

PY = sys.executable
MODEL = {
    "type": "bert",
    "task": "classification",
    "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
               "vocab_size": 1000, "max_position_embeddings": 64},
}  # fmt: skip
LONG = {
    "name": "long",
    "device": "cpu",
    "model": MODEL,
    "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
    "measure": {"max_steps": 100000, "warmup_steps": 1, "timeout_s": 300, "repeats": 1},
    "run": {"env": {"OMP_NUM_THREADS": "1"}},
    "defaults": {"per_device_batch_size": 4, "num_processes": 1},
    "trials": [{"name": "long"}],
}
# Every trial skipped before launching (predicted out of memory): a sweep that writes rows and launches nothing.
SKIPPED = {
    "name": "skipped",
    "device": "cpu",
    "model": MODEL,
    "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
    "measure": {"repeats": 1, "warmup_steps": 1},  # an epoch is 4 steps
    "defaults": {"per_device_batch_size": 4, "num_processes": 1, "optimizer": "adamw_torch"},
    "trials": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
}
NOTHING_FITS = ["--skip-predicted-oom", "--memory-budget", "1MiB", "--no-report"]


def _recipe(tmp_path: Path, data: dict) -> Path:
    """The recipe file named after the recipe (two sweeps at once need two names)."""
    return write_recipe(tmp_path, data, f"{data['name']}.yaml")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}


def _sweep(*args: str, env: dict[str, str], stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "hfscale.sweep", *args], env=env, stderr=stderr, text=True,
                            start_new_session=True)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- 1. the driver killed with SIGKILL --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_trial_does_not_outlive_its_driver_killed_with_sigkill(tmp_path):
    run = tmp_path / "run"
    sweep = _sweep(str(_recipe(tmp_path, LONG)), "--run-dir", str(run), "--no-report", env=_env())
    pgid = None
    try:
        deadline = time.monotonic() + 120
        first_seen = None
        while pgid is None and time.monotonic() < deadline and sweep.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                candidate = int((run / "trials" / "long" / "pid").read_text())
                first_seen = first_seen or time.monotonic()
                # Running for 3 s: the trial process (started directly, one process) is past its watchdog's start.
                if group_members(candidate) and time.monotonic() - first_seen > 3:
                    pgid = candidate
            time.sleep(0.1)
        assert pgid is not None, "the trial did not start"
        sweep.kill()  # SIGKILL: the OOM killer, scancel --signal=KILL; no handler runs
        killed_at = time.monotonic()
        sweep.wait()
        while group_members(pgid) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        gone_s = time.monotonic() - killed_at
        # Before: the trial ran on as an orphan (its own session) until its 300 s limit, next to any --resume.
        assert group_members(pgid) == [], f"trial group {pgid} survived its driver"
        print(f"\ntrial group gone {gone_s:.1f} s after the driver's SIGKILL")
    finally:
        _stop(sweep)
        if pgid is not None and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
    assert "the sweep's driver (pid" in (run / "trials" / "long" / "stderr.log").read_text()


def test_resume_ends_a_trial_of_its_folder_that_still_runs_before_it_starts(tmp_path):
    run = tmp_path / "run"
    assert main([str(_recipe(tmp_path, SKIPPED)), "--run-dir", str(run), *NOTHING_FITS]) == NOTHING_RAN_EXIT
    # What a driver killed before the watchdog existed left: a trial group still running, and its pid file.
    pid_file = run / "trials" / "b" / "pid"
    pid_file.parent.mkdir(parents=True)
    orphan = subprocess.Popen(
        [PY, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
         "time.sleep(60)']); print('ready', flush=True); time.sleep(60)"],
        env={**clean_environment(), PID_FILE_ENV: str(pid_file.resolve())}, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert orphan.stdout.readline().strip() == "ready"
        pid_file.write_text(f"{orphan.pid}\n")
        lines: list[str] = []
        run_sweep(None, resume=run, report=False, progress=lines.append)
        # Before: the resumed sweep started its trials next to it.
        assert group_members(orphan.pid) == [] and not pid_file.exists()
        assert any(f"trials/b: still running from an earlier sweep of this folder (process group {orphan.pid})"
                   in line for line in lines), lines  # fmt: skip
    finally:
        _stop(orphan)


# -- 3. and 4. nothing left in the temporary folder; two sweeps take turns -----------------------------------------

TWO_PROCESSES = {
    "name": "pair",
    "device": "cpu",
    "model": MODEL,
    "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
    "training_args": {"report_to": "none"},
    "measure": {"max_steps": 2, "warmup_steps": 0, "timeout_s": 120, "repeats": 1},
    "run": {"env": {"OMP_NUM_THREADS": "1"}},
    "defaults": {"per_device_batch_size": 2, "num_processes": 2, "optimizer": "adamw_torch"},
    "trials": [{"name": "ddp"}],
}


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


@pytest.mark.slow
def test_two_sweeps_at_once_take_turns_on_the_device_and_leave_nothing_in_the_temp_dir(tmp_path):
    # The sweeps' own temporary folder (what /tmp is to them) and lock folder, private to this test.
    system_tmp, locks = tmp_path / "t", tmp_path / "locks"
    system_tmp.mkdir()
    env = _env(TMPDIR=str(system_tmp), HFSCALE_LOCK_DIR=str(locks))
    # a: two processes (torchrun, which made the torchelastic_* folders); b: one, to keep the test short.
    recipes = [_recipe(tmp_path, TWO_PROCESSES), _recipe(tmp_path, {**TWO_PROCESSES, "name": "one", "defaults":
               {**TWO_PROCESSES["defaults"], "num_processes": 1}})]  # fmt: skip
    logs = [open(tmp_path / f"{name}.log", "w+") for name in ("a", "b")]  # noqa: SIM115 (read after)
    sweeps = []
    try:
        # b starts once a's trial holds the device (its pid file is written after the lock is taken): started
        # together, b's one short trial could end before a's driver reached the lock, and nothing would contend.
        sweeps.append(_sweep(str(recipes[0]), "--run-dir", str(tmp_path / "a"), "--no-report", env=env, stderr=logs[0]))
        deadline = time.monotonic() + 240
        while not (tmp_path / "a" / "trials" / "ddp" / "pid").exists():
            assert sweeps[0].poll() is None and time.monotonic() < deadline, "sweep a never launched its trial"
            time.sleep(0.05)
        sweeps.append(_sweep(str(recipes[1]), "--run-dir", str(tmp_path / "b"), "--no-report", env=env, stderr=logs[1]))
        for sweep in sweeps:
            assert sweep.wait(timeout=300) == 0
    finally:
        for sweep in sweeps:
            _stop(sweep)
    err = {}
    for name, log in zip(("a", "b"), logs, strict=True):
        log.seek(0)
        err[name] = log.read()
        log.close()
    (a,), (b,) = read_results(tmp_path / "a"), read_results(tmp_path / "b")
    for row, world_size in ((a, 2), (b, 1)):
        assert row.status == "ok" and row.measured.world_size == world_size, (row.reason, row.stderr_tail)
        assert row.launch.device_shared_with is None and row.launch.device_lock_waited_s is not None
    # Before: both trials ran at the same time on the same cores, each measuring the other.
    first, second = sorted((a, b), key=lambda r: r.launch.device_lock_waited_s)
    assert _when(first.finished_at) <= _when(second.started_at), (first, second)
    assert second.launch.device_lock_waited_s > 0
    waiter = "a" if second is a else "b"
    holder = tmp_path / ("b" if waiter == "a" else "a")
    assert "device cpu is in use by another sweep (pid " in err[waiter]
    assert f"run folder {holder.resolve()}, trial ddp" in err[waiter], err[waiter][-2000:]
    # Before: each 2-process trial left a torchelastic_* folder in the temporary folder. What is left is torch's
    # compile cache, one fixed folder per user that the driver's import of torch makes and every run reuses.
    assert sorted(p.name for p in system_tmp.iterdir() if not p.name.startswith("torchinductor_")) == []
    for run in (tmp_path / "a", tmp_path / "b"):
        assert not (run / "trials" / "ddp" / "tmp").exists() and not (run / "trials" / "ddp" / "pid").exists()
    assert sorted(p.name for p in locks.iterdir()) == ["cpu.lock"]  # one per device, reused by every sweep
    print(f"\nwaited {second.launch.device_lock_waited_s:.1f} s; trials {first.wall_time_s:.1f} s and "
          f"{second.wall_time_s:.1f} s (launch to exit)")  # fmt: skip


def test_a_device_held_too_long_is_refused_or_shared_as_asked(tmp_path):
    """The holder's record survives every contended attempt to take the lock (filelock >= 3.30; before, each attempt
    truncated the file, and the messages said "a process that did not say who it is")."""
    lines: list[str] = []
    with hold_devices(["cuda0"], run_dir=tmp_path / "first", trial="t1", directory=tmp_path) as first:
        assert first.waited_s is not None and first.waited_s < 1 and first.shared_with is None
        refused = r"device cuda0 is still in use after 1 s \(pid \d+ on .*, run folder .*first, trial t1, since .*\)"
        with (
            pytest.raises(DeviceBusyError, match=refused + "; nothing of this trial ran"),
            hold_devices(["cuda0"], run_dir=tmp_path / "second", trial="t2", directory=tmp_path, wait_s=1.0,
                         progress=lines.append),
        ):  # fmt: skip
            pass
        assert "device cuda0 is in use by another sweep (pid" in lines[0]
        with hold_devices(["cuda0"], run_dir=tmp_path / "second", trial="t2", directory=tmp_path, share=True,
                          progress=lines.append) as shared:  # fmt: skip
            assert shared.shared_with and "first, trial t1" in shared.shared_with[0]
    with hold_devices(["cuda0"], run_dir=tmp_path / "third", trial="t3", directory=tmp_path) as free:
        assert free.shared_with is None  # released when the holder's block ended


# -- 5. a read-only or full run folder --------------------------------------------------------------------------------


def test_a_row_that_cannot_be_written_stops_the_sweep_naming_the_path_and_resume_finishes(tmp_path, monkeypatch,
                                                                                          capsys):  # fmt: skip
    import hfscale.results.run_folder

    run = tmp_path / "run"
    real_fsync, calls = os.fsync, []

    def full_after_one_row(fd: int) -> None:
        calls.append(fd)
        if len(calls) > 3:  # the write check (2), the first row, then the disk is full
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(hfscale.results.run_folder.os, "fsync", full_after_one_row)
    # Before: exit 2 ("bad input") and "[Errno 28] No space left on device", naming no file.
    assert main([str(_recipe(tmp_path, SKIPPED)), "--run-dir", str(run), *NOTHING_FITS]) == STOPPED_EXIT
    err = capsys.readouterr().err
    assert f"cannot write {run / 'results.jsonl'}: No space left on device" in err
    assert f"continue with: hfscale sweep --resume {run}" in err
    assert [r.trial for r in RunFolder(run).rows(on_bad_line="raise")] == ["a"]
    monkeypatch.undo()
    assert main(["--resume", str(run), "--no-report"]) == NOTHING_RAN_EXIT  # b and c skipped, as a was
    assert [r.trial for r in RunFolder(run).rows(on_bad_line="raise")] == ["a", "b", "c"]


def test_configs_that_cannot_be_written_stop_the_sweep_before_launching(tmp_path, monkeypatch, capsys):
    import hfscale.configs

    def read_only(strategy, out_dir, **kwargs):
        raise OSError(30, "Read-only file system", str(Path(out_dir) / "accelerate.yaml"))

    monkeypatch.setattr(hfscale.configs, "write_configs", read_only)
    run = tmp_path / "run"
    assert main([str(_recipe(tmp_path, {**SKIPPED, "trials": [{"name": "a"}]})), "--run-dir", str(run),
                 "--no-report"]) == STOPPED_EXIT  # fmt: skip
    assert f"cannot write {run / 'trials' / 'a' / 'accelerate.yaml'}: Read-only file system" in capsys.readouterr().err
    assert not (run / "results.jsonl").exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs mounted at ``tmp_path/fs`` (root and mount(8) needed; skipped where this machine has
    neither)."""
    mount = shutil.which("mount")
    point = tmp_path / "fs"
    point.mkdir()
    if mount is None or os.geteuid() != 0:
        pytest.skip("needs root and mount(8) for a real tmpfs")
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")

    def remount(mode: str) -> None:
        subprocess.run([mount, "-o", f"remount,{mode}", str(point)], check=True)

    try:
        yield point, remount
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_read_only_and_a_full_filesystem_keep_every_row_and_resume_finishes(tmp_path, small_tmpfs, capsys):
    point, remount = small_tmpfs
    recipe = _recipe(tmp_path, SKIPPED)
    run = point / "run"
    assert main([str(recipe), "--run-dir", str(run), *NOTHING_FITS]) == NOTHING_RAN_EXIT
    results = run / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    results.write_text("".join(lines[:2]))  # as if the sweep had stopped before "c"
    kept = results.read_bytes()

    remount("ro")
    try:
        assert main([str(recipe), "--out-dir", str(point / "new"), *NOTHING_FITS]) == 2
        err = capsys.readouterr().err
        assert f"cannot write {point / 'new'}" in err and "Read-only file system" in err, err
        assert main(["--resume", str(run), "--no-report"]) == STOPPED_EXIT
        err = capsys.readouterr().err
        assert f"cannot write {run / '.lock'}: Read-only file system" in err and f"--resume {run}" in err
    finally:
        remount("rw")
    assert results.read_bytes() == kept

    # Full: fill what is left of the 1 MiB.
    filler = point / "filler"
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as fh:
        while True:
            fh.write(b"\0" * 4096)
    assert main(["--resume", str(run), "--no-report"]) == STOPPED_EXIT
    err = capsys.readouterr().err
    assert "No space left on device" in err and f"cannot write {run}" in err, err
    assert results.read_bytes() == kept  # nothing lost, nothing half-written

    filler.unlink()
    assert main(["--resume", str(run), "--no-report"]) == NOTHING_RAN_EXIT  # c skipped, as a and b were
    assert [r.trial for r in read_results(run)] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [("HFSCALE_DEVICE_WAIT_S", "6h", "expected a number of seconds"), ("HFSCALE_DEVICE_LOCK", "shared", "'wait'")],
)
def test_a_bad_device_lock_setting_names_the_variable(monkeypatch, tmp_path, variable, value, message):
    from hfscale.launch.device_lock import hold_devices

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}=.*{message}"), hold_devices(["cpu"], run_dir=tmp_path, trial="t"):
        pass
