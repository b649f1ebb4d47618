"""A stand-in for a machine's timing noise: step times with run-level offsets, autocorrelated steps and drift.

The verdicts of :mod:`hfscale.results.stats` are checked against it (``tests/test_stats_calibration.py``,
``benchmarks/calibration.py``): sweeps of trials whose true speeds are known are simulated many times, and the share
of intervals that cover the truth, of sweeps that call an identical trial different, and of real differences found
are counted. The noise has the parts a real machine shows: each run has its own offset (a fresh process, another
memory layout, the machine's other load), within a run a slow stretch lasts (an AR(1) process), and on a shared or
virtual machine each trial's speed wanders over minutes (drift: an AR(1) process on the sweep's clock, one tick a run
launched), so that runs of one trial close together in time agree more than runs far apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class NoiseModel:
    """The timing noise of one machine."""

    run_sd: float = 0.03
    """Standard deviation of a run's offset on the log scale (0.03: runs differ by about 3%)."""
    step_cv: float = 0.05
    """Standard deviation of one step's time within a run, relative to the run's mean."""
    step_autocorrelation: float = 0.5
    """Lag-1 autocorrelation of the step times within a run (an AR(1) process)."""
    steps: int = 50
    """Measured steps a run."""
    drift_sd: float = 0.0
    """Standard deviation on the log scale of each trial's slow drift (0: runs are independent). One process per
    trial, independent between trials: a drift that every trial shares cancels in the ratios of interleaved runs,
    one that moves one trial and not another (a single process and a two-process trial on two shared vCPUs) does
    not."""
    drift_autocorrelation: float = 0.9
    """Correlation of a trial's drift between two consecutive ticks of the sweep's clock (one run launched)."""

    def __post_init__(self) -> None:
        if not (self.run_sd >= 0 and self.step_cv >= 0):
            raise ValueError(f"run_sd, step_cv: expected >= 0, got {self.run_sd}, {self.step_cv}")
        if not -1 < self.step_autocorrelation < 1:
            raise ValueError(f"step_autocorrelation: expected a value in (-1, 1), got {self.step_autocorrelation}")
        if self.steps < 1:
            raise ValueError(f"steps: expected at least 1, got {self.steps}")
        if not self.drift_sd >= 0:
            raise ValueError(f"drift_sd: expected >= 0, got {self.drift_sd}")
        if not -1 < self.drift_autocorrelation < 1:
            raise ValueError(f"drift_autocorrelation: expected a value in (-1, 1), got {self.drift_autocorrelation}")


def drift(model: NoiseModel, trials: int, ticks: int, rng: np.random.Generator) -> np.ndarray:
    """Each trial's drift at each tick of the sweep's clock, on the log scale: an array of shape (trials, ticks),
    stationary from the first tick (zeros where ``model.drift_sd`` is 0)."""
    path = np.zeros((trials, ticks))
    if model.drift_sd == 0 or ticks == 0:
        return path
    rho = model.drift_autocorrelation
    path[:, 0] = rng.normal(0.0, model.drift_sd, size=trials)
    shocks = rng.normal(0.0, model.drift_sd * np.sqrt(1 - rho**2), size=(trials, ticks))
    for t in range(1, ticks):
        path[:, t] = rho * path[:, t - 1] + shocks[:, t]
    return path


def step_times(
    model: NoiseModel, rate: float, repeats: int, rng: np.random.Generator, slow: np.ndarray | None = None
) -> np.ndarray:
    """``repeats`` runs of ``model.steps`` step times (seconds) of a trial whose true speed is ``rate`` steps/s:
    an array of shape (repeats, steps); ``slow``: each run's drift (log scale, from :func:`drift`), added to its
    own offset."""
    rho = model.step_autocorrelation
    shocks = rng.normal(0.0, model.step_cv * np.sqrt(1 - rho**2), size=(repeats, model.steps))
    noise = np.empty_like(shocks)
    noise[:, 0] = rng.normal(0.0, model.step_cv, size=repeats)  # the stationary distribution from the first step
    for t in range(1, model.steps):
        noise[:, t] = rho * noise[:, t - 1] + shocks[:, t]
    offsets = rng.normal(0.0, model.run_sd, size=(repeats, 1))
    if slow is not None:
        offsets = offsets + np.asarray(slow, dtype=float).reshape(repeats, 1)
    return np.exp(offsets + noise - model.step_cv**2 / 2) / rate


def sweep_runs(
    model: NoiseModel,
    rates: Mapping[str, float],
    repeats: int,
    rng: np.random.Generator,
    own: Mapping[str, NoiseModel] | None = None,
) -> dict[str, list[float]]:
    """One simulated sweep: each trial's per-run samples/s (one sample a step, over the run's mean step time);
    ``own`` gives a trial a noise of its own (a multi-process trial on a CPU varies more than a single one). The
    runs are interleaved as a grid runs them: run ``r`` of the ``k``-th trial at tick ``r * len(rates) + k``."""
    own = own or {}
    ticks = interleaved_ticks(len(rates), repeats)
    paths = drift(model, len(rates), ticks.size, rng)
    return {
        name: list(1.0 / step_times(own.get(name, model), rate, repeats, rng, paths[k, ticks[k]]).mean(axis=1))
        for k, (name, rate) in enumerate(rates.items())
    }


def interleaved_ticks(trials: int, repeats: int) -> np.ndarray:
    """When a grid launches each run: an array of shape (trials, repeats), run ``r`` of trial ``k`` at tick
    ``r * trials + k``."""
    return np.arange(repeats)[None, :] * trials + np.arange(trials)[:, None]


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What many simulated sweeps said, against the truth they were drawn from."""

    sweeps: int
    coverage: float
    """Share of the 95% intervals (every trial against the baseline) that held the true ratio."""
    false_verdict_sweeps: float
    """Share of sweeps that called at least one trial identical to the baseline faster or slower."""
    found: float | None
    """Share of the truly different trials' comparisons called in the right direction (None without such trials)."""
    untested: float
    """Share of comparisons left untested (a trial whose runs disagree beyond the pool)."""


def calibrate(
    model: NoiseModel,
    rates: Mapping[str, float],
    baseline: str,
    *,
    repeats: int,
    sweeps: int,
    seed: int = 0,
    own: Mapping[str, NoiseModel] | None = None,
) -> Calibration:
    """Simulate ``sweeps`` sweeps of ``rates`` (trial -> true speed; ``own``: trials with a noise of their own)
    and judge every trial against ``baseline`` with :meth:`hfscale.results.stats.SweepNoise.against`, the method
    the report uses."""
    from hfscale.results.stats import sweep_noise

    rng = np.random.default_rng(seed)
    covered = compared = false_sweeps = found = different = untested = 0
    for _ in range(sweeps):
        evidence = sweep_noise(sweep_runs(model, rates, repeats, rng, own))
        false_here = False
        for name, rate in rates.items():
            if name == baseline:
                continue
            truth = rate / rates[baseline]
            said = evidence.against(name, baseline)
            compared += 1
            if said.ratio is None:
                untested += 1
                different += truth != 1  # a real difference left untested is a difference not found
                continue
            covered += said.ratio.contains(truth)
            if truth == 1:
                false_here |= said.verdict in ("higher", "lower")
            else:
                different += 1
                found += said.verdict == ("higher" if truth > 1 else "lower")
        false_sweeps += false_here
    tested = compared - untested
    return Calibration(
        sweeps=sweeps,
        coverage=covered / tested if tested else float("nan"),
        false_verdict_sweeps=false_sweeps / sweeps,
        found=found / different if different else None,
        untested=untested / compared if compared else 0.0,
    )


__all__ = ["Calibration", "NoiseModel", "calibrate", "drift", "interleaved_ticks", "step_times", "sweep_runs"]
