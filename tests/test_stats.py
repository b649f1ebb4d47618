"""Intervals, ratios and ties, checked against distributions whose true values are known."""

import math

import numpy as np
import pytest

from hfscale.stats import (
    Interval,
    bootstrap_interval,
    coefficient_of_variation,
    ratio_interval,
    repeat_spread,
    verdict,
)


@pytest.mark.parametrize("statistic", ["mean", "median"])
def test_the_95_percent_interval_covers_the_true_value_about_95_percent_of_the_time(statistic):
    rng = np.random.default_rng(1)
    true = 0.1  # the mean and the median of a normal distribution
    covered = 0
    trials = 300
    for k in range(trials):
        sample = rng.normal(true, 0.01, size=60)
        covered += bootstrap_interval(sample, statistic=statistic, resamples=1000, seed=k).contains(true)
    # Percentile intervals run a little narrow on 60 samples; 300 trials give a binomial sd of ~1.3%.
    assert 0.89 <= covered / trials <= 0.99, covered / trials


def test_the_interval_narrows_with_more_samples():
    rng = np.random.default_rng(2)
    small = bootstrap_interval(rng.normal(1, 0.1, 20))
    large = bootstrap_interval(rng.normal(1, 0.1, 2000))
    assert large.half_width_rel < small.half_width_rel / 5  # ~ 1/sqrt(100) = 1/10 of the width


def test_drift_between_repeats_widens_the_interval_beyond_the_pooled_steps():
    rng = np.random.default_rng(3)
    repeats = [rng.normal(mean, 0.001, 200) for mean in (1.0, 1.1, 1.2)]
    hierarchical = bootstrap_interval(repeats)
    pooled = bootstrap_interval(np.concatenate(repeats))
    assert hierarchical.repeats == 3 and hierarchical.samples == 600
    assert hierarchical.value == pytest.approx(1.1, abs=1e-3)
    assert hierarchical.high - hierarchical.low > 5 * (pooled.high - pooled.low)
    assert repeat_spread(repeats) == pytest.approx(0.2 / 1.1, rel=0.01)


def test_a_constant_sample_has_a_point_interval():
    interval = bootstrap_interval([0.5] * 10)
    assert (interval.low, interval.value, interval.high) == (0.5, 0.5, 0.5)
    assert interval.half_width_rel == 0
    assert coefficient_of_variation([0.5] * 10) == 0


def test_a_decreasing_function_swaps_the_bounds():
    step_time = Interval(value=0.1, low=0.09, high=0.12, statistic="mean")
    per_s = step_time.map(lambda t: 8 / t)
    assert (per_s.low, per_s.value, per_s.high) == pytest.approx((8 / 0.12, 80, 8 / 0.09))


def test_a_real_difference_is_a_ranking_and_the_same_distribution_is_a_tie():
    rng = np.random.default_rng(4)
    base = rng.normal(0.10, 0.005, 100)
    same = rng.normal(0.10, 0.005, 100)
    faster = rng.normal(0.08, 0.005, 100)
    tie = ratio_interval(same, base)
    assert tie.contains(1.0) and verdict(tie) == "tie"
    ratio = ratio_interval(faster, base)
    assert ratio.value == pytest.approx(0.8, abs=0.02)
    assert verdict(ratio) == "lower"
    assert verdict(ratio_interval(base, faster)) == "higher"


def test_a_difference_within_the_noise_threshold_is_a_tie_even_when_significant():
    rng = np.random.default_rng(5)
    base = rng.normal(1.0, 0.0001, 500)
    slightly = rng.normal(1.01, 0.0001, 500)  # 1% apart, measured very precisely
    ratio = ratio_interval(slightly, base)
    assert not ratio.contains(1.0)
    assert verdict(ratio) == "tie"
    assert verdict(ratio, noise_threshold=0.005) == "higher"


def test_the_same_seed_gives_the_same_interval():
    sample = list(np.random.default_rng(6).normal(1, 0.1, 50))
    assert bootstrap_interval(sample, seed=7) == bootstrap_interval(sample, seed=7)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: bootstrap_interval([]), "expected at least one value"),
        (lambda: bootstrap_interval([1.0, math.nan]), "expected finite values"),
        (lambda: bootstrap_interval([1.0], statistic="mode"), "expected 'mean' or 'median', got 'mode'"),
        (lambda: bootstrap_interval([1.0], confidence=95), r"confidence: expected a value in \(0, 1\), got 95"),
        (lambda: ratio_interval([1.0], [0.0]), "its statistic is 0"),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
