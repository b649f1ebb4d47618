"""What reading a run folder's ``results.jsonl`` found: its rows and the lines that are not rows (records the storage
floor returns, kept at the bottom floor with the rows themselves)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hfscale.records.row import TrialResult


@dataclass(frozen=True, kw_only=True)
class BadLine:
    """A line of ``results.jsonl`` that is not a valid row (a disk error, a hand edit, a torn write)."""

    number: int
    """1-based line number in ``results.jsonl``."""
    text: str
    """The line as read (without its newline)."""
    error: str
    """Why it is not a row."""


@dataclass(frozen=True, kw_only=True)
class RowScan:
    """What ``results.jsonl`` holds: the rows (the latest of each (trial, repeat), in first-written order) and
    the lines that are not rows."""

    rows: list[TrialResult] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)
    torn_tail: bool = False
    """The last line has no newline: a sweep was killed while writing it (it is not counted as a row)."""


__all__ = ["BadLine", "RowScan"]
