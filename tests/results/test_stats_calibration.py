"""The verdicts' calibration, by simulation (``hfscale.results.simulate``): sweeps of a baseline, five identical trials
and one 15% slower, with run-level offsets and autocorrelated steps, judged by the report's own method.

Checked at 2, 3 and 5 runs a trial: the 95% intervals cover the true ratio at least 93% of the time, at most 5% of
sweeps (within the simulation's own error) call any identical trial faster or slower, and at the default repeats
the 15% difference is found at the noise the default is for (a few percent); on this machine's 15% the CPU
recipes' repeats find checkpointing's 0.65x. 0.3's per-pair bootstrap over steps fails the same
check (``benchmarks/calibration.py``).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
from helpers.paths import REPO

from hfscale.recipes.recipe import load_recipe
from hfscale.results.simulate import NoiseModel, calibrate, sweep_runs
from hfscale.results.stats import dunnett_critical, sweep_noise
from hfscale.workload.spec import DEFAULT_REPEATS

TRIALS = {"base": 1.0, **{f"same-{k}": 1.0 for k in range(1, 6)}, "slow": 1 / 1.15}
THIS_MACHINE = NoiseModel(run_sd=0.145, step_cv=0.055, step_autocorrelation=0.3, steps=14)
"""The 2-core development machine running ``benchmarks/aa_cpu.yaml``: runs of one trial 15% apart (the pooled
log standard deviation of 4 real A/A sweeps, 13.6-15.8%), steps 5.5% apart with lag-1 autocorrelation 0.3."""
GPU_LIKE = NoiseModel(run_sd=0.03, step_cv=0.02, step_autocorrelation=0.5, steps=50)
"""The few-percent run-to-run noise :data:`hfscale.workload.spec.DEFAULT_REPEATS` is chosen for."""
NOISE = {
    "this machine": THIS_MACHINE,
    "slow stretches (rho 0.8), 3% apart": NoiseModel(run_sd=0.03, step_cv=0.05, step_autocorrelation=0.8, steps=50),
}
SWEEPS = 1000
FALSE_VERDICT_LIMIT = 0.05 + 2 * math.sqrt(0.05 * 0.95 / SWEEPS)
"""5%, plus two standard errors of a share counted over 1000 simulated sweeps (the method's own rate, over 8000
sweeps: 4.6%, docs/statistics.md); 0.3's method said something false in 30-52% of sweeps."""


@pytest.mark.parametrize("repeats", [2, 3, 5])
@pytest.mark.parametrize("noise", list(NOISE))
def test_intervals_cover_and_a_sweep_rarely_calls_an_identical_trial_different(noise: str, repeats: int) -> None:
    said = calibrate(NOISE[noise], TRIALS, "base", repeats=repeats, sweeps=SWEEPS, seed=repeats)
    assert said.coverage >= 0.93, said
    assert said.false_verdict_sweeps <= FALSE_VERDICT_LIMIT, said


def test_a_true_15_percent_difference_is_found_at_the_default_repeats_at_gpu_noise() -> None:
    said = calibrate(GPU_LIKE, TRIALS, "base", repeats=DEFAULT_REPEATS, sweeps=SWEEPS, seed=7)
    assert said.found is not None and said.found >= 0.8, said


def test_the_cpu_recipes_repeats_find_checkpointing_on_this_machine() -> None:
    """At this machine's 15% run-to-run noise a 15% difference is beyond reach of any affordable repeats (docs:
    about 1 sweep in 4 at 5 runs); what the CPU recipes' 5 runs must find is a difference the size of gradient
    checkpointing's on the A/A model (0.65x)."""
    repeats = load_recipe("cpu_small").trials[0].spec.measure.repeats
    rates = {**TRIALS, "slow": 0.65}
    said = calibrate(THIS_MACHINE, rates, "base", repeats=repeats, sweeps=SWEEPS, seed=8)
    assert repeats == 5 and said.found is not None and said.found >= 0.9, said


def test_the_old_per_pair_step_bootstrap_fails_the_same_check() -> None:
    """0.3's method, kept in the benchmark only to show what it did: far more than 5% of identical sweeps call
    something different, and its intervals cover well under 93%."""
    path = REPO / "benchmarks" / "calibration.py"
    spec = importlib.util.spec_from_file_location("calibration_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    steady = NoiseModel(run_sd=0.015, step_cv=0.02, step_autocorrelation=0.0, steps=50)
    coverage, false_sweeps, _ = module.old_method(steady, 2, 100, seed=1)
    assert coverage < 0.93 and false_sweeps > 0.05


QUIET_RUNS = NoiseModel(run_sd=0.01, step_cv=0.02, step_autocorrelation=0.3, steps=14)
NOISY_RUNS = NoiseModel(run_sd=0.12, step_cv=0.055, step_autocorrelation=0.3, steps=14)
MIXED = {"base": 1.0, "same": 1.0, "fast": 1.08, **{f"multi-{k}": 0.5 + 0.05 * k for k in range(4)}}
"""cpu_small as the 2-core machine ran it: the single-process trials 1% apart run to run, the multi-process ones 12%,
the fastest 8% ahead of the baseline."""


SAME_UNEQUAL = {"base": 1.0, **{f"quiet-{k}": 1.0 for k in range(3)}, **{f"multi-{k}": 1.0 for k in range(3)}}
"""Seven identical trials, four of them quiet and three noisy: every verdict of a speed difference is false."""


FEW_RUNS_HIDE_UNEQUAL_NOISE = pytest.mark.xfail(
    strict=True,
    reason="known limit: at 2-3 runs Bartlett's test rarely sees that the noisy trials do not share the quiet ones' "
    "noise, so they are judged on a pool smaller than their own (false claims in 11-13% / 6-7% of such sweeps)",
)


@pytest.mark.parametrize(
    "repeats",
    [pytest.param(2, marks=FEW_RUNS_HIDE_UNEQUAL_NOISE), pytest.param(3, marks=FEW_RUNS_HIDE_UNEQUAL_NOISE), 5],
)
def test_identical_trials_of_unequal_noise_are_rarely_called_different(repeats: int) -> None:
    own = {name: NOISY_RUNS for name in SAME_UNEQUAL if name.startswith("multi")}
    said = calibrate(QUIET_RUNS, SAME_UNEQUAL, "base", repeats=repeats, sweeps=SWEEPS, seed=20 + repeats, own=own)
    assert said.coverage >= 0.93, said
    assert said.false_verdict_sweeps <= FALSE_VERDICT_LIMIT, said


def test_when_trials_do_not_share_their_noise_the_quiet_ones_are_still_told_apart() -> None:
    """Pooled over every trial, 5 runs found the 8% lead in a minority of sweeps; on each pair's own noise nearly
    always, and the identical quiet pair is still called different in at most 5% of sweeps."""
    own = {name: NOISY_RUNS for name in MIXED if name.startswith("multi")}
    said = calibrate(QUIET_RUNS, MIXED, "base", repeats=5, sweeps=SWEEPS, seed=11, own=own)
    assert said.coverage >= 0.93, said
    assert said.false_verdict_sweeps <= FALSE_VERDICT_LIMIT, said
    rng = np.random.default_rng(12)
    sweeps = [sweep_noise(sweep_runs(QUIET_RUNS, MIXED, 5, rng, own)) for _ in range(300)]
    found = sum(evidence.against("fast", "base").verdict == "higher" for evidence in sweeps) / len(sweeps)

    def pooled_finds(evidence) -> bool:  # 0.4.0.dev0's verdict: every trial's runs in one pool, Dunnett
        critical = dunnett_critical(5, (5,) * (len(MIXED) - 1), evidence.noise.df, 0.95)
        return evidence.noise.ratio(evidence.runs["fast"], evidence.runs["base"], critical, 0.95).low > 1.02

    pooled = sum(map(pooled_finds, sweeps)) / len(sweeps)
    assert found >= 0.9 and pooled < 0.5, (found, pooled)
