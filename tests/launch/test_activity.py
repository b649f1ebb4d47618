"""What else the machine did during a trial: a real CPU hog is seen, the trial's own processes are not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest
from helpers.hog import CpuShare, assert_named_or_outranked

from hfscale.launch.activity import ActivitySampler
from hfscale.records.activity import GpuActivity, MachineActivity, disturbances

if TYPE_CHECKING:
    import psutil

HOG = [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"]


def test_a_cpu_hog_outside_the_trial_is_seen_and_named():

    hog = subprocess.Popen(HOG)
    try:
        sampler = ActivitySampler(interval_s=0.25).start()
        share = CpuShare(hog.pid)
        time.sleep(1.6)
        activity = sampler.stop()
        hog_share = share.so_far()
    finally:
        hog.kill()
        hog.wait()
    assert activity.samples >= 4
    # One process spinning gets a core on a quiet machine; under other load it still gets a good share.
    assert activity.other_cores_mean > 0.3, activity
    # The record names the five busiest: the hog, unless five others were as busy (helpers.hog).
    assert_named_or_outranked(activity.busy_processes, hog.pid, hog_share)
    reasons = disturbances(activity)
    assert reasons and reasons[0].startswith("other processes used"), reasons


def test_the_trials_own_process_group_is_not_counted():
    """Two samplers over the same second, one told the trial's group: only that one leaves the trial out (the
    difference is robust to whatever else the machine runs meanwhile)."""
    import psutil

    trial = subprocess.Popen(HOG, start_new_session=True)  # a trial is a process group of its own
    try:
        aware = ActivitySampler(os.getpgid(trial.pid), interval_s=0.25).start()
        blind = ActivitySampler(None, interval_s=0.25).start()
        before = sum(psutil.Process(trial.pid).cpu_times()[:2])
        time.sleep(1.6)
        used = sum(psutil.Process(trial.pid).cpu_times()[:2]) - before
        seen_aware, seen_blind = aware.stop(), blind.stop()
    finally:
        os.killpg(trial.pid, signal.SIGKILL)
        trial.wait()
    assert not any(f"({trial.pid})" in p for p in seen_aware.busy_processes), seen_aware.busy_processes
    assert any(f"({trial.pid})" in p for p in seen_blind.busy_processes), seen_blind.busy_processes
    # The difference between the two is the trial's own CPU time, whatever else the machine runs meanwhile.
    difference = seen_blind.other_cores_mean - seen_aware.other_cores_mean
    assert difference == pytest.approx(used / 1.6, abs=0.25), (difference, used)


def _runs(children: list[psutil.Process], argv: list[str]) -> bool:
    """Whether the one process of ``children`` has exec'd ``argv``."""
    import psutil

    try:
        return len(children) == 1 and children[0].cmdline() == argv
    except psutil.Error:
        return False


def test_a_worker_the_trial_starts_in_a_session_of_its_own_is_the_trials():
    """torchrun starts each worker in a new session: a descendant of the trial's launcher is the trial's all the
    same (else every multi-process trial would read as a busy machine)."""
    import psutil

    spawn_worker = f"import subprocess, time\nsubprocess.Popen({HOG!r}, start_new_session=True)\ntime.sleep(30)\n"
    launcher = subprocess.Popen([sys.executable, "-c", spawn_worker], start_new_session=True)
    try:
        # Wait for the worker to run the hog: a child seen between its fork and its exec has not left the
        # launcher's session yet (the fork's child calls setsid before exec; seen once in a full suite).
        deadline = time.time() + 10
        while not _runs(psutil.Process(launcher.pid).children(), HOG) and time.time() < deadline:
            time.sleep(0.05)
        (worker,) = psutil.Process(launcher.pid).children()
        assert os.getpgid(worker.pid) != launcher.pid  # a session, and a group, of its own
        sampler = ActivitySampler(os.getpgid(launcher.pid), interval_s=0.25).start()
        time.sleep(1.2)
        activity = sampler.stop()
    finally:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            child.kill()
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    assert not any(f"({worker.pid})" in p for p in activity.busy_processes), activity.busy_processes


def test_nothing_to_say_without_samples_or_on_a_quiet_machine():
    assert disturbances(None) == []
    assert disturbances(MachineActivity(samples=0, duration_s=0.1, cpu_count=2)) == []
    quiet = MachineActivity(samples=10, duration_s=10, cpu_count=2, other_cores_mean=0.05, steal_fraction=0.0)
    assert disturbances(quiet) == []


def test_gpu_sharing_throttling_and_steal_are_named():
    busy = MachineActivity(
        samples=5,
        duration_s=5,
        cpu_count=16,
        steal_fraction=0.12,
        gpus=[GpuActivity(index=0, other_processes=[4242], throttle_reasons=["sw_thermal_slowdown"])],
    )
    reasons = disturbances(busy)
    assert "the hypervisor stole 12% of the CPU time" in reasons
    assert "GPU 0 was shared with other processes (pids 4242)" in reasons
    assert "GPU 0 throttled its clocks (sw_thermal_slowdown)" in reasons


@pytest.mark.gpu
def test_gpu_readings_come_from_nvml():
    pytest.importorskip("pynvml")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    sampler = ActivitySampler(os.getpgid(0), interval_s=0.2).start()
    x = torch.randn(4096, 4096, device="cuda")
    end = time.time() + 1.5
    while time.time() < end:
        x = x @ x
        x = x / x.norm()
    torch.cuda.synchronize()
    activity = sampler.stop()
    assert activity.gpus and activity.gpus[0].sm_clock_mhz_max and activity.gpus[0].temperature_c_max


def test_clocks_set_on_purpose_are_not_throttling():
    """pynvml names the application-clocks bit twice (ApplicationsClocksSetting, UserDefinedClocks): neither is a
    slowdown; a thermal slowdown is."""
    import types

    from hfscale.launch.activity import _throttle_names

    fake = types.SimpleNamespace(
        nvmlClocksThrottleReasonGpuIdle=0x1,
        nvmlClocksThrottleReasonApplicationsClocksSetting=0x2,
        nvmlClocksThrottleReasonUserDefinedClocks=0x2,
        nvmlClocksThrottleReasonDisplayClockSetting=0x100,
        nvmlClocksThrottleReasonSwThermalSlowdown=0x20,
    )
    assert _throttle_names(fake, 0x1 | 0x2 | 0x100) == []
    assert _throttle_names(fake, 0x2 | 0x20) == ["sw_thermal_slowdown"]
