"""Text as the tool prints it: one line, cut to a width."""

from __future__ import annotations


def short(text: str, limit: int = 100) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"
