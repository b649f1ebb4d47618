"""A process spinning on a core beside a run, and whether the run's activity record names it.

The record names at most the five busiest other processes (:mod:`hfscale.launch.activity`). Beside the suite's
other work (its workers, a two-machine trial's ranks, a Slurm cluster's sweep) five others can be as busy as the
hog on two cores, so a test accepts that in its place.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class CpuShare:
    """The share of a core a process used from :meth:`start` to :meth:`stop`."""

    pid: int
    share: float = 0.0
    _before: tuple[float, float] = field(default=(0.0, 0.0), repr=False)

    def start(self) -> CpuShare:
        self._before = (sum(psutil.Process(self.pid).cpu_times()[:2]), time.monotonic())
        return self

    def stop(self) -> float:
        cpu, wall = sum(psutil.Process(self.pid).cpu_times()[:2]), time.monotonic()
        self.share = (cpu - self._before[0]) / max(wall - self._before[1], 1e-9)
        return self.share


def assert_named_or_outranked(busy_processes: list[str], pid: int, share: float) -> None:
    """``pid`` is among ``busy_processes`` (``name (pid): N% of a core``), or five others each used at least about
    its ``share`` of a core."""
    named = {
        int(re.search(r"\((\d+)\)", p)[1]): int(re.search(r"(\d+)% of a core", p)[1]) / 100 for p in busy_processes
    }
    if pid not in named:
        assert len(named) == 5 and min(named.values()) >= share - 0.1, (busy_processes, share)
