"""A stand-in runner for the adaptive search: trials whose true speed and memory are known, runs drawn from a
machine's timing noise (:class:`hfscale.results.simulate.NoiseModel`), and the search's own :func:`next_step`
deciding what to run. ``tests/sweep/test_search.py`` and ``benchmarks/search_simulation.py`` count, over many
simulated sweeps, how often it recommends a trial slower than the true best and how many runs it spends against the
grid's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hfscale.results.simulate import NoiseModel, drift, interleaved_ticks, step_times
from hfscale.sweep.adaptive import MIN_SHORT_STEPS, SHORT_FRACTION
from hfscale.sweep.search import (
    Limits,
    Progress,
    Question,
    TrialState,
    next_step,
)
from hfscale.sweep.skip import DEFAULT_SKIP_MARGIN, skip_by_estimate


@dataclass(frozen=True, kw_only=True)
class SimTrial:
    """A trial whose truth is known."""

    name: str
    rate: float
    """True samples/s (the geometric mean its runs scatter around)."""
    memory_gib: float = 1.0
    """What every run measures (memory is far steadier than speed)."""
    predicted_gib: float | None = None
    """The estimate before it runs."""


@dataclass(frozen=True, kw_only=True)
class SimSearch:
    """One simulated search."""

    answer: str | None
    runs: int
    pruned: tuple[str, ...]
    skipped: tuple[str, ...]
    stop: str


def simulate_search(
    trials: Sequence[SimTrial],
    noise: NoiseModel,
    question: Question,
    *,
    repeats: int,
    rng: np.random.Generator,
    limits: Limits | None = None,
) -> SimSearch:
    """Run the search against the stand-in until it stops; its runs drift (``noise.drift_sd``) on the sweep's clock,
    one tick a run launched."""
    by_name = {t.name: t for t in trials}
    index = {t.name: k for k, t in enumerate(trials)}
    paths = drift(noise, len(trials), repeats * len(trials), rng)
    out: dict[str, str] = {}
    for t in trials:
        if skip_by_estimate(t.predicted_gib, question.budget_gib, DEFAULT_SKIP_MARGIN) is not None:
            out[t.name] = "skipped"
    rates: dict[str, list[float]] = {t.name: [] for t in trials}
    pruned: list[str] = []
    runs = 0
    while True:
        states = [_state(by_name[name], rates[name], repeats, out.get(name)) for name in by_name]
        step = next_step(states, question, limits or Limits(), Progress(runs=runs, elapsed_s=float(runs)))
        for decision in step.decisions:
            out[decision.trial] = decision.kind
            if decision.kind == "pruned":
                pruned.append(decision.trial)
        if step.stop is not None:
            return SimSearch(
                answer=step.answer, runs=runs, pruned=tuple(pruned),
                skipped=tuple(n for n, why in out.items() if why == "skipped"), stop=step.stop,
            )  # fmt: skip
        for name in step.run:
            model = noise if rates[name] else first_run_noise(noise)
            slow = paths[index[name], runs : runs + 1]
            rates[name].append(float(1.0 / step_times(model, by_name[name].rate, 1, rng, slow).mean()))
            runs += 1


def first_run_noise(noise: NoiseModel) -> NoiseModel:
    """A first run's noise: as :func:`hfscale.sweep.adaptive.first_run` shortens it, half the steps (at least
    :data:`~hfscale.sweep.adaptive.MIN_SHORT_STEPS`), so its mean carries more of the within-run noise."""
    if noise.steps <= MIN_SHORT_STEPS:
        return noise
    return dataclasses.replace(noise, steps=max(MIN_SHORT_STEPS, math.ceil(noise.steps * SHORT_FRACTION)))


def _state(trial: SimTrial, rates: list[float], repeats: int, out: str | None) -> TrialState:
    fit = trial.memory_gib if rates else None
    return TrialState(name=trial.name, rates=tuple(rates), runs=len(rates), cap=repeats, fit_gib=fit, out=out)


def grid_answer(
    trials: Sequence[SimTrial], noise: NoiseModel, budget_gib: float | None, *, repeats: int, rng: np.random.Generator
) -> str | None:
    """What a grid of ``repeats`` runs of every trial ranks first among those that fit (the point estimate: the
    report's pick when memory cannot break a tie)."""
    fitting = [t for t in trials if budget_gib is None or t.memory_gib <= budget_gib]
    if not fitting:
        return None
    ticks = interleaved_ticks(len(trials), repeats)
    paths = drift(noise, len(trials), ticks.size, rng)
    means = {
        t.name: float(np.log(1.0 / step_times(noise, t.rate, repeats, rng, paths[k, ticks[k]]).mean(axis=1)).mean())
        for k, t in enumerate(trials)
        if t in fitting
    }
    return max(means, key=lambda name: means[name])


__all__ = ["SimSearch", "SimTrial", "first_run_noise", "grid_answer", "simulate_search"]
