"""Files and times: one atomic write, one UTC timestamp, so every record on disk is whole and stamped alike."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path


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
