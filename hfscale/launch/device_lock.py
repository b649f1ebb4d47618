"""Per-device locks: two sweeps on one machine take turns on a device instead of measuring each other.

A trial holds one lock per device it uses (``cuda0``, ``cuda1``, ... by the physical index or UUID its
``CUDA_VISIBLE_DEVICES`` names, or ``cpu`` for a CPU trial) for as long as its process group runs. The locks are
``flock`` files (through :mod:`filelock`) in one folder per machine, shared by every user: ``$HFSCALE_LOCK_DIR``,
else ``hfscale-locks`` in the system's temporary folder. The kernel releases an ``flock`` when its holder dies,
however it dies, so a killed sweep never leaves a lock to delete by hand. The holder writes who it is (pid, host,
run folder, trial, since when) into the file, for the message a waiting sweep prints.

A sweep that finds a device taken waits (a progress line names the holder and, every minute, how long it has
waited), and after ``wait_s`` refuses (:class:`DeviceBusyError`); with ``share=True`` (``HFSCALE_DEVICE_LOCK=share``)
it does not wait and runs next to the holder, and the row says with whom (``LaunchRecord.device_shared_with``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hfscale.core.files import utc_now

if TYPE_CHECKING:
    from filelock import FileLock

logger = logging.getLogger(__name__)

LOCK_DIR_ENV = "HFSCALE_LOCK_DIR"
"""The folder of the lock files (default: ``hfscale-locks`` in the system's temporary folder)."""
WAIT_ENV = "HFSCALE_DEVICE_WAIT_S"
"""Seconds to wait for a device before refusing (default :data:`DEFAULT_WAIT_S`)."""
MODE_ENV = "HFSCALE_DEVICE_LOCK"
"""``wait`` (default): take turns; ``share``: run next to another sweep's trial, recorded in the row."""
DEFAULT_WAIT_S = 6 * 3600.0
"""Long enough for another sweep's trial to end (a trial's default time limit is far shorter)."""
REPORT_EVERY_S = 60.0


class DeviceBusyError(RuntimeError):
    """A device stayed held by another sweep for longer than the sweep would wait."""


@dataclass(frozen=True, kw_only=True)
class DeviceHold:
    """How a trial got its devices."""

    devices: tuple[str, ...]
    waited_s: float | None
    """Seconds spent waiting for the locks; None when none were taken (shared, or the lock folder is unusable)."""
    shared_with: list[str] | None = None
    """Holders of these devices the trial ran next to (``share``), or why the devices could not be locked; None
    when it had them to itself."""


def lock_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "hfscale-locks")


def trial_devices(device: str, processes_here: int, env: Mapping[str, str]) -> tuple[str, ...]:
    """The lock names of the devices a trial's processes on this machine use: ``cpu``, or one ``cudaN`` per
    process (``N`` as ``CUDA_VISIBLE_DEVICES`` in ``env`` names it: an index or a UUID)."""
    if device != "cuda":
        return ("cpu",)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    if not names:
        names = [str(i) for i in range(max(processes_here, 1))]
    return tuple(f"cuda{name}" for name in names[: max(processes_here, 1)])


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return (
            f"pid {holder['pid']} on {holder['host']}, run folder {holder['run_dir']}, trial {holder['trial']}, "
            f"since {holder['since']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that did not say who it is"


def _open_dir(path: Path) -> None:
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            path.chmod(0o1777)  # every user's sweeps share it, as /tmp itself


def _default_wait_s() -> float:
    raw = os.environ.get(WAIT_ENV)
    try:
        wait_s = float(raw) if raw else DEFAULT_WAIT_S
    except ValueError:
        wait_s = math.nan
    if math.isnan(wait_s) or wait_s < 0:  # inf: wait as long as it takes
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected a number of seconds, 0 or more (inf: no limit)")
    return wait_s


def check_lock_environment() -> None:
    """Read ``$HFSCALE_DEVICE_WAIT_S`` and ``$HFSCALE_DEVICE_LOCK`` as a trial will, so that a sweep refuses a bad
    value before anything runs rather than at its first trial's lock.

    Raises:
        ValueError: naming the variable, its value and what is valid.
    """
    _default_wait_s()
    _default_share()


def _default_share() -> bool:
    mode = os.environ.get(MODE_ENV, "wait").strip().lower()
    if mode not in ("wait", "share"):
        raise ValueError(f"{MODE_ENV}={mode!r}: expected 'wait' or 'share'")
    return mode == "share"


@contextlib.contextmanager
def hold_devices(
    devices: Sequence[str],
    *,
    run_dir: str | os.PathLike[str],
    trial: str,
    wait_s: float | None = None,
    share: bool | None = None,
    progress: Callable[[str], None] = logger.info,
    directory: Path | None = None,
) -> Iterator[DeviceHold]:
    """Hold the locks of ``devices`` for the ``with`` block (taken in sorted order, so two sweeps never deadlock).

    Args:
        devices: lock names (:func:`trial_devices`).
        run_dir, trial: who holds them, written into the lock files for another sweep's message.
        wait_s: how long to wait for a taken device (default ``$HFSCALE_DEVICE_WAIT_S`` or
            :data:`DEFAULT_WAIT_S`).
        share: run next to a holder instead of waiting (default ``$HFSCALE_DEVICE_LOCK == "share"``).
        progress: receives the waiting lines.
        directory: the lock folder (default :func:`lock_dir`).

    Raises:
        DeviceBusyError: when a device is still held after ``wait_s``; nothing is held then.
    """
    from filelock import FileLock

    wait_s = _default_wait_s() if wait_s is None else wait_s
    share = _default_share() if share is None else share
    folder = directory or lock_dir()
    try:
        _open_dir(folder)
    except OSError as exc:
        logger.warning("cannot use the device lock folder %s (%s); running without a device lock", folder, exc)
        yield DeviceHold(devices=tuple(devices), waited_s=None, shared_with=[f"unknown: lock folder {folder}: {exc}"])
        return
    held: list[FileLock] = []
    shared: list[str] = []
    start = time.monotonic()
    try:
        for device in sorted(set(devices)):
            lock = FileLock(folder / f"{device}.lock", mode=0o666)
            if not _take(lock, device, share=share, since=start, wait_s=wait_s, progress=progress):
                shared.append(_holder(Path(lock.lock_file)))
                continue
            held.append(lock)
            _sign(Path(lock.lock_file), run_dir=run_dir, trial=trial)
        waited_s = time.monotonic() - start
        if shared:
            progress(f"running next to another sweep on the same device ({'; '.join(shared)})")
        yield DeviceHold(devices=tuple(devices), waited_s=round(waited_s, 3), shared_with=shared or None)
    finally:
        for lock in reversed(held):
            with contextlib.suppress(OSError), open(lock.lock_file, "r+", encoding="utf-8") as fh:
                fh.truncate(0)
            lock.release()


def _take(
    lock: FileLock, device: str, *, share: bool, since: float, wait_s: float, progress: Callable[[str], None]
) -> bool:
    """Take ``lock`` (waiting for its holder at most ``wait_s`` from ``since``); False when it is held and the
    trial is to run next to its holder (``share``).

    Raises:
        DeviceBusyError: when it is still held after ``wait_s``.
    """
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
        return True
    except Timeout:
        if share:
            return False
    path = Path(lock.lock_file)
    progress(f"device {device} is in use by another sweep ({_holder(path)}); waiting for it")
    next_report = time.monotonic() + REPORT_EVERY_S
    while True:
        try:
            lock.acquire(timeout=1.0)
            return True
        except Timeout:
            waited = time.monotonic() - since
            if waited >= wait_s:
                raise DeviceBusyError(
                    f"device {device} is still in use after {waited:.0f} s ({_holder(path)}); "
                    f"nothing of this trial ran (wait longer with {WAIT_ENV}, or run next to it with "
                    f"{MODE_ENV}=share)"
                ) from None
            if time.monotonic() >= next_report:
                progress(f"device {device}: still waiting ({waited:.0f} s), {_holder(path)}")
                next_report = time.monotonic() + REPORT_EVERY_S


def _sign(path: Path, *, run_dir: str | os.PathLike[str], trial: str) -> None:
    """Write who holds the lock into its file, for another sweep's waiting line. The file is rewritten in place,
    never replaced: the lock is an ``flock`` on this very file, and a renamed-in copy would be another file."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "run_dir": str(Path(run_dir).resolve()),
          "trial": trial, "since": utc_now()}  # fmt: skip
    with contextlib.suppress(OSError), open(path, "r+", encoding="utf-8") as fh:  # never truncated on open
        fh.truncate(0)
        fh.write(json.dumps(me) + "\n")


__all__ = [
    "DEFAULT_WAIT_S",
    "LOCK_DIR_ENV",
    "MODE_ENV",
    "WAIT_ENV",
    "DeviceBusyError",
    "DeviceHold",
    "check_lock_environment",
    "hold_devices",
    "lock_dir",
    "trial_devices",
]
