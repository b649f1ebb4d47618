"""Step timers for :class:`~hfscale.callbacks.ThroughputCallback`, and the percentile of its step times.

Timing never synchronises the device on a step: on CUDA, events are recorded at step boundaries and read when they
have completed (polled every few dozen steps, waited for once at the end); on CPU, ``time.perf_counter``.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any


class _PerfCounterTimer:
    """Wall-clock step boundaries (CPU training): ``time.perf_counter`` at each mark."""

    kind = "perf_counter"

    def __init__(self) -> None:
        self._marks: list[float] = []

    def mark(self) -> None:
        self._marks.append(time.perf_counter())

    def durations_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self._marks)]


class _CudaEventTimer:
    """CUDA events recorded at step boundaries on the current stream; never a device synchronisation per step.

    Events are turned into durations once they have completed: ``query()`` (non-blocking) is polled when more than
    ``2 * window`` are pending, and the last one is waited for at the end of training.
    """

    kind = "cuda_events"

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self._pending: list[Any] = []
        self._durations: list[float] = []

    def mark(self) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append(event)
        if len(self._pending) > 2 * self.window and self._pending[self.window].query():
            self._drain(self.window)

    def _drain(self, upto: int) -> None:
        events = self._pending
        for start, end in itertools.pairwise(events[: upto + 1]):
            self._durations.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in ms
        self._pending = events[upto:]

    def durations_s(self) -> list[float]:
        if len(self._pending) >= 2:
            self._pending[-1].synchronize()  # once, at the end of training
            self._drain(len(self._pending) - 1)
        return list(self._durations)


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
