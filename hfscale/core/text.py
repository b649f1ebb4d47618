"""Text as the tool prints it: one line, cut to a width; a list as a sentence; a duration as a clock."""

from __future__ import annotations


def short(text: str, limit: int = 100) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def listed(items: list[str]) -> str:
    """``a, b and c``: items as a sentence names them.

    Raises:
        ValueError: for no items (a sentence naming nothing is the caller's to word).
    """
    if not items:
        raise ValueError("listed() needs at least one item")
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def clock(seconds: float) -> str:
    """``1:02:03``: a duration in hours, minutes and seconds (whole seconds, rounded down)."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"
