"""hfscale.measure.memory: CPU RSS probes (reset high-water mark), NVML failure handling, the CUDA allocator probe."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch

from hfscale.measure.memory import CpuProbe, CudaProbe, nvml_memory, probe_for

MIB = 1024**2
GIB = 1024**3


def test_cpu_current_rss_agrees_with_psutil():
    probe = CpuProbe()
    ours = probe.current_bytes()
    theirs = psutil.Process().memory_info().rss
    assert ours is not None and ours > 0
    assert abs(ours - theirs) < 16 * MIB


def test_cpu_peak_is_reset_to_current_not_a_lifetime_peak():
    probe = probe_for("cpu")
    assert isinstance(probe, CpuProbe)
    probe.reset_peak()
    base = probe.current_bytes()
    block = np.ones(256 * MIB // 8)  # 256 MiB, touched; large enough that free() returns it to the kernel
    during = probe.current_bytes()
    del block
    peak = probe.peak_bytes()
    after = probe.current_bytes()
    assert during - base > 200 * MIB
    # The kernel batches its per-thread RSS counters, so the two readings can differ by a few pages.
    assert peak >= during - 1 * MIB
    assert during - after > 200 * MIB
    probe.reset_peak()
    # After a reset the high-water mark is back near the current RSS, far below the old peak.
    assert probe.peak_bytes() < peak - 200 * MIB
    assert probe.peak_reserved_bytes() is None
    assert probe.counters() == (None, None)
    assert probe.nvml() is None


def test_nvml_library_missing_gives_none(monkeypatch):
    pynvml = pytest.importorskip("pynvml")

    def missing() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    assert nvml_memory(0) is None


def test_nvml_not_installed_gives_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    assert nvml_memory(0) is None


def _fake_pynvml(processes: list[tuple[int, int]], fail_processes: bool = False) -> SimpleNamespace:
    """A stand-in NVML with one device per index: 10 GiB used of 80, the given (pid, bytes) compute processes."""

    class NVMLError(Exception):
        pass

    def processes_of(handle):
        if fail_processes:
            raise NVMLError("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes]

    def by_uuid(uuid):
        raise NVMLError("Not Found")

    return SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetHandleByIndex=lambda index: f"handle-{index}",
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=10 * GIB, total=80 * GIB, handle=handle),
        nvmlDeviceGetComputeRunningProcesses=processes_of,
    )


def test_nvml_reading_picks_this_process_and_maps_visible_devices(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("uses a stand-in NVML; the real one is tested on GPU machines")
    handles: list[str] = []
    fake = _fake_pynvml([(os.getpid(), 3 * GIB), (os.getpid() + 1, 5 * GIB)])
    real_index = fake.nvmlDeviceGetHandleByIndex
    fake.nvmlDeviceGetHandleByIndex = lambda index: handles.append(real_index(index)) or handles[-1]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    reading = nvml_memory(1)
    assert handles == ["handle-5"]  # torch's device 1 is the driver's device 5
    assert reading.process_used_bytes == 3 * GIB  # only this pid
    assert reading.device_used_bytes == 10 * GIB and reading.device_total_bytes == 80 * GIB
    # Where the driver cannot list processes, the device figures still come back.
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], fail_processes=True))
    partial = nvml_memory(0)
    assert partial.process_used_bytes is None and partial.device_used_bytes == 10 * GIB


def test_nvml_on_a_machine_without_a_driver_gives_none():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA driver")
    assert nvml_memory(0) is None


@pytest.mark.gpu
def test_cuda_probe_tracks_allocations_and_resets():
    probe = probe_for("cuda")
    assert isinstance(probe, CudaProbe)
    torch.cuda.synchronize()
    probe.reset_peak()
    base = probe.current_bytes()
    block = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    during = probe.current_bytes()
    assert during - base >= 256 * MIB
    del block
    assert probe.peak_bytes() >= during
    assert probe.peak_reserved_bytes() >= probe.peak_bytes()
    probe.reset_peak()
    assert probe.peak_bytes() < during
    retries, ooms = probe.counters()
    assert isinstance(retries, int) and retries >= 0
    assert isinstance(ooms, int) and ooms >= 0


@pytest.mark.gpu
def test_nvml_sees_the_device_memory():
    pytest.importorskip("pynvml")
    block = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    reading = nvml_memory(torch.cuda.current_device())
    if reading is None:
        pytest.skip("NVML not usable on this machine")
    assert reading.device_total_bytes > reading.device_used_bytes >= torch.cuda.memory_reserved()
    if reading.process_used_bytes is not None:  # None where the driver lists host pids (containers)
        assert reading.process_used_bytes >= block.numel()
