"""hfscale.results.stats: run-level intervals from pooled noise, the families of comparisons, and the within-run
diagnostics; each figure against one computed another way (scipy's own Dunnett test, a hand-pooled variance)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from hfscale.results import stats


def test_pooled_noise_is_the_one_way_anova_within_trial_variance() -> None:
    runs = {"a": [100.0, 110.0], "b": [50.0, 55.0, 52.0], "c": [80.0]}  # c: one run, no degrees of freedom
    noise = stats.pooled_noise(runs)
    logs = [np.log(runs["a"]), np.log(runs["b"])]
    squares = sum(float(((g - g.mean()) ** 2).sum()) for g in logs)
    assert noise.df == 3 and noise.trials == ("a", "b")
    assert noise.sd == pytest.approx(math.sqrt(squares / 3))
    assert stats.pooled_noise({"a": [1.0], "b": [2.0]}).df == 0


def test_dunnett_critical_value_matches_scipys_dunnett_test() -> None:
    rng = np.random.default_rng(1)
    control = rng.normal(0, 1, 3)
    treatments = [rng.normal(0, 1, n) for n in (2, 3, 5)]
    interval = sps.dunnett(*treatments, control=control, random_state=0).confidence_interval(0.95)
    groups = [control, *treatments]
    df = sum(g.size for g in groups) - len(groups)
    sd = math.sqrt(sum(float(((g - g.mean()) ** 2).sum()) for g in groups) / df)
    critical = stats.dunnett_critical(3, (2, 3, 5), df, 0.95)
    for g, low, high in zip(treatments, interval.low, interval.high, strict=True):
        diff, se = g.mean() - control.mean(), sd * math.sqrt(1 / g.size + 1 / 3)
        assert diff - critical * se == pytest.approx(low, abs=2e-3)
        assert diff + critical * se == pytest.approx(high, abs=2e-3)
    # One comparison is Student's t; more comparisons need a wider interval, below Bonferroni's.
    assert stats.dunnett_critical(2, (2,), 7, 0.95) == pytest.approx(sps.t.ppf(0.975, 7))
    six = stats.dunnett_critical(2, (2,) * 6, 7, 0.95)
    assert sps.t.ppf(0.975, 7) < six < sps.t.ppf(1 - 0.025 / 6, 7)


def test_a_ratio_is_the_same_either_way_round() -> None:
    """0.3 drew different bootstrap resamples for (a, b) and (b, a), so a verdict could depend on the order."""
    evidence = stats.sweep_noise({"a": [100.0, 104.0, 98.0], "b": [120.0, 118.0, 125.0]})
    ab, ba = evidence.pair("a", "b").ratio, evidence.pair("b", "a").ratio
    assert ab is not None and ba is not None
    assert ab.value == pytest.approx(1 / ba.value)
    assert (ab.low, ab.high) == pytest.approx((1 / ba.high, 1 / ba.low))
    assert evidence.pair("a", "b").verdict == "lower" and evidence.pair("b", "a").verdict == "higher"


def test_a_non_finite_run_leaves_that_trial_short_never_the_sweep() -> None:
    evidence = stats.sweep_noise({"a": [100.0, math.nan], "b": [100.0, 101.0], "c": [99.0, math.inf, 0.0]})
    assert evidence.against("a", "b").verdict == "untested" and "1 run" in (evidence.against("a", "b").why or "")
    assert evidence.noise.df == 1


def test_one_run_a_side_or_no_pooled_noise_is_untested() -> None:
    evidence = stats.sweep_noise({"a": [100.0], "b": [130.0]})
    said = evidence.against("b", "a")
    assert said.verdict == "untested" and said.ratio is None
    assert evidence.level("a") is None  # no degrees of freedom: no interval invented


def test_a_trial_far_outside_the_pool_is_flagged_and_gets_no_verdict() -> None:
    steady = {f"t{k}": [100.0 * (1 + 0.01 * k), 100.0 * (1 - 0.01 * k)] for k in range(6)}
    wild = {**steady, "wild": [60.0, 140.0]}
    flagged = stats.outliers(wild)
    assert list(flagged) == ["wild"] and "disagree far beyond" in flagged["wild"]
    evidence = stats.sweep_noise(wild)
    assert evidence.against("wild", "t0").verdict == "untested"
    assert "wild" in evidence.noise.trials  # kept in the pool: the sweep was that noisy, the others' intervals say so
    assert not stats.outliers(steady)


def test_a_difference_within_the_noise_threshold_is_a_tie_even_when_significant() -> None:
    evidence = stats.sweep_noise({"a": [100.0, 100.1, 99.9], "b": [101.5, 101.6, 101.4]})
    said = evidence.against("b", "a")
    assert said.ratio is not None and said.ratio.low > 1 and said.verdict == "tie"


def test_batch_means_see_the_autocorrelation_the_naive_error_misses() -> None:
    rng = np.random.default_rng(0)
    noise = np.empty(400)
    noise[0] = 0.0
    for t in range(1, noise.size):
        noise[t] = 0.9 * noise[t - 1] + rng.normal(0, 0.01)
    steps = 0.1 * (1 + noise)
    naive = steps.std(ddof=1) / math.sqrt(steps.size) / steps.mean()
    assert stats.batch_means_se(steps.tolist()) > 2 * naive
    assert stats.batch_means_se([0.1] * 5) is None  # fewer than two steps a batch


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: stats.sweep_noise({}, confidence=1.5), r"confidence: expected a value in \(0, 1\), got 1.5"),
        (lambda: stats.sweep_noise({}, noise_threshold=-1), "noise_threshold: expected a fraction >= 0"),
    ],
)
def test_bad_input_names_the_argument(call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_bartlett_p_matches_scipy_and_needs_two_trials_of_two_runs() -> None:
    runs = {"a": [100.0, 110.0, 104.0], "b": [50.0, 55.0, 52.0, 51.0], "c": [80.0, 95.0], "d": [70.0]}
    logs = [np.log(runs[name]) for name in "abc"]
    assert stats.shared_noise_p(runs) == pytest.approx(sps.bartlett(*logs).pvalue)
    assert stats.shared_noise_p({"a": [100.0, 110.0], "d": [70.0]}) is None
    assert stats.shared_noise_p({"a": [100.0, 100.0], "b": [50.0, 55.0]}) is None  # equal runs: no variance to test


# Quiet single-process trials (1% apart run to run) and noisy multi-process ones (12%), as a CPU sweep of
# cpu_small's strategies measured them: fp32 and ddp-x2 8% apart.
QUIET = {"fp32": [170.2, 172.9, 169.5, 171.8, 168.1], "ddp-x2": [186.0, 188.3, 184.9, 187.7, 183.2]}
NOISY = {
    f"multi-{k}": list(100.0 * np.exp(np.random.default_rng(k).normal(0, 0.12, 5)) * (1 + 0.1 * k)) for k in range(4)
}


def test_trials_that_do_not_share_their_noise_are_compared_on_their_own() -> None:
    """Pooled over every trial, the noisy trials' 12% widened the quiet pair's interval until ddp-x2's 8% lead was
    a tie (the grid of cpu_small, 0.4.0.dev0): the pool is for trials that share one noise."""
    evidence = stats.sweep_noise({**QUIET, **NOISY})
    assert evidence.shared_p is not None and evidence.shared_p < stats.HOMOGENEITY_ALPHA and not evidence.shared
    said = evidence.against("ddp-x2", "fp32")
    assert said.verdict == "higher" and said.ratio is not None and said.ratio.low > 1.05, said
    assert "Welch" in said.ratio.statistic
    pooled = stats.pooled_noise({**QUIET, **NOISY})
    assert evidence.run_sd("fp32") < 0.02 < 0.08 < pooled.sd  # each trial's own noise, not the pool's
    assert evidence.run_sd("fp32", "ddp-x2") == pytest.approx(stats.pooled_noise(QUIET).sd)
    # A noisy trial's interval is its own: wider than the quiet one's, from its own 4 degrees of freedom.
    quiet, noisy = evidence.level("fp32"), evidence.level("multi-0")
    assert quiet is not None and noisy is not None and noisy.half_width_rel > 3 * quiet.half_width_rel
    # Either way round, the same interval.
    ab, ba = evidence.pair("fp32", "ddp-x2").ratio, evidence.pair("ddp-x2", "fp32").ratio
    assert ab is not None and ba is not None and (ab.low, ab.high) == pytest.approx((1 / ba.high, 1 / ba.low))


def test_welch_ratio_is_welchs_t_interval() -> None:
    a, b = [100.0, 104.0, 98.0, 101.0], [120.0, 135.0, 110.0]
    la, lb = np.log(a), np.log(b)
    va, vb = la.var(ddof=1) / la.size, lb.var(ddof=1) / lb.size
    df = (va + vb) ** 2 / (va**2 / (la.size - 1) + vb**2 / (lb.size - 1))
    ratio = stats.welch_ratio(a, b, lambda d: float(sps.t.ppf(0.975, d)), 0.95)
    half = sps.t.ppf(0.975, df) * math.sqrt(va + vb)  # at Welch's own (fractional) degrees of freedom
    assert math.log(ratio.value) == pytest.approx(la.mean() - lb.mean())
    assert (math.log(ratio.low), math.log(ratio.high)) == pytest.approx(
        (la.mean() - lb.mean() - half, la.mean() - lb.mean() + half)
    )


def test_with_a_noise_floor_no_mean_is_known_better_than_one_run_of_it() -> None:
    """Five runs a side 1% apart, 10% between the sides: the pool calls it; with a 15% floor (28 df) each side's
    variance is the floor's (one run), so the interval is t(28) * 0.15 * sqrt(2) wide on the log scale and a tie."""
    runs = {"a": [110.0, 111.0, 109.5, 110.5, 110.2], "b": [100.0, 101.0, 99.5, 100.5, 100.2]}
    assert stats.sweep_noise(runs).against("a", "b").verdict == "higher"
    floor = stats.NoiseFloor(sd=0.15, df=28, source="a grid")
    said = stats.sweep_noise(runs, floor=floor).against("a", "b")
    assert said.verdict == "tie" and said.ratio is not None
    half = math.log(said.ratio.high / said.ratio.value)
    assert half == pytest.approx(sps.t.ppf(0.975, 28) * 0.15 * math.sqrt(2), rel=1e-6)
    level = stats.sweep_noise(runs, floor=floor).level("a")
    assert level is not None and math.log(level.high / level.value) == pytest.approx(sps.t.ppf(0.975, 28) * 0.15)


def test_a_floor_below_the_runs_own_noise_leaves_their_interval_but_for_the_family() -> None:
    """Where the runs vary more than the floor the floor does nothing to the standard error: the interval is the
    pool's, with Šidák's critical value over the family (one comparison here: Student's t on the pool's df)."""
    runs = {"a": [110.0, 130.0, 95.0], "b": [100.0, 120.0, 90.0]}
    plain = stats.sweep_noise(runs).against("a", "b").ratio
    floored = stats.sweep_noise(runs, floor=stats.NoiseFloor(sd=0.01)).against("a", "b").ratio
    assert plain is not None and floored is not None
    assert (floored.low, floored.high) == pytest.approx((plain.low, plain.high), rel=1e-9)


def test_a_floor_given_as_a_figure_is_taken_as_known() -> None:
    """No degrees of freedom of its own: where it replaces both sides' noise, the critical value is the normal's."""
    ratio = stats.floored_ratio(
        [100.0], [90.0], noise=None, floor=stats.NoiseFloor(sd=0.1), critical=lambda df: sps.t.ppf(0.975, df)
    )
    assert ratio is not None
    assert math.log(ratio.high / ratio.value) == pytest.approx(sps.norm.ppf(0.975) * 0.1 * math.sqrt(2), rel=1e-6)


def test_all_pairs_rest_on_the_floor_too_and_an_empty_side_has_no_interval() -> None:
    """The report's ties (all pairs) go through the same choice as the baseline's verdicts: with the floor, the
    close pair that the pool calls apart is a tie. A side without runs gives no interval rather than a NaN one."""
    runs = {"a": [110.0, 111.0, 109.5], "b": [100.0, 101.0, 99.5], "c": [50.0, 50.5, 49.8]}
    assert stats.sweep_noise(runs).pair("a", "b").verdict == "higher"
    floored = stats.sweep_noise(runs, floor=stats.NoiseFloor(sd=0.15, df=28))
    assert floored.pair("a", "b").verdict == "tie" and floored.pair("a", "c").verdict == "higher"
    floor = stats.NoiseFloor(sd=0.1)
    assert stats.floored_ratio([], [1.0], noise=None, floor=floor, critical=lambda df: 2.0) is None


def test_ratio_of_takes_welch_where_the_noise_is_not_shared_and_mixes_own_and_floor_per_side() -> None:
    """Unshared noise, no floor: Welch's interval, and none for a side of one run (its own noise is unknown). With a
    floor, each side takes the larger of its own variance of the mean and the floor's: here the noisy side keeps its
    own (with its 3 runs' 2 df), the quiet side takes the floor's (28 df), at their Welch-Satterthwaite df."""
    noisy, quiet = [100.0, 130.0, 80.0], [90.0, 90.5, 89.8]
    t975 = lambda df: float(sps.t.ppf(0.975, df))  # noqa: E731
    pool = stats.pooled_noise({"n": noisy, "q": quiet})
    welch = stats.ratio_of(noisy, quiet, noise=pool, shared=False, critical=t975)
    assert welch == stats.welch_ratio(noisy, quiet, t975, 0.95)
    assert stats.ratio_of([100.0], quiet, noise=pool, shared=False, critical=t975) is None
    floor = stats.NoiseFloor(sd=0.1, df=28)
    mixed = stats.ratio_of(noisy, quiet, noise=pool, shared=False, critical=t975, floor=floor)
    own = float(np.log(noisy).var(ddof=1)) / 3
    assert own > floor.sd**2 > float(np.log(quiet).var(ddof=1)) / 3
    df = (own + floor.sd**2) ** 2 / (own**2 / 2 + floor.sd**4 / 28)
    assert mixed is not None
    assert math.log(mixed.high / mixed.value) == pytest.approx(t975(df) * math.sqrt(own + floor.sd**2), rel=1e-9)


def test_under_a_noise_floor_a_trial_is_flagged_only_beyond_the_floor() -> None:
    """A search's repeats run close together: the pool of the other trials can be far below what the machine does
    over a longer time (0.1% against a grid's 9.3%, measured on cpu_budget). Under a floor, a trial's runs are
    tested against the larger of that pool and the floor: runs 15% apart (9.9% in sd of ln) are within a 9.3% floor,
    80% apart (41.6%) are not, and the reason says the floor."""
    runs = {"a": [100.0, 115.0], "b": [120.0, 120.1, 120.2], "c": [90.0, 90.1]}
    assert "a" in stats.sweep_noise(runs).flagged  # against the others' 0.1%
    floor = stats.NoiseFloor(sd=0.093, df=28, source="a grid")
    assert stats.sweep_noise(runs, floor=floor).flagged == {}
    wild = {**runs, "a": [100.0, 180.0]}
    flagged = stats.sweep_noise(wild, floor=floor).flagged
    assert set(flagged) == {"a"} and "beyond the noise floor (41.6% against the noise floor's 9.3%" in flagged["a"]


def test_a_floor_given_as_a_figure_is_a_known_variance_for_the_flag_too() -> None:
    """No degrees of freedom: the F test's denominator is exact, so its tail is chi-square's (F with a very large
    denominator df gives the same)."""
    from scipy.special import fdtrc

    runs = {"a": [100.0, 125.0], "b": [120.0, 120.1]}
    known = stats.outliers(runs, alpha=1.0, floor=stats.NoiseFloor(sd=0.093))
    ratio = (math.log(1.25) ** 2 / 2) / 0.093**2
    assert f"p = {float(fdtrc(1, 1e9, ratio)):.1g})" in known["a"]
    assert stats.outliers(runs, floor=stats.NoiseFloor(sd=0.093)) == {}
