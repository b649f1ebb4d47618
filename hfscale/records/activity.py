"""What else the machine was doing while a trial ran, as the row records it, and what makes its speed unreliable.

The sampler that fills it runs in the sweep's driver (:mod:`hfscale.launch.activity`); the report reads only this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BUSY_CORES = 0.25
"""Other processes using more than a quarter of a core on average make the CPU figures unreliable."""


BUSY_STEAL = 0.05
"""More than 5% of the CPU time stolen by the hypervisor makes them unreliable too."""


@dataclass(frozen=True, kw_only=True)
class GpuActivity:
    """One device while the trial ran, from NVML."""

    index: int
    """NVML's index of the device."""
    other_processes: list[int] = field(default_factory=list)
    """Pids NVML lists on the device that are not the trial's."""
    sm_clock_mhz_min: int | None = None
    sm_clock_mhz_max: int | None = None
    throttle_reasons: list[str] = field(default_factory=list)
    """Every clock-throttle reason seen (thermal, power cap, ...), idle and application clocks left out."""
    temperature_c_max: int | None = None
    power_w_mean: float | None = None
    energy_j: float | None = None
    """Energy the device used over the trial (the driver's counter, where the GPU has one)."""


@dataclass(frozen=True, kw_only=True)
class MachineActivity:
    """What else the machine was doing during one trial: the means and maxima of samples taken once a second."""

    samples: int
    """How many windows the machine was sampled over (0: the trial was too short for one; the last may be as short
    as half a window)."""
    duration_s: float
    cpu_count: int
    load_avg_max: float | None = None
    """Largest 1-minute load average seen (the trial's own processes included)."""
    steal_fraction: float | None = None
    """Share of all CPU time the hypervisor stole over the trial; None where the kernel does not count it."""
    other_cores_mean: float | None = None
    """Cores used on average by processes that are neither the trial's nor the sweep driver's."""
    other_cores_max: float | None = None
    """The largest figure of one sampling window (about a second) of the same."""
    busy_processes: list[str] = field(default_factory=list)
    """The other processes that used the most CPU, as ``name (pid): N% of a core`` (at most 5)."""
    gpus: list[GpuActivity] = field(default_factory=list)


def disturbances(activity: MachineActivity | None) -> list[str]:
    """Why a trial's speed figures may be unreliable, one sentence each; empty when nothing was seen."""
    if activity is None or activity.samples == 0:
        return []
    found = others_busy(activity)
    if activity.steal_fraction is not None and activity.steal_fraction > BUSY_STEAL:
        found.append(f"the hypervisor stole {activity.steal_fraction:.0%} of the CPU time")
    for gpu in activity.gpus:
        if gpu.throttle_reasons:
            found.append(f"GPU {gpu.index} throttled its clocks ({', '.join(gpu.throttle_reasons)})")
    return found


def others_busy(activity: MachineActivity | None) -> list[str]:
    """The part of :func:`disturbances` that other processes caused (busy cores, a shared GPU), as against what the
    machine itself did (stolen CPU time, throttled clocks): a noise floor leaves out the first and keeps the second,
    which is the drift it measures."""
    if activity is None or activity.samples == 0:
        return []
    found = []
    if activity.other_cores_mean is not None and activity.other_cores_mean > BUSY_CORES:
        who = f" ({', '.join(activity.busy_processes[:3])})" if activity.busy_processes else ""
        found.append(
            f"other processes used {activity.other_cores_mean:.2f} of {activity.cpu_count} cores on average{who}"
        )
    for gpu in activity.gpus:
        if gpu.other_processes:
            pids = ", ".join(str(p) for p in gpu.other_processes[:5])
            found.append(f"GPU {gpu.index} was shared with other processes (pids {pids})")
    return found
