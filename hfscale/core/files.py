"""Files and times: one atomic write, one UTC timestamp, so every record on disk is whole and stamped alike; and
whether a folder can be written at all, found before the work rather than after it."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger(__name__)


def utc_now() -> str:
    """Now, in UTC, as ISO 8601 to the second: the timestamp every record carries."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def utc_from_epoch(seconds: float) -> str:
    """A Unix time as :func:`utc_now` writes it."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="seconds")


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a sibling temporary file, then renamed over ``path``.

    A reader (another machine's driver, a report on a live run) sees the old file or the new one, never half of one;
    a crash leaves at most the temporary file. The rename is atomic within one file system (POSIX ``rename``).
    Text is written as UTF-8; bytes as they are (a file rewritten from the lines it held keeps them byte for byte).

    Args:
        fsync: flush the temporary file to the disk before the rename, so that after a power loss the file is the
            new one, whole, or the old one (costs one disk flush; for records that cannot be written again).
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def os_error_text(exc: OSError) -> str:
    """``PATH: Not a directory``: the path the system refused and why, for a one-line error (``str(exc)`` carries
    the errno too)."""
    return f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)


LOW_SPACE_BYTES = 256 * 2**20
"""Free space below which :func:`check_writable` warns: a sweep that fills its disk stops there."""


def check_writable(folders: tuple[Path, ...]) -> int | None:
    """Write, sync and remove a small file in each of ``folders`` (made where missing), so that a read-only or full
    disk is found before work starts rather than after it. Returns the free bytes in the first (None where
    unknown); below :data:`LOW_SPACE_BYTES` a warning is logged.

    Raises:
        OSError: from the first that cannot be written (its ``filename`` names the path).
    """
    for folder in folders:
        probe = folder / ".write-check"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as fh:
                fh.write(b"hfscale checks that this folder can be written\n" * 64)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            if exc.filename is None:  # a failed write or sync names no path: the probe's (or its missing folder)
                exc.filename = str(probe if folder.is_dir() else folder)
            raise
        finally:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
    try:
        free = shutil.disk_usage(folders[0]).free
    except OSError:
        return None
    if free < LOW_SPACE_BYTES:
        logger.warning("%s: only %.0f MiB free; a sweep that fills it stops there", folders[0], free / 2**20)
    return free


def file_in_the_way(folder: Path) -> Path | None:
    """The file (or broken link) that ``folder`` is or lies under (``mkdir`` then says "exists" or "not a
    directory"), or None."""
    for above in (folder, *folder.parents):
        if above.exists():
            return None if above.is_dir() else above
        if above.is_symlink():
            return above  # a link to nothing
    return None
