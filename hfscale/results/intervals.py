"""Intervals from runs: one figure per run, on the log scale, with the run-to-run noise pooled over trials, each
trial's own (Welch), or raised to a noise floor. :mod:`hfscale.results.stats` builds the sweep's verdicts on them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hfscale.records.search import NoiseFloor
from hfscale.results.critical import t_quantile

DEFAULT_CONFIDENCE = 0.95


@dataclass(frozen=True, kw_only=True)
class Interval:
    """A statistic with its confidence interval."""

    value: float
    """The statistic (the point estimate)."""
    low: float
    high: float
    confidence: float = DEFAULT_CONFIDENCE
    statistic: str = "geometric mean over runs"
    """What ``value`` is, in words a legend can print."""
    samples: int = 0
    """How many values it came from."""
    repeats: int = 1
    """How many independent runs those values came from (the smaller side of a ratio)."""

    @property
    def half_width_rel(self) -> float:
        """Half the interval's width relative to the value (0.03: "± 3%")."""
        if self.value == 0 or not math.isfinite(self.value):
            return math.inf
        return (self.high - self.low) / 2 / abs(self.value)

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high


def run_logs(values: Sequence[float]) -> np.ndarray:
    """The natural logs of one trial's per-run figures; non-finite or non-positive figures are dropped (a run
    without a usable figure is no evidence, and never an error for the whole report)."""
    array = np.asarray(values, dtype=float)
    return np.log(array[np.isfinite(array) & (array > 0)])


@dataclass(frozen=True, kw_only=True)
class RunNoise:
    """The sweep's run-to-run noise: the pooled standard deviation of ln(samples/s) between runs of one trial."""

    sd: float
    """Pooled standard deviation of the log figure (0.05: runs of one trial differ by about 5%)."""
    df: int
    """Degrees of freedom, the sum over pooled trials of their runs less one."""
    trials: tuple[str, ...] = ()
    """The trials whose runs were pooled."""

    def words(self) -> str:
        """The noise in words, for a decision's or a report's sentence."""
        return f"run-to-run sd of ln(samples/s) {self.sd:.1%}, pooled on {self.df} df"

    def level(self, values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE) -> Interval | None:
        """One trial's geometric mean over runs with its t-interval from the pooled noise; None without runs or
        without degrees of freedom."""
        logs = run_logs(values)
        if not logs.size or self.df < 1:
            return None
        mean = float(logs.mean())
        half = t_quantile(0.5 + confidence / 2, self.df) * self.sd / math.sqrt(logs.size)
        return log_interval(mean, half, confidence, "geometric mean over runs", logs.size, logs.size)

    def ratio(self, top: Sequence[float], bottom: Sequence[float], critical: float, confidence: float) -> Interval:
        """``top`` over ``bottom`` (geometric means over runs) with the interval ``critical`` standard errors wide
        on the log scale: exactly the reciprocal of ``ratio(bottom, top)``."""
        a, b = run_logs(top), run_logs(bottom)
        diff = float(a.mean() - b.mean())
        half = critical * self.sd * math.sqrt(1 / a.size + 1 / b.size)
        return log_interval(
            diff, half, confidence, "ratio of geometric means over runs", a.size + b.size, min(a.size, b.size)
        )


def log_interval(
    log_value: float, log_half: float, confidence: float, statistic: str, samples: int, repeats: int
) -> Interval:
    return Interval(
        value=math.exp(log_value),
        low=math.exp(log_value - log_half),
        high=math.exp(log_value + log_half),
        confidence=confidence,
        statistic=statistic,
        samples=samples,
        repeats=repeats,
    )


def pooled_noise(runs: Mapping[str, Sequence[float]]) -> RunNoise:
    """The run-to-run noise pooled over every trial with two or more usable runs (``runs``: trial -> per-run
    figures); ``df == 0`` when no trial has two."""
    squares, df, names = 0.0, 0, []
    for name, values in runs.items():
        logs = run_logs(values)
        if logs.size >= 2:
            squares += float(((logs - logs.mean()) ** 2).sum())
            df += logs.size - 1
            names.append(name)
    return RunNoise(sd=math.sqrt(squares / df) if df else math.nan, df=df, trials=tuple(names))


def welch_ratio(
    top: Sequence[float], bottom: Sequence[float], critical: Callable[[float], float], confidence: float
) -> Interval:
    """``top`` over ``bottom`` (geometric means over runs) from each side's own run-to-run variance: Welch's
    interval, ``critical(df)`` standard errors wide at the Welch-Satterthwaite degrees of freedom (not rounded: two
    runs a side give 1-2 df, and rounding down to 1 would take t from 4.3 to 12.7)."""
    a, b = run_logs(top), run_logs(bottom)
    va, vb = float(a.var(ddof=1)) / a.size, float(b.var(ddof=1)) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se > 0 else a.size + b.size - 2
    half = critical(max(1.0, df)) * se
    return log_interval(
        float(a.mean() - b.mean()), half, confidence, "ratio of geometric means over runs (Welch: each side's own run "
        "noise)", a.size + b.size, min(a.size, b.size),
    )  # fmt: skip


@dataclass(frozen=True)
class _MeanVariance:
    """The variance of one trial's mean log figure, the degrees of freedom of its estimate, and which estimate it
    is (the pool, the trial's own runs, or the floor): sides resting on one estimate count its df once."""

    variance: float
    df: float
    source: str


def _mean_variance(
    logs: np.ndarray, noise: RunNoise | None, floor: NoiseFloor | None, name: str
) -> _MeanVariance | None:
    """One trial's :class:`_MeanVariance` from the pooled ``noise`` (None: from its own runs), raised to the floor's
    one run; None when neither gives one (no degrees of freedom and no floor)."""
    if noise is not None:
        own = _MeanVariance(noise.sd**2 / logs.size, float(noise.df), "pool") if noise.df >= 1 else None
    else:
        own = _MeanVariance(float(logs.var(ddof=1)) / logs.size, logs.size - 1.0, name) if logs.size >= 2 else None
    if floor is not None and (own is None or own.variance < floor.sd**2):
        return _MeanVariance(floor.sd**2, floor.dof, "floor")
    return own


def _satterthwaite(sides: Sequence[_MeanVariance]) -> float:
    """Welch-Satterthwaite degrees of freedom of a sum of variances, each estimate counted once."""
    by_source: dict[str, tuple[float, float]] = {}
    for side in sides:
        variance, _ = by_source.get(side.source, (0.0, side.df))
        by_source[side.source] = (variance + side.variance, side.df)
    total = sum(v for v, _ in by_source.values())
    spread = sum(v**2 / df for v, df in by_source.values() if math.isfinite(df))
    return total**2 / spread if spread > 0 else math.inf


def floored_ratio(
    top: Sequence[float],
    bottom: Sequence[float],
    *,
    noise: RunNoise | None,
    floor: NoiseFloor,
    critical: Callable[[float], float],
    confidence: float = DEFAULT_CONFIDENCE,
) -> Interval | None:
    """``top`` over ``bottom`` where neither mean may be known better than one run of ``floor``: each side's variance
    is the larger of its runs' (the pooled ``noise``, or its own runs where ``noise`` is None) and the floor's, at
    the Welch-Satterthwaite degrees of freedom; None when a side has no runs, or neither."""
    a, b = run_logs(top), run_logs(bottom)
    if not (a.size and b.size):
        return None
    sides = (_mean_variance(a, noise, floor, "top"), _mean_variance(b, noise, floor, "bottom"))
    if sides[0] is None or sides[1] is None:
        return None
    half = critical(max(1.0, _satterthwaite(sides))) * math.sqrt(sides[0].variance + sides[1].variance)
    return log_interval(
        float(a.mean() - b.mean()), half, confidence, "ratio of geometric means over runs (each mean at least as "
        "uncertain as one run of the noise floor)", a.size + b.size, min(a.size, b.size),
    )  # fmt: skip


def floored_level(
    values: Sequence[float], *, noise: RunNoise | None, floor: NoiseFloor, critical: Callable[[float], float],
    confidence: float = DEFAULT_CONFIDENCE,
) -> Interval | None:  # fmt: skip
    """One trial's geometric mean over runs with an interval no narrower than one run of ``floor`` (see
    :func:`floored_ratio`); None without runs."""
    logs = run_logs(values)
    side = _mean_variance(logs, noise, floor, "level") if logs.size else None
    if side is None:
        return None
    half = critical(max(1.0, side.df)) * math.sqrt(side.variance)
    return log_interval(float(logs.mean()), half, confidence, "geometric mean over runs", logs.size, logs.size)


__all__ = [
    "DEFAULT_CONFIDENCE",
    "Interval",
    "RunNoise",
    "floored_level",
    "floored_ratio",
    "log_interval",
    "pooled_noise",
    "run_logs",
    "welch_ratio",
]
