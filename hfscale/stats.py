"""Figures with their noise: bootstrap intervals over steps and repeats, ratios with intervals, ties, stability.

A benchmark figure is a statistic of a distribution. Every throughput figure hfscale reports is computed from the
measured step times it came from, with a 95% percentile-bootstrap interval (criterion.rs and pyperf use the same
idea): within one run the steps are resampled; with several repeats of a trial the bootstrap is hierarchical, the
repeats are resampled and then the steps within each, so that run-to-run drift (a different process, another
allocator layout, the machine's other load) widens the interval as it should. A ratio of two trials is bootstrapped
from both samples at once, and a ratio whose interval holds 1 (or lies within the noise threshold of it) is a tie,
never a ranking.

The bootstrap is a few lines of numpy rather than ``scipy.stats.bootstrap`` because scipy's resamples one level
only; a seeded generator makes every interval reproducible from the stored step times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Statistic = Literal["mean", "median"]

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000
DEFAULT_NOISE_THRESHOLD = 0.02
"""A ratio within 2% of 1 is a tie even when its interval excludes 1 (criterion.rs's default noise threshold)."""
UNSTABLE_CV = 0.10
"""Step times whose standard deviation exceeds 10% of their mean make a figure "may be unstable" (pyperf's rule)."""

Verdict = Literal["higher", "lower", "tie"]


@dataclass(frozen=True, kw_only=True)
class Interval:
    """A statistic with its confidence interval."""

    value: float
    """The statistic of all samples (the point estimate)."""
    low: float
    high: float
    confidence: float = DEFAULT_CONFIDENCE
    statistic: str = "mean"
    """What ``value`` is: ``mean`` or ``median`` of the samples, or a ratio of two such."""
    samples: int = 0
    """How many values it came from (all steps of all repeats)."""
    repeats: int = 1
    """How many independent runs those values came from."""

    @property
    def half_width_rel(self) -> float:
        """Half the interval's width relative to the value (0.03: "± 3%")."""
        if self.value == 0 or not math.isfinite(self.value):
            return math.inf
        return (self.high - self.low) / 2 / abs(self.value)

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def map(self, fn: Callable[[float], float]) -> Interval:
        """The interval of a monotonic function of the statistic (a decreasing one swaps the bounds)."""
        a, b = fn(self.low), fn(self.high)
        return Interval(
            value=fn(self.value),
            low=min(a, b),
            high=max(a, b),
            confidence=self.confidence,
            statistic=self.statistic,
            samples=self.samples,
            repeats=self.repeats,
        )


def _as_groups(samples: Sequence[float] | Sequence[Sequence[float]]) -> list[np.ndarray]:
    """One array per repeat; a flat sequence is one repeat. Empty repeats are dropped.

    Raises:
        ValueError: when there is no sample at all, or a sample is not finite.
    """
    if len(samples) and not isinstance(samples[0], Sequence | np.ndarray):
        groups = [np.asarray(samples, dtype=float)]
    else:
        groups = [np.asarray(g, dtype=float) for g in samples]  # type: ignore[arg-type]
    groups = [g for g in groups if g.size]
    if not groups:
        raise ValueError("samples: expected at least one value, got none")
    for g in groups:
        if not np.all(np.isfinite(g)):
            raise ValueError("samples: expected finite values, got inf or NaN")
    return groups


def _reduce(stat: Statistic) -> Callable[..., np.ndarray]:
    if stat == "mean":
        return np.mean
    if stat == "median":
        return np.median
    raise ValueError(f"statistic: expected 'mean' or 'median', got {stat!r}")


def _point(groups: list[np.ndarray], stat: Statistic) -> float:
    """The statistic of each repeat, averaged over repeats (each repeat weighs the same)."""
    reduce = _reduce(stat)
    return float(np.mean([reduce(g) for g in groups]))


def _replicates(groups: list[np.ndarray], stat: Statistic, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """``resamples`` bootstrap replicates of :func:`_point`: repeats resampled, then the values within each."""
    reduce = _reduce(stat)
    per_group = np.empty((len(groups), resamples))
    for k, g in enumerate(groups):
        draws = rng.integers(0, g.size, size=(resamples, g.size))
        per_group[k] = reduce(g[draws], axis=1)
    if len(groups) == 1:
        return per_group[0]
    picks = rng.integers(0, len(groups), size=(resamples, len(groups)))
    return per_group[picks, np.arange(resamples)[:, None]].mean(axis=1)


def _bounds(replicates: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a value in (0, 1), got {confidence}")
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(replicates, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_interval(
    samples: Sequence[float] | Sequence[Sequence[float]],
    *,
    statistic: Statistic = "mean",
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """The ``statistic`` of ``samples`` with its percentile-bootstrap interval.

    ``samples`` is one run's values, or a list of runs' values (repeats): then the point estimate is the mean over
    repeats of each repeat's statistic, and the bootstrap resamples repeats and then values within each.

    Raises:
        ValueError: for no samples, non-finite samples, an unknown statistic or a confidence outside (0, 1).
    """
    groups = _as_groups(samples)
    rng = np.random.default_rng(seed)
    low, high = _bounds(_replicates(groups, statistic, resamples, rng), confidence)
    return Interval(
        value=_point(groups, statistic),
        low=low,
        high=high,
        confidence=confidence,
        statistic=statistic,
        samples=sum(g.size for g in groups),
        repeats=len(groups),
    )


def ratio_interval(
    numerator: Sequence[float] | Sequence[Sequence[float]],
    denominator: Sequence[float] | Sequence[Sequence[float]],
    *,
    statistic: Statistic = "mean",
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """``statistic(numerator) / statistic(denominator)`` with a bootstrap interval; the two are independent
    samples (two trials), each resampled as :func:`bootstrap_interval` does.

    Raises:
        ValueError: as :func:`bootstrap_interval`, or when the denominator's statistic is 0.
    """
    top, bottom = _as_groups(numerator), _as_groups(denominator)
    rng = np.random.default_rng(seed)
    top_r = _replicates(top, statistic, resamples, rng)
    bottom_r = _replicates(bottom, statistic, resamples, rng)
    point_bottom = _point(bottom, statistic)
    if point_bottom == 0 or np.any(bottom_r == 0):
        raise ValueError("denominator: its statistic is 0, the ratio is undefined")
    low, high = _bounds(top_r / bottom_r, confidence)
    return Interval(
        value=_point(top, statistic) / point_bottom,
        low=low,
        high=high,
        confidence=confidence,
        statistic=f"ratio of {statistic}s",
        samples=sum(g.size for g in top) + sum(g.size for g in bottom),
        repeats=min(len(top), len(bottom)),
    )


def verdict(ratio: Interval, *, noise_threshold: float = DEFAULT_NOISE_THRESHOLD) -> Verdict:
    """``higher`` or ``lower`` when the whole interval of a ratio lies above or below 1 and the ratio departs from
    1 by more than ``noise_threshold``; else ``tie``."""
    if ratio.contains(1.0) or abs(ratio.value - 1) <= noise_threshold:
        return "tie"
    return "higher" if ratio.low > 1 else "lower"


def coefficient_of_variation(samples: Sequence[float] | Sequence[Sequence[float]]) -> float:
    """Standard deviation over mean of all values (0 for a single value)."""
    values = np.concatenate(_as_groups(samples))
    mean = float(values.mean())
    if values.size < 2 or mean == 0:
        return 0.0
    return float(values.std(ddof=1)) / abs(mean)


def repeat_spread(samples: Sequence[Sequence[float]], *, statistic: Statistic = "mean") -> float:
    """(largest - smallest) / mean of the repeats' statistics: how far the runs of one trial disagree (0 with one)."""
    reduce = _reduce(statistic)
    values = [float(reduce(g)) for g in _as_groups(samples)]
    mean = float(np.mean(values))
    return 0.0 if len(values) < 2 or mean == 0 else (max(values) - min(values)) / abs(mean)


__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_NOISE_THRESHOLD",
    "DEFAULT_RESAMPLES",
    "UNSTABLE_CV",
    "Interval",
    "Statistic",
    "Verdict",
    "bootstrap_interval",
    "coefficient_of_variation",
    "ratio_interval",
    "repeat_spread",
    "verdict",
]
