"""Process groups: started, bounded in time and memory, killed as a whole, never outliving their driver (how a
failed one is classified is tested in ``test_failures.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hfscale.launch.failures import classify
from hfscale.launch.process import (
    PID_FILE_ENV,
    GroupLimits,
    ProcessOutcome,
    clean_environment,
    end_orphaned_group,
    free_port,
    group_members,
    run_process_group,
    tail,
)
from hfscale.trial.watchdog import DRIVER_PID_ENV, watch_driver

PY = sys.executable
EXIT_1 = ProcessOutcome(returncode=1, timed_out=False, wall_time_s=1.0, pid=1)


# -- process groups (moved from tests/test_sweep.py) ---------------------------------------------------------------


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
        pid_file=tmp_path / "pid",
        limits=GroupLimits(timeout_s=1.5, kill_grace_s=1.0),
    )
    assert outcome.timed_out
    assert 1.5 <= outcome.wall_time_s < 10
    assert outcome.returncode < 0  # ended by SIGTERM
    assert group_members(outcome.pid) == []  # the grandchild is gone too
    assert not (tmp_path / "pid").exists()
    verdict = classify(outcome, tail(tmp_path / "err"), timeout_s=1.5)
    assert verdict.status == "timeout"


def test_memory_limit_makes_a_real_out_of_memory(tmp_path):
    # The limit is set from outside just after the start; a launcher imports for seconds before it allocates.
    outcome = run_process_group(
        [PY, "-c", "import time; time.sleep(0.5); x = bytearray(3 * 2**30)"],
        env=clean_environment(),
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
        limits=GroupLimits(memory_limit_bytes=1 * 2**30),
    )
    assert outcome.returncode == 1 and not outcome.timed_out
    stderr = tail(tmp_path / "err")
    assert "MemoryError" in stderr
    verdict = classify(outcome, stderr, memory_limit_bytes=2**30)
    assert verdict.status == "oom"
    assert "memory limit 1 GiB" in verdict.reason


def test_the_memory_limit_is_set_without_preexec_fn_and_reaches_the_grandchildren(tmp_path, monkeypatch):
    """``preexec_fn`` is unsafe in the driver, which runs threads (the channel's server, the heartbeat): the limit is
    set on the started process with ``prlimit``, and a process it starts later inherits it."""
    import hfscale.launch.process as process

    started: list[dict] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(kwargs)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(process.subprocess, "Popen", recording_popen)
    child = "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0])"
    code = f"import subprocess, sys, time; time.sleep(0.5); subprocess.run([sys.executable, '-c', {child!r}])"
    outcome = run_process_group(
        [PY, "-c", code],
        env=clean_environment(),
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
        limits=GroupLimits(memory_limit_bytes=3 * 2**30),
    )
    assert outcome.returncode == 0, tail(tmp_path / "err")
    assert (tmp_path / "out").read_text().split() == [str(3 * 2**30)]
    assert [kwargs.get("preexec_fn") for kwargs in started] == [None]


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


# -- a group must not outlive its driver (issue 15, item 1) --------------------------------------------------------


def _sleeper(**kwargs) -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], **kwargs)


def _wait_until_gone(pgid: int, seconds: float) -> float | None:
    """Seconds until group ``pgid`` has no live process, or None when it still has one after ``seconds``."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not group_members(pgid):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def test_the_watchdog_kills_the_whole_group_when_its_driver_dies(tmp_path):
    driver = _sleeper()
    # The group's first process starts a grandchild (as accelerate launch starts its workers), then waits.
    code = (
        "import subprocess, sys, time; from hfscale.trial.watchdog import watch_driver; watch_driver(poll_s=0.1); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('ready', flush=True); "
        "time.sleep(60)"
    )
    group = subprocess.Popen(
        [PY, "-c", code], env={**clean_environment(), DRIVER_PID_ENV: str(driver.pid)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert group.stdout.readline().strip() == "ready"
        assert len(group_members(group.pid)) == 2
        driver.kill()  # SIGKILL: the driver runs no handler
        driver.wait()
        gone_s = _wait_until_gone(group.pid, 5.0)
        # Before: nothing watched the driver, and both processes slept on.
        assert gone_s is not None, group_members(group.pid)
        assert group.wait(timeout=5) == -signal.SIGKILL
        assert "the sweep's driver (pid" in group.stderr.read()
    finally:
        for proc in (driver, group):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL) if proc is group else proc.kill()
                proc.wait()


def test_no_watchdog_without_a_driver_or_in_the_drivers_own_group():
    assert watch_driver(env={}) is None
    assert watch_driver(env={DRIVER_PID_ENV: str(os.getpid())}) is None
    assert watch_driver(env={DRIVER_PID_ENV: "not a pid"}) is None


def test_an_orphaned_group_is_ended_only_when_it_is_the_one_its_pid_file_names(tmp_path):
    pid_file = tmp_path / "trials" / "a" / "pid"
    pid_file.parent.mkdir(parents=True)
    tagged = _sleeper(env={**clean_environment(), PID_FILE_ENV: str(pid_file.resolve())}, start_new_session=True)
    stranger = _sleeper(start_new_session=True)  # a pid file whose pid now belongs to something else
    other_file = tmp_path / "trials" / "b" / "pid"
    other_file.parent.mkdir(parents=True)
    try:
        pid_file.write_text(f"{tagged.pid}\n")
        other_file.write_text(f"{stranger.pid}\n")
        assert end_orphaned_group(pid_file, grace_s=1.0) == tagged.pid
        assert group_members(tagged.pid) == [] and not pid_file.exists()
        assert end_orphaned_group(other_file) is None
        assert stranger.poll() is None and not other_file.exists()  # left alone
        assert end_orphaned_group(tmp_path / "missing") is None
    finally:
        for proc in (tagged, stranger):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_every_group_carries_its_driver_and_pid_file(tmp_path):
    code = "import os; print(os.environ['HFSCALE_DRIVER_PID'], os.environ['HFSCALE_PID_FILE'])"
    run_process_group(
        [PY, "-c", code], env=clean_environment(), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
        pid_file=tmp_path / "pid",
    )  # fmt: skip
    assert (tmp_path / "out").read_text().split() == [str(os.getpid()), str((tmp_path / "pid").resolve())]
