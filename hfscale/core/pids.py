"""Processes by pid: whether one still runs, and waiting for one to exit without racing pid reuse."""

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
