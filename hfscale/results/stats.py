"""Figures with their noise: run-level intervals, verdicts that hold over a whole sweep, and within-run diagnostics.

The unit of replication is the run (a fresh process), not the step: steps within a run are autocorrelated and share
that run's machine state, so they say how steady one run was, not how a second run will come out. Every interval
and verdict here is computed from one figure per run, the run's steady samples/s, on the log scale (a speed-up is
a ratio). The trials of a sweep run interleaved on the same machine and share its noise, so their run-to-run
variance is pooled (a one-way analysis of variance): seven trials of two runs give seven degrees of freedom for
every comparison instead of one. A sweep compares many trials with one baseline; Dunnett's many-to-one critical
value keeps the chance that it calls *any* identical trial faster or slower at 5%. Pairwise ties between arbitrary
trials use the Tukey-Kramer critical value, and a comparison of the same trials in two sweeps uses Šidák's
adjustment.

Pooling assumes that the trials share one noise. Where Bartlett's test says they do not (a CPU sweep whose
multi-process trials vary ten times more between runs than its single-process ones), a pooled figure would widen
every quiet comparison and narrow every noisy one; each comparison then uses its two trials' own run-to-run
variances (Welch's interval, Welch-Satterthwaite degrees of freedom) with Šidák's adjustment over the family
(Dunnett's T3). ``docs/statistics.md`` explains the choice and ``tests/test_stats_calibration.py`` checks it by
simulation.

Both take runs as independent. Where a machine's speed drifts over minutes, runs made close together (an adaptive
search's repeats) agree more than the machine does; given a :class:`~hfscale.records.search.NoiseFloor` measured
over a longer time (a grid's pool), :func:`floored_ratio` takes no trial's mean as known better than one run of it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from hfscale.records.search import NoiseFloor
from hfscale.results.critical import dunnett_critical, sidak_critical, t_quantile, tukey_critical
from hfscale.results.intervals import (
    DEFAULT_CONFIDENCE,
    Interval,
    RunNoise,
    floored_level,
    floored_ratio,
    pooled_noise,
    run_logs,
    welch_ratio,
)

DEFAULT_NOISE_THRESHOLD = 0.02
"""A ratio within 2% of 1 is a tie even when its interval excludes 1 (criterion.rs's default noise threshold)."""
OUTLIER_ALPHA = 0.01
"""A trial whose runs disagree beyond the rest of the sweep's pooled run-to-run noise at this level
(Bonferroni-adjusted over the trials tested) is flagged and gets no verdict."""
HOMOGENEITY_ALPHA = 0.01
"""Bartlett's test of one shared run-to-run variance across the trials at this level: below it, each comparison
uses its own two trials' variances (Welch) instead of the sweep's pool. Low, so that a sweep of trials that do
share their noise keeps the pool's degrees of freedom in 99 sweeps of 100."""
MIN_RUNS = 2
"""Runs each side needs before a difference is called: a trial's own runs must show that it shares the sweep's
noise (one run cannot be tested against the pool)."""

Verdict = Literal["higher", "lower", "tie", "untested"]


def shared_noise_p(runs: Mapping[str, Sequence[float]]) -> float | None:
    """Bartlett's test that every trial with two or more runs has the same run-to-run variance of ln(samples/s):
    its p-value, or None where it cannot be computed (fewer than two such trials). A trial whose runs are all equal
    (only constructed rows do that) has no variance to compare and is left out."""
    variances, dfs = [], []
    for values in runs.values():
        logs = run_logs(values)
        if logs.size >= 2 and (variance := float(logs.var(ddof=1))) > 0:
            variances.append(variance)
            dfs.append(logs.size - 1)
    if len(variances) < 2:
        return None
    v, d = np.asarray(variances), np.asarray(dfs, dtype=float)
    total = d.sum()
    pooled = float((d * v).sum() / total)
    statistic = total * math.log(pooled) - float((d * np.log(v)).sum())
    correction = 1 + (float((1 / d).sum()) - 1 / total) / (3 * (len(v) - 1))
    from scipy.special import chdtrc

    return float(chdtrc(len(v) - 1, statistic / correction))


def shares_noise(p: float | None) -> bool:
    """Whether trials may be pooled, from Bartlett's p (:func:`shared_noise_p`): not computable, or not below
    :data:`HOMOGENEITY_ALPHA`."""
    return p is None or p >= HOMOGENEITY_ALPHA


def ratio_of(
    top: Sequence[float],
    bottom: Sequence[float],
    *,
    noise: RunNoise,
    shared: bool,
    critical: Callable[[float], float],
    confidence: float = DEFAULT_CONFIDENCE,
    floor: NoiseFloor | None = None,
) -> Interval | None:
    """``top`` over ``bottom`` with an interval ``critical(df)`` standard errors wide (the caller's family): neither
    mean better known than one run of ``floor`` where one is given (:func:`floored_ratio`), else the pooled ``noise``
    where the trials share one, else each side's own (Welch). The one place that choice is made; None where no
    interval can be formed (no degrees of freedom, or a side whose own noise is unknown)."""
    if floor is not None:
        pool = noise if shared else None
        return floored_ratio(top, bottom, noise=pool, floor=floor, critical=critical, confidence=confidence)
    if shared:
        return noise.ratio(top, bottom, critical(noise.df), confidence) if noise.df >= 1 else None
    if min(run_logs(top).size, run_logs(bottom).size) < 2:
        return None
    return welch_ratio(top, bottom, critical, confidence)


def many_to_one(
    top: Sequence[float],
    control: Sequence[float],
    *,
    others: tuple[int, ...],
    noise: RunNoise,
    shared: bool,
    confidence: float = DEFAULT_CONFIDENCE,
    floor: NoiseFloor | None = None,
) -> Interval | None:
    """``top`` over ``control`` within a many-to-one family (``others``: the run counts of every trial compared with
    the control) by :func:`ratio_of`: Dunnett's critical value on the pool, else Šidák's over the family (Dunnett's
    T3 on each side's own noise; on a noise floor, whose sides' variances differ). The report's verdicts against the
    baseline and the search's against its leader both ask this."""
    control_runs = run_logs(control).size

    def critical(df: float) -> float:
        if shared and floor is None:
            return dunnett_critical(control_runs, others, int(df), confidence)
        return sidak_critical(len(others), df, confidence)

    return ratio_of(
        top, control, noise=noise, shared=shared, critical=critical, confidence=confidence, floor=floor
    )  # fmt: skip


def outliers(
    runs: Mapping[str, Sequence[float]], alpha: float = OUTLIER_ALPHA, *, floor: NoiseFloor | None = None
) -> dict[str, str]:
    """The trials whose runs disagree far beyond the others' pooled noise, each with the reason in words.

    An F test of the trial's own variance against the pool of the other trials, Bonferroni-adjusted over the trials
    tested, so that a sweep of identical trials flags one only about ``alpha`` of the time. A trial that does not
    share the sweep's noise (a disturbed run, a bimodal start-up) gets no verdict. Under a noise ``floor`` the test
    is against the larger of that pool and the floor: a search's runs, made close together, can agree far more
    than the machine does (one other trial's two runs, 0.1% apart in sd, against a grid's 9.3% on cpu_budget), and a
    trial within the floor is not an outlier; a trial beyond it is flagged even where no other trial ran twice.
    (Standard deviations of ln(samples/s) throughout.)
    """
    logs = {name: run_logs(values) for name, values in runs.items()}
    squares = {name: float(((x - x.mean()) ** 2).sum()) for name, x in logs.items() if x.size >= 2}
    total, total_df = sum(squares.values()), sum(logs[name].size - 1 for name in squares)
    flagged: dict[str, str] = {}
    for name, own_squares in squares.items():
        own_df = logs[name].size - 1
        rest_df = total_df - own_df
        pool = (total - own_squares) / rest_df if rest_df else 0.0
        reference, reference_df, against = pool, float(rest_df), f"{math.sqrt(pool):.1%} pooled over the other trials"
        beyond = "the sweep's run-to-run noise"
        if floor is not None and floor.sd**2 > pool:
            reference, reference_df, against = floor.sd**2, floor.dof, f"the noise floor's {floor.sd:.1%}"
            beyond = "the noise floor"
        if reference <= 0:
            continue
        own_var = own_squares / own_df
        p = _f_survival(own_df, reference_df, own_var / reference)
        if p < alpha / len(squares):
            flagged[name] = (
                f"its {logs[name].size} runs disagree far beyond {beyond} "
                f"({math.sqrt(own_var):.1%} against {against}, p = {p:.1g})"
            )
    return flagged


def _f_survival(df_num: float, df_den: float, ratio: float) -> float:
    """P(F > ratio) for F(df_num, df_den); a denominator known exactly (infinite df) makes it chi-square's."""
    from scipy.special import chdtrc, fdtrc  # here: a sweep of single runs never pays scipy's import

    if math.isinf(df_den):
        return float(chdtrc(df_num, df_num * ratio))
    return float(fdtrc(df_num, df_den, ratio))


def within_threshold(ratio: float, noise_threshold: float = DEFAULT_NOISE_THRESHOLD) -> bool:
    """Whether a ratio lies within the noise threshold of 1, the same either way round (0.98 and 1/0.98 alike)."""
    return ratio > 0 and abs(math.log(ratio)) <= math.log1p(noise_threshold)


def verdict(ratio: Interval, *, noise_threshold: float = DEFAULT_NOISE_THRESHOLD) -> Verdict:
    """``higher`` or ``lower`` when the whole interval of a ratio lies above or below 1 and the ratio departs from
    1 by more than ``noise_threshold``; else ``tie``."""
    if ratio.contains(1.0) or within_threshold(ratio.value, noise_threshold):
        return "tie"
    return "higher" if ratio.low > 1 else "lower"


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """One trial against another: the ratio of their figures with its interval, and what may be said of it."""

    verdict: Verdict
    ratio: Interval | None = None
    """None where no interval could be formed (a side with too few runs, no pooled noise)."""
    why: str | None = None
    """Why the verdict is ``untested``, in words."""
    few_runs: bool = False
    """Untested only for want of runs: a ratio within the noise threshold may still be called a tie. A flagged
    trial's figure is not evidence of anything, a tie included."""


@dataclass(frozen=True, kw_only=True)
class SweepNoise:
    """What the runs of one sweep allow to be said: the pooled noise, the trials flagged as outside it, and the
    critical values of its families of comparisons. Built once per sweep by :func:`sweep_noise`."""

    runs: Mapping[str, tuple[float, ...]]
    """Each trial's per-run figures (samples/s of each ok run with step times)."""
    noise: RunNoise
    flagged: Mapping[str, str] = field(default_factory=dict)
    """Trials whose runs disagree beyond the pool, with the reason."""
    shared_p: float | None = None
    """Bartlett's p-value for one run-to-run variance shared by the trials (None: not computable)."""
    confidence: float = DEFAULT_CONFIDENCE
    noise_threshold: float = DEFAULT_NOISE_THRESHOLD
    floor: NoiseFloor | None = None
    """The least uncertainty of a trial's mean (an adaptive search's ``--noise-floor``): the verdicts then agree
    with the search's decisions."""

    @property
    def shared(self) -> bool:
        """Whether the trials may be taken to share one run-to-run noise (the pool); else comparisons are Welch's."""
        return shares_noise(self.shared_p)

    def run_sd(self, *names: str) -> float:
        """The run-to-run sd of ln(samples/s) that comparisons among ``names`` rest on: the sweep's pool, or where
        the trials do not share their noise, the pool of these trials' own runs."""
        if self.shared or not names:
            return self.noise.sd
        return pooled_noise({name: self.runs.get(name, ()) for name in names}).sd

    @functools.cached_property
    def _counts(self) -> dict[str, int]:
        return {name: run_logs(values).size for name, values in self.runs.items()}

    def testable(self, name: str) -> str | None:
        """Why ``name`` cannot take part in a verdict, or None when it can."""
        count = self._counts.get(name, 0)
        if count < MIN_RUNS:
            return f"{name} has {count} run{'s' if count != 1 else ''} (a verdict needs {MIN_RUNS} a side)"
        if name in self.flagged:
            return f"{name}: {self.flagged[name]}"
        if self.noise.df < 1:
            return "no run-to-run noise to test against"
        return None

    def _untested(self, *names: str) -> Comparison | None:
        why = next((w for n in names if (w := self.testable(n)) is not None), None)
        if why is None:
            return None
        return Comparison(verdict="untested", why=why, few_runs=not any(n in self.flagged for n in names))

    @functools.cached_property
    def _family(self) -> tuple[str, ...]:
        return tuple(name for name in self.runs if self.testable(name) is None)

    def family(self) -> list[str]:
        """The trials that may take part in verdicts."""
        return list(self._family)

    def against(self, name: str, baseline: str) -> Comparison:
        """``name`` against ``baseline`` within the many-to-one family of every testable trial (Dunnett; Dunnett's
        T3 where the trials do not share their noise)."""
        if (untested := self._untested(name, baseline)) is not None:
            return untested
        others = tuple(self._counts[n] for n in self._family if n != baseline)
        runs = self.runs
        ratio = many_to_one(
            runs[name], runs[baseline], others=others, noise=self.noise, shared=self.shared,
            confidence=self.confidence, floor=self.floor,
        )  # fmt: skip
        if ratio is None:  # not reached: both sides are testable (two runs each, a pool with degrees of freedom)
            return Comparison(verdict="untested", why="no run-to-run noise to test against")
        return Comparison(verdict=verdict(ratio, noise_threshold=self.noise_threshold), ratio=ratio)

    def pair(self, a: str, b: str) -> Comparison:
        """``a`` against ``b`` within the all-pairs family of every testable trial (Tukey-Kramer; Dunnett's T3 where
        the trials do not share their noise)."""
        if (untested := self._untested(a, b)) is not None:
            return untested
        trials, confidence = len(self._family), self.confidence
        if self.shared and self.floor is None:
            return self.compare(a, b, lambda df: tukey_critical(trials, df, confidence))
        return self.compare(a, b, lambda df: sidak_critical(trials * (trials - 1) // 2, df, confidence))

    def compare(self, top: str, bottom: str, critical: Callable[[float], float]) -> Comparison:
        """``top`` against ``bottom`` with an interval ``critical(df)`` standard errors wide (the caller's family,
        at the degrees of freedom of the noise used: the pool's, Welch's where the trials do not share it, or the
        floor's), by :func:`ratio_of`."""
        if (untested := self._untested(top, bottom)) is not None:
            return untested
        runs = self.runs
        ratio = ratio_of(
            runs[top], runs[bottom], noise=self.noise, shared=self.shared, critical=critical,
            confidence=self.confidence, floor=self.floor,
        )  # fmt: skip
        if ratio is None:  # not reached: both sides are testable (two runs each, a pool with degrees of freedom)
            return Comparison(verdict="untested", why="no run-to-run noise to test against")
        return Comparison(verdict=verdict(ratio, noise_threshold=self.noise_threshold), ratio=ratio)

    def level(self, name: str) -> Interval | None:
        """``name``'s geometric mean over runs with its interval from the pool (from its own runs where it is
        flagged or the trials do not share their noise), no narrower than one run of the floor where there is one."""
        if self.floor is not None:
            pool = self.noise if self.shared and name not in self.flagged else None
            critical = functools.partial(t_quantile, 0.5 + self.confidence / 2)
            values = self.runs.get(name, ())
            return floored_level(values, noise=pool, floor=self.floor, critical=critical, confidence=self.confidence)
        if name in self.flagged or not self.shared:
            return pooled_noise({name: self.runs.get(name, ())}).level(self.runs.get(name, ()), self.confidence)
        return self.noise.level(self.runs.get(name, ()), self.confidence)


def sweep_noise(
    runs: Mapping[str, Sequence[float]],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    noise_threshold: float = DEFAULT_NOISE_THRESHOLD,
    floor: NoiseFloor | None = None,
) -> SweepNoise:
    """The evidence of one sweep: ``runs`` maps each trial to its per-run figures (samples/s); ``floor``: the least
    uncertainty of a trial's mean (an adaptive search's noise floor).

    Raises:
        ValueError: for a confidence outside (0, 1) or a negative noise threshold.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a value in (0, 1), got {confidence}")
    if not noise_threshold >= 0:
        raise ValueError(f"noise_threshold: expected a fraction >= 0 (0.02 for 2%), got {noise_threshold}")
    kept = {name: tuple(float(v) for v in values) for name, values in runs.items()}
    # A flagged trial stays in the pool: leaving it out would shrink the pool exactly when the sweep was noisy
    # (simulated at 2 runs a trial: 5.4% of identical sweeps then called something, against 4.9% with it in).
    flagged = outliers(kept, floor=floor)
    noise = pooled_noise(kept)
    # Whether the trials share one noise is asked of those not flagged: one disturbed trial is its own problem, not
    # evidence that the others differ. Where they do not share it, each trial is judged on its own runs, so a
    # trial's runs disagreeing with the others' is no longer a reason to withhold its verdict.
    shared_p = shared_noise_p({name: values for name, values in kept.items() if name not in flagged})
    if not shares_noise(shared_p):
        flagged = {}
    return SweepNoise(
        runs=kept, noise=noise, flagged=flagged, shared_p=shared_p, confidence=confidence,
        noise_threshold=noise_threshold, floor=floor,
    )  # fmt: skip


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Standard deviation over mean (0 for a single value)."""
    array = np.asarray(values, dtype=float)
    array = array[np.isfinite(array)]
    if array.size < 2 or array.mean() == 0:
        return 0.0
    return float(array.std(ddof=1) / abs(array.mean()))


def batch_means_se(values: Sequence[float], batches: int = 5) -> float | None:
    """The relative standard error of one run's mean step time by non-overlapping batch means, which stays honest
    when steps are autocorrelated (a slow stretch lasts) where the naive sd/sqrt(n) is too small; None with fewer
    than two steps a batch. A within-run diagnostic: how steady one run was, never the interval of a verdict."""
    array = np.asarray(values, dtype=float)
    array = array[np.isfinite(array)]
    size = array.size // batches
    if size < 2 or array.mean() == 0:
        return None
    means = array[: size * batches].reshape(batches, size).mean(axis=1)
    return float(means.std(ddof=1) / math.sqrt(batches) / abs(array.mean()))


__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_NOISE_THRESHOLD",
    "HOMOGENEITY_ALPHA",
    "MIN_RUNS",
    "OUTLIER_ALPHA",
    "Comparison",
    "Interval",
    "NoiseFloor",
    "RunNoise",
    "SweepNoise",
    "Verdict",
    "batch_means_se",
    "coefficient_of_variation",
    "dunnett_critical",
    "floored_level",
    "floored_ratio",
    "many_to_one",
    "outliers",
    "pooled_noise",
    "ratio_of",
    "run_logs",
    "shared_noise_p",
    "shares_noise",
    "sidak_critical",
    "sweep_noise",
    "tukey_critical",
    "verdict",
    "welch_ratio",
    "within_threshold",
]
