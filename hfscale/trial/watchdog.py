"""The trial's watchdog: a trial's process group must not outlive the sweep's driver that started it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping

from hfscale.core.pids import wait_for_exit

logger = logging.getLogger(__name__)


DRIVER_PID_ENV = "HFSCALE_DRIVER_PID"
"""Set in every group's environment: the pid of the process that started it (the sweep's driver), which the
trial's watchdog (:func:`watch_driver`) watches."""


def _end_own_group(driver: int, poll_s: float) -> None:
    wait_for_exit(driver, poll_s)
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(
            f"hfscale: the sweep's driver (pid {driver}) is gone; ending this trial's process group {os.getpgrp()}\n"
        )
        sys.stderr.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)


def watch_driver(*, env: Mapping[str, str] | None = None, poll_s: float = 1.0) -> threading.Thread | None:
    """In a process of a trial's group: SIGKILL the whole group (launcher and every worker) as soon as the driver
    that started it (:data:`DRIVER_PID_ENV`) is gone, however it went (SIGKILL, the OOM killer, a lost node agent).

    Without it a trial outlives a killed sweep (it runs in its own session) and a ``--resume`` started meanwhile
    measures next to it. A parent-death signal would not do: it reaches only the launcher, not the workers the
    launcher started. A daemon thread, blocked on a pidfd (no polling where the kernel has them).

    Returns the thread, or None when there is no driver to watch (run by hand, or in the driver's own group,
    which it must never kill).
    """
    value = (os.environ if env is None else env).get(DRIVER_PID_ENV)
    if not value:
        return None
    try:
        driver = int(value)
    except ValueError:
        logger.warning("%s=%r is not a pid; the trial will not stop with its driver", DRIVER_PID_ENV, value)
        return None
    with contextlib.suppress(OSError):
        if driver == os.getpid() or os.getpgid(driver) == os.getpgrp():
            return None
    thread = threading.Thread(target=_end_own_group, args=(driver, poll_s), name="hfscale-watchdog", daemon=True)
    thread.start()
    return thread
