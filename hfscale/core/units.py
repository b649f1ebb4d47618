"""Units: bytes in a GiB, memory sizes as users write them (``16GiB``, ``80GB``), shares (``15%``) and noise floors."""

from __future__ import annotations

import re
from pathlib import Path

GIB = 2**30
"""Bytes in a GiB; every ``*_gib`` figure is bytes / GIB."""

MIB = 2**20
"""Bytes in a MiB."""


def to_gib(num_bytes: float | None) -> float | None:
    """Bytes to GiB, passing None through."""
    return None if num_bytes is None else num_bytes / GIB


_UNITS: dict[str, int] = {
    "tib": 2**40,
    "gib": 2**30,
    "mib": 2**20,
    "tb": 10**12,
    "gb": 10**9,
    "mb": 10**6,
}
_UNIT_NAMES = "TiB, GiB, MiB (powers of 2) or TB, GB, MB (powers of 10)"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*$")


def parse_memory_size(text: str) -> int:
    """Bytes in a memory size written with its unit: ``16GiB``, ``16 GB``, ``512MiB``, ``1.5TiB`` (case ignored).

    Raises:
        ValueError: when the text is not a positive number followed by one of TiB, GiB, MiB, TB, GB, MB; a bare
            number is refused because GiB and GB differ by 7 %.
    """
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size: expected a number and a unit, e.g. 16GiB, 80GB or "
            f"512MiB; units: {_UNIT_NAMES}"
        )
    size = float(match.group(1)) * _UNITS[unit]
    if size <= 0:
        raise ValueError(f"cannot read {text!r} as a memory size: it must be greater than zero")
    return int(size)


_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*$")


def parse_share(text: str) -> float | None:
    """The fraction a share is written as: ``0.15`` or ``15%`` give 0.15; None when ``text`` is neither (a caller
    may then read it as something else, such as a path)."""
    match = _SHARE_RE.match(str(text))
    if not match:
        return None
    return float(match.group(1)) / (100 if match.group(2) else 1)


def noise_floor_spec(value: object, base: Path, *, must_exist: bool = True) -> str:
    """A noise floor as the settings record it: a figure's fraction (``"0.15"``), or a run folder's absolute path
    (a relative one is read from ``base``; ``must_exist=False`` leaves checking the folder to the sweep, as a
    recipe's copy inside its own run folder, read again on ``--resume``, no longer sits beside the grid it names).

    Raises:
        ValueError: for a figure outside (0, 1), a path that is not a run folder, or text that reads as both (a run
            folder named ``0.2``: ``./0.2`` is the folder, ``20%`` the figure).
    """
    share = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else parse_share(str(value))
    if share is not None and isinstance(value, str) and (base / value.strip() / "results.jsonl").is_file():
        raise ValueError(
            f"{value!r} reads as a figure and names a run folder in {base}: write ./{value.strip()} for the folder; "
            f"the figure reads the same as {share:g} or {share:.0%} (whichever names no folder)"
        )
    if share is not None:
        if not 0 < share < 1:
            raise ValueError(f"expected a run-to-run noise between 0 and 1 (0.15 or 15%), got {value!r}")
        return repr(share)
    folder = (base / str(value)).resolve()
    if must_exist and not (folder / "results.jsonl").is_file():
        raise ValueError(
            f"expected a run-to-run noise (0.15 or 15%) or the run folder of an earlier sweep on this machine (with "
            f"its results.jsonl), got {value!r}"
        )
    return str(folder)
