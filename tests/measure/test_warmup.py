"""MSER warm-up detection on synthetic step times: known warm-ups found, steady runs called steady, drifting runs
not, and the rates checked over many seeded series rather than one lucky one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hfscale.measure.warmup import BATCH_FROM_STEPS, BATCH_SIZE, MIN_STEPS, detect_warmup
from hfscale.results.simulate import NoiseModel, step_times


def test_three_slow_steps_then_steady_are_found():
    """Over 100 seeded runs of 30 steps (1% noise after a 3-step warm-up), not one run keeps a slow step, and the
    most common answer is exactly 3 (simulated: 62%; the others leave out a few steady steps more, which costs
    samples but no bias, or call the short run unsteady: 6%)."""
    detections = []
    for seed in range(100):
        times = 0.1 * (1 + 0.01 * np.random.default_rng(seed).standard_normal(30))
        times[:3] = [0.9, 0.3, 0.2]  # compilation, then allocator growth
        detections.append(detect_warmup(times.tolist()))
    assert {d.method for d in detections} == {"MSER"}
    assert min(d.steps for d in detections) == 3
    assert sum(d.steps == 3 and d.steady for d in detections) >= 50
    assert sum(d.steady for d in detections) >= 85


def test_a_flat_noisy_series_leaves_out_little_and_is_steady():
    """100 seeded runs of 40 steady steps (3% noise): typically nothing is left out and the run is steady
    (simulated: 65% leave out nothing, 2.4% are called unsteady)."""
    detections = [detect_warmup(0.05 * (1 + 0.03 * np.random.default_rng(s).standard_normal(40))) for s in range(100)]
    assert np.median([d.steps for d in detections]) == 0
    assert sum(d.steady for d in detections) >= 90


def test_a_constant_series_leaves_out_nothing():
    # Exact zeros everywhere: rounding must not move the truncation point into the tail.
    detection = detect_warmup([0.25] * 20)
    assert (detection.steps, detection.steady) == (0, True)
    assert detect_warmup([1.0, *[0.1] * 19]).steps == 1


def test_a_series_that_drifts_down_all_the_way_is_not_steady():
    rng = np.random.default_rng(2)
    times = np.linspace(0.15, 0.10, 40) * (1 + 0.01 * rng.standard_normal(40))
    detection = detect_warmup(times)
    assert not detection.steady and detection.steps > 20


@pytest.mark.parametrize("times", [[], [0.1], [0.3, 0.1, 0.1]])
def test_too_short_a_series_leaves_out_nothing_and_is_not_steady(times):
    assert len(times) < MIN_STEPS
    detection = detect_warmup(times)
    assert (detection.steps, detection.steady) == (0, False)


def test_the_shortest_series_is_detected():
    detection = detect_warmup([0.5, 0.1, 0.1, 0.1])
    assert detection.steps == 1 and detection.steady


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_time_is_not_steady_and_leaves_out_nothing(bad):
    detection = detect_warmup([0.5, 0.1, bad, 0.1, 0.1, 0.1])
    assert (detection.steps, detection.steady) == (0, False)


def test_a_long_series_is_detected_on_batch_means_in_steps():
    rng = np.random.default_rng(3)
    n = BATCH_FROM_STEPS + 3  # a last partial batch, left out of the means
    times = 0.1 * (1 + 0.01 * rng.standard_normal(n))
    times[:3] = 0.5
    detection = detect_warmup(times)
    assert detection.method == "MSER-5"
    assert detection.steps == BATCH_SIZE and detection.steady  # the first batch of 5 holds the warm-up


def test_over_many_steady_series_the_warmup_is_left_out_and_the_run_called_steady():
    """200 runs of 40 steps: AR(1) noise (lag-1 0.5, 2%; the suite's simulated step times) after a 3-step warm-up.
    Simulated beforehand: the warm-up is never missed, and about 90% of runs are also called steady (the rest: a
    false "unsteady" from MSER on a short series, docs/callbacks.md)."""
    model = NoiseModel(run_sd=0.0, step_cv=0.02, step_autocorrelation=0.5, steps=40)
    times = step_times(model, 10.0, 200, np.random.default_rng(4))
    times[:, :3] *= [3.0, 1.5, 1.2]
    detections = [detect_warmup(run) for run in times]
    assert all(d.steps >= 3 for d in detections)
    assert sum(d.steady for d in detections) >= 170
    assert np.median([d.steps for d in detections]) == 3
