"""Critical values of the families of comparisons: Student's t, Dunnett's many-to-one, Tukey-Kramer's all pairs and
Šidák's adjustment. A leaf: :mod:`hfscale.results.stats` builds its intervals from them."""

from __future__ import annotations

import functools
import math

import numpy as np


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile, from scipy.special: importing scipy.stats costs about a second, which reading a run
    of one-comparison families need not pay."""
    from scipy.special import stdtrit

    return float(stdtrit(df, p))


@functools.lru_cache(maxsize=256)
def dunnett_critical(control_runs: int, runs: tuple[int, ...], df: int, confidence: float) -> float:
    """Dunnett's two-sided critical value for comparing trials of ``runs`` runs each with one control of
    ``control_runs`` runs, on ``df`` degrees of freedom: the ``c`` with P(max_i |T_i| <= c) = ``confidence``, the
    T_i correlated through the shared control (Dunnett 1955; the multivariate t integral is scipy's)."""
    if len(runs) == 1:
        return t_quantile(0.5 + confidence / 2, df)
    from scipy import optimize
    from scipy import stats as sps

    weight = np.sqrt(np.asarray(runs, dtype=float) / (np.asarray(runs, dtype=float) + control_runs))
    corr = np.outer(weight, weight)
    np.fill_diagonal(corr, 1.0)
    dist = sps.multivariate_t(shape=corr, df=df)
    ones = np.ones(len(runs))

    def coverage(c: float) -> float:
        return float(dist.cdf(c * ones, lower_limit=-c * ones, random_state=0)) - confidence

    high = t_quantile(1 - (1 - confidence) / (2 * len(runs)), df)  # Bonferroni's bound is never below it
    if coverage(high) <= 0:  # the integral's own error at weak correlation: Bonferroni's bound, conservative
        return high
    return float(optimize.brentq(coverage, t_quantile(0.5 + confidence / 2, df), high, xtol=1e-4))


@functools.lru_cache(maxsize=256)
def tukey_critical(trials: int, df: int, confidence: float) -> float:
    """Tukey-Kramer's critical value (in standard errors of a difference) for all pairs among ``trials``."""
    from scipy import stats as sps

    if trials < 2:
        return math.nan
    return float(sps.studentized_range.ppf(confidence, trials, df)) / math.sqrt(2)


@functools.lru_cache(maxsize=256)
def sidak_critical(comparisons: int, df: float, confidence: float) -> float:
    """The t critical value that keeps ``comparisons`` independent two-sided tests at ``confidence`` jointly."""
    level = confidence ** (1 / max(comparisons, 1))
    return t_quantile(0.5 + level / 2, df)


__all__ = ["dunnett_critical", "sidak_critical", "t_quantile", "tukey_critical"]
