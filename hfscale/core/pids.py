"""Processes by pid: whether one still runs, when it started, and waiting for one to exit without racing pid reuse."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


def wait_for_exit(pid: int, poll_s: float) -> None:
    """Return once ``pid`` has exited: through a pidfd (Linux 5.3+: readable on exit, immune to pid reuse), else
    by polling every ``poll_s`` seconds."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):
        while pid_alive(pid):
            time.sleep(poll_s)
        return
    try:
        select.select([pidfd], [], [])
    finally:
        os.close(pidfd)


def started_at(pid: int | str = "self") -> float | None:
    """Epoch time ``pid`` started, to the kernel's clock tick (10 ms); None without Linux's ``/proc``.

    Read as its start on the boot clock (``/proc/PID/stat``'s ``starttime``) against that clock now, not as the boot
    time plus the start, as ``psutil.Process().create_time()`` does: ``/proc/stat``'s boot time is whole seconds,
    so that figure is early by the boot time's fraction of a second, the same for every process until a reboot
    (0.64 s on the machine where this was found, 2026-11-27: every trial's ``startup`` and ``total`` read that much
    too long).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rfind(")") + 2 :].split()[19])  # field 22, counted from the state (field 3)
        boot_now, now = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return now - (boot_now - ticks / os.sysconf("SC_CLK_TCK"))
