"""Units: bytes in a GiB, and memory sizes as users write them (``16GiB``, ``80GB``)."""

from __future__ import annotations

import re

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
