"""A process spinning on a core beside a run, and whether the run's activity record names it.

The record names at most the five busiest other processes (:mod:`hfscale.launch.activity`). Beside the suite's
other work (its workers, a two-machine trial's ranks, a Slurm cluster's sweep) five others can be as busy as the
hog on two cores, so a test accepts that in its place.
"""

from __future__ import annotations

import re
import time

import psutil

MIN_SHARE = 0.15
"""The least share of a core the hog must get for the test to mean anything: a process spinning on one of two
cores beside the suite's three workers and a two-rank trial still gets about a quarter."""


class CpuShare:
    """The share of a core a process has used since this was made."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._cpu, self._wall = self._now()

    def _now(self) -> tuple[float, float]:
        return sum(psutil.Process(self.pid).cpu_times()[:2]), time.monotonic()

    def so_far(self) -> float:
        cpu, wall = self._now()
        return (cpu - self._cpu) / max(wall - self._wall, 1e-9)


def assert_named_or_outranked(busy_processes: list[str], pid: int, share: float) -> None:
    """``pid`` is among ``busy_processes`` (``name (pid): N% of a core``), or five others each used at least about
    its ``share`` of a core. Not named, a hog that got less than :data:`MIN_SHARE` of a core was not busy enough to
    show anything: the test fails rather than pass on five idle others."""
    named = {
        int(re.search(r"\((\d+)\)", p)[1]): int(re.search(r"(\d+)% of a core", p)[1]) / 100 for p in busy_processes
    }
    if pid not in named:
        assert share >= MIN_SHARE, f"the hog got {share:.0%} of a core: starved, its absence shows nothing"
        assert len(named) == 5 and min(named.values()) >= share - 0.1, (busy_processes, share)
