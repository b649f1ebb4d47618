"""Calibration of the verdicts by simulation: coverage of the 95% intervals, the share of sweeps that call an
identical trial faster or slower, and the share of true 15% differences found, at 2, 3 and 5 runs a trial.

Each simulated sweep has a baseline, five trials identical to it and one 15% slower, with the timing noise of
:class:`hfscale.results.simulate.NoiseModel` (run-level offsets, AR(1) steps). The method the report uses
(:meth:`hfscale.results.stats.SweepNoise.against`) is judged beside 0.3's method, re-implemented here only to show what
it did: a percentile bootstrap of each pair's ratio of mean step times, resampling runs and then steps, with no
adjustment for the many comparisons of a sweep.

    python benchmarks/calibration.py                     # this machine's noise (docs/statistics.md)
    python benchmarks/calibration.py --run-sd 0.03 --step-cv 0.05 --rho 0.8 --sweeps 2000
"""

from __future__ import annotations

import argparse

import numpy as np

from hfscale.results.simulate import NoiseModel, calibrate, step_times

TRIALS = {"base": 1.0, **{f"same-{k}": 1.0 for k in range(1, 6)}, "slow": 1 / 1.15}


def old_ratio(top: np.ndarray, bottom: np.ndarray, rng: np.random.Generator, resamples: int = 400) -> tuple:
    """0.3's interval of mean(bottom) / mean(top) step time: runs resampled, then steps within each."""

    def replicates(groups: np.ndarray) -> np.ndarray:
        runs, steps = groups.shape
        pick = rng.integers(0, runs, size=(resamples, runs))
        draws = rng.integers(0, steps, size=(resamples, runs, steps))
        return groups[pick[..., None], draws].mean(axis=(1, 2))

    ratio = replicates(bottom) / replicates(top)
    return bottom.mean() / top.mean(), *np.percentile(ratio, [2.5, 97.5])


def old_method(model: NoiseModel, repeats: int, sweeps: int, seed: int = 0) -> tuple[float, float, float]:
    """Coverage, false-verdict sweeps and 15% differences found by 0.3's per-pair bootstrap."""
    rng = np.random.default_rng(seed)
    covered = compared = false_sweeps = found = 0
    for _ in range(sweeps):
        times = {name: step_times(model, rate, repeats, rng) for name, rate in TRIALS.items()}
        false_here = False
        for name, rate in TRIALS.items():
            if name == "base":
                continue
            value, low, high = old_ratio(times[name], times["base"], rng)
            compared += 1
            covered += low <= rate <= high
            called = not (low <= 1 <= high) and abs(value - 1) > 0.02
            if rate == 1:
                false_here |= called
            else:
                found += called and high < 1
        false_sweeps += false_here
    return covered / compared, false_sweeps / sweeps, found / sweeps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-sd", type=float, default=0.15, help="run-level noise, sd of the log (default 0.15)")
    parser.add_argument("--step-cv", type=float, default=0.05, help="step-time CV within a run (default 0.05)")
    parser.add_argument("--rho", type=float, default=0.3, help="lag-1 autocorrelation of steps (default 0.3)")
    parser.add_argument("--slower", type=float, default=1.15, help="how much slower the different trial is")
    parser.add_argument("--steps", type=int, default=14, help="measured steps a run (default 14, cpu_small's)")
    parser.add_argument("--sweeps", type=int, default=1000)
    parser.add_argument("--old-sweeps", type=int, default=300, help="sweeps for 0.3's slower method")
    args = parser.parse_args()
    model = NoiseModel(run_sd=args.run_sd, step_cv=args.step_cv, step_autocorrelation=args.rho, steps=args.steps)
    TRIALS["slow"] = 1 / args.slower
    print(
        f"{model}; {args.sweeps} sweeps of {len(TRIALS)} trials (5 identical to the baseline, 1 {args.slower}x slower)"
    )
    print("runs | method | coverage of 95% | sweeps with a false verdict | the slower one found")
    for repeats in (2, 3, 5):
        new = calibrate(model, TRIALS, "base", repeats=repeats, sweeps=args.sweeps, seed=repeats)
        false_new = new.false_verdict_sweeps
        print(f"{repeats} | pooled runs, Dunnett | {new.coverage:.1%} | {false_new:.1%} | {new.found:.1%}")
        coverage, false, found = old_method(model, repeats, args.old_sweeps, seed=repeats)
        print(f"{repeats} | 0.3 bootstrap per pair | {coverage:.1%} | {false:.1%} | {found:.1%}")


if __name__ == "__main__":
    main()
