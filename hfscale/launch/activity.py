"""What else the machine was doing while a trial ran, so that a figure measured on a busy machine says so.

A step time measured while another job shares the cores or the GPU is a fact about both jobs, not about the
strategy. The sweep's driver samples the machine from outside the trial (so the trial itself is not disturbed)
once a second: the load average, the CPU time the hypervisor stole, the CPU time of every process that is not the
trial's (its process group) nor the driver's, and on a GPU machine NVML's view of each visible device: processes
that are not the trial's, SM clocks, throttle reasons, temperature, power and the energy counter. The record goes
into the row (:class:`MachineActivity`); :func:`disturbances` says, in sentences, what makes a row's speed
figures unreliable, and the report flags such a row ("may be unstable", as pyperf does) and does not recommend it
on speed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from hfscale.records.activity import BUSY_CORES, BUSY_STEAL, GpuActivity, MachineActivity, disturbances

logger = logging.getLogger(__name__)

# Reasons that are not a slowdown: an idle GPU, clocks set on purpose (application / user-defined clocks are one
# bit, which pynvml names both ways), the display's clock setting.
_THROTTLE_OK = ("gpu_idle", "applications_clocks_setting", "user_defined_clocks", "display_clock_setting", "none")


class ActivitySampler:
    """Samples the machine in a daemon thread from :meth:`start` to :meth:`stop`, which returns the record.

    ``trial_pgid`` is the trial's process group: its processes (and this process) are not "other" processes.
    Sampling costs a walk over the process table once a second (a few milliseconds); it never raises: whatever
    cannot be read is left None.
    """

    def __init__(self, trial_pgid: int | None = None, *, interval_s: float = 1.0) -> None:
        self.trial_pgid = trial_pgid
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._trial_pids: set[int] = set()
        self._thread: threading.Thread | None = None
        self._cpu_seen: dict[int, tuple[float, str]] = {}
        self._other: list[tuple[float, float]] = []
        """(CPU seconds of other processes, wall seconds) of each sample's window."""
        self._last_sample = 0.0
        self._busy: dict[int, tuple[str, float]] = {}
        self._loads: list[float] = []
        self._gpu: dict[int, dict[str, Any]] = {}
        self._start_wall = 0.0
        self._start_times: Any = None

    def start(self, trial_pgid: int | None = None) -> ActivitySampler:
        if trial_pgid is not None:
            self.trial_pgid = trial_pgid
        self._start_wall = self._last_sample = time.monotonic()
        self._start_times = _cpu_times()
        self._read_processes(first=True)
        self._read_gpus()  # the energy counter from the start, not from the first sample a second later
        self._thread = threading.Thread(target=self._run, name="hfscale-activity", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MachineActivity:
        """End the sampling; the record of what was seen (no samples when :meth:`start` never ran)."""
        self._stop.set()
        if self._thread is None:
            return MachineActivity(samples=0, duration_s=0.0, cpu_count=os.cpu_count() or 1)
        self._thread.join(timeout=5)
        # ... and to the end: the last part-window counts too where it is at least half a window (a few
        # milliseconds' remainder says nothing of a core's use), and never beside a sampler thread still running.
        if not self._thread.is_alive() and time.monotonic() - self._last_sample >= self.interval_s / 2:
            with contextlib.suppress(Exception):
                self._sample()
        duration = time.monotonic() - self._start_wall
        busy = sorted(self._busy.items(), key=lambda kv: -kv[1][1])[:5]
        windows = self._other
        # Time-weighted: a window stretched by a busy machine (the thread woke late) weighs what it lasted.
        wall = sum(w for _, w in windows)
        return MachineActivity(
            samples=len(windows),
            duration_s=duration,
            cpu_count=os.cpu_count() or 1,
            load_avg_max=max(self._loads) if self._loads else None,
            steal_fraction=_steal_fraction(self._start_times, _cpu_times()),
            other_cores_mean=sum(cpu for cpu, _ in windows) / wall if wall > 0 else None,
            other_cores_max=max((cpu / w for cpu, w in windows), default=None),
            busy_processes=[
                f"{name} ({pid}): {seconds / max(duration, 1e-9):.0%} of a core" for pid, (name, seconds) in busy
            ],
            gpus=[_gpu_record(index, seen) for index, seen in sorted(self._gpu.items())],
        )

    # -- sampling ------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception as exc:  # sampling must never end a trial
                logger.debug("activity sample failed: %s", exc)

    def _sample(self) -> None:
        with contextlib.suppress(OSError):
            self._loads.append(os.getloadavg()[0])
        now = time.monotonic()
        wall, self._last_sample = now - self._last_sample, now
        if wall > 0:  # the window as it lasted, not as it was asked for (a loaded machine wakes this thread late)
            self._other.append((self._read_processes(), wall))
        self._read_gpus()

    def _ours(self, pid: int) -> bool:
        """This process, or one of the trial's: in its process group, or a descendant of its launcher (torchrun
        starts its workers in sessions of their own)."""
        if pid == os.getpid():
            return True
        if self.trial_pgid is None:
            return False
        if pid in self._trial_pids:
            return True
        try:
            if os.getpgid(pid) == self.trial_pgid:
                return True
            import psutil

            if any(parent.pid == self.trial_pgid for parent in psutil.Process(pid).parents()):
                self._trial_pids.add(pid)
                return True
        except Exception:  # gone meanwhile, or psutil missing: not the trial's
            return False
        return False

    def _read_processes(self, *, first: bool = False) -> float:
        """CPU seconds used by other processes since the last call (their new processes counted from birth)."""
        try:
            import psutil
        except ImportError:
            return 0.0
        used = 0.0
        seen: dict[int, tuple[float, str]] = {}
        for proc in psutil.process_iter(["pid", "name", "cpu_times"]):
            info = proc.info
            times = info.get("cpu_times")
            if times is None or self._ours(info["pid"]):
                continue
            total = float(times.user + times.system)
            seen[info["pid"]] = (total, info.get("name") or "?")
            if first:
                continue
            before = self._cpu_seen.get(info["pid"], (0.0, ""))[0]
            delta = max(total - before, 0.0)
            used += delta
            if delta > 0:
                name, so_far = self._busy.get(info["pid"], (seen[info["pid"]][1], 0.0))
                self._busy[info["pid"]] = (name, so_far + delta)
        self._cpu_seen = seen
        return used

    def _read_gpus(self) -> None:
        for index, reading in _nvml_readings(self._ours):
            seen = self._gpu.setdefault(
                index, {"clocks": [], "temps": [], "powers": [], "reasons": set(), "others": set()}
            )
            for key, target in (("clock", "clocks"), ("temperature", "temps"), ("power_w", "powers")):
                if reading.get(key) is not None:
                    seen[target].append(reading[key])
            seen["reasons"] |= set(reading.get("reasons", ()))
            seen["others"] |= set(reading.get("others", ()))
            if reading.get("energy_mj") is not None:
                seen.setdefault("energy_first", reading["energy_mj"])
                seen["energy_last"] = reading["energy_mj"]


def _cpu_times() -> Any:
    try:
        import psutil

        return psutil.cpu_times()
    except Exception:
        return None


def _steal_fraction(before: Any, after: Any) -> float | None:
    if before is None or after is None or not hasattr(after, "steal"):
        return None
    total = sum(after) - sum(before)
    return (after.steal - before.steal) / total if total > 0 else None


def _gpu_record(index: int, seen: dict[str, Any]) -> GpuActivity:
    energy = None
    if "energy_first" in seen:
        energy = (seen["energy_last"] - seen["energy_first"]) / 1000
    return GpuActivity(
        index=index,
        other_processes=sorted(seen["others"]),
        sm_clock_mhz_min=min(seen["clocks"]) if seen["clocks"] else None,
        sm_clock_mhz_max=max(seen["clocks"]) if seen["clocks"] else None,
        throttle_reasons=sorted(seen["reasons"]),
        temperature_c_max=max(seen["temps"]) if seen["temps"] else None,
        power_w_mean=sum(seen["powers"]) / len(seen["powers"]) if seen["powers"] else None,
        energy_j=energy,
    )


def _visible_nvml_indices(count: int) -> Sequence[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return range(count)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return [int(e) for e in entries if e.isdigit() and int(e) < count]


def _nvml_readings(ours: Any) -> list[tuple[int, dict[str, Any]]]:
    """One reading per visible device; empty where NVML is not usable (no pynvml, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    readings = []
    try:
        for index in _visible_nvml_indices(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            readings.append((index, _read_device(pynvml, handle, ours)))
    except Exception as exc:
        logger.debug("NVML reading failed: %s", exc)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return readings


def _read_device(pynvml: Any, handle: Any, ours: Any) -> dict[str, Any]:
    def read(fn: Any, *args: Any) -> Any:
        try:
            return fn(handle, *args)
        except Exception:
            return None

    reading: dict[str, Any] = {
        "clock": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        "temperature": read(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        "energy_mj": read(pynvml.nvmlDeviceGetTotalEnergyConsumption),
    }
    power = read(pynvml.nvmlDeviceGetPowerUsage)
    reading["power_w"] = power / 1000 if power is not None else None
    mask = read(pynvml.nvmlDeviceGetCurrentClocksEventReasons) or read(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
    reading["reasons"] = _throttle_names(pynvml, mask or 0)
    procs = (read(pynvml.nvmlDeviceGetComputeRunningProcesses) or []) + (
        read(pynvml.nvmlDeviceGetGraphicsRunningProcesses) or []
    )
    reading["others"] = [p.pid for p in procs if not ours(p.pid)]
    return reading


def _throttle_names(pynvml: Any, mask: int) -> list[str]:
    names = []
    for attr in dir(pynvml):
        for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
            if attr.startswith(prefix) and attr not in (prefix + "All", prefix + "None"):
                bit = getattr(pynvml, attr)
                name = _snake(attr[len(prefix) :])
                if isinstance(bit, int) and bit and mask & bit and name not in _THROTTLE_OK and name not in names:
                    names.append(name)
    return names


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


__all__ = ["BUSY_CORES", "BUSY_STEAL", "ActivitySampler", "GpuActivity", "MachineActivity", "disturbances"]
