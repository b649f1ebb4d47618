"""How warm-up detection (``warmup_steps: auto``, :mod:`hfscale.measure.warmup`) does on simulated runs: how often it
calls a steady run unsteady, and how often it leaves out a known warm-up. The table in docs/callbacks.md.

Step times are :func:`hfscale.results.simulate.step_times` (5% step-to-step noise, AR(1) within a run, no run
offset): steady runs with no autocorrelation, this machine's lag-1 autocorrelation of 0.3 (docs/statistics.md) and
a strong 0.8; then runs with that 0.3 whose first three steps take 3x, 1.5x and 1.2x the steady time.

    python benchmarks/warmup_detection.py                       # 2,000 runs a row
    python benchmarks/warmup_detection.py --runs 500 --steps 20 50
    python benchmarks/warmup_detection.py --end-guard 0         # the textbook rule: every point a candidate
    python benchmarks/warmup_detection.py --batch-from 50       # MSER-5 from 50 steps
"""

from __future__ import annotations

import argparse

import numpy as np

from hfscale.measure import warmup
from hfscale.measure.warmup import detect_warmup
from hfscale.results.simulate import NoiseModel, step_times

WARMUP = np.array([3.0, 1.5, 1.2])
"""A known warm-up: compilation, then allocator growth and cold caches."""
MACHINE_AUTOCORRELATION = 0.3


def unsteady_share(steps: int, autocorrelation: float, runs: int, rng: np.random.Generator) -> float:
    """The share of steady runs that detection calls unsteady."""
    model = NoiseModel(run_sd=0.0, step_cv=0.05, step_autocorrelation=autocorrelation, steps=steps)
    return float(np.mean([not detect_warmup(run).steady for run in step_times(model, 10.0, runs, rng)]))


def warmup_left_out_share(steps: int, runs: int, rng: np.random.Generator) -> float:
    """The share of runs with :data:`WARMUP` whose detected warm-up covers all three slow steps."""
    model = NoiseModel(run_sd=0.0, step_cv=0.05, step_autocorrelation=MACHINE_AUTOCORRELATION, steps=steps)
    times = step_times(model, 10.0, runs, rng)
    times[:, : WARMUP.size] *= WARMUP
    return float(np.mean([detect_warmup(run).steps >= WARMUP.size for run in times]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="simulated runs a cell (default %(default)s)")
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 20, 30, 50, 100, 250], help="steps a run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--end-guard", type=float, default=warmup.END_GUARD, help="default %(default)s")
    parser.add_argument("--batch-from", type=int, default=warmup.BATCH_FROM_STEPS, help="default %(default)s")
    args = parser.parse_args()
    warmup.END_GUARD, warmup.BATCH_FROM_STEPS = args.end_guard, args.batch_from  # read at each call
    rng = np.random.default_rng(args.seed)
    print("| steps | steady run called unsteady: i.i.d. | lag-1 0.3 | lag-1 0.8 | 3-step warm-up left out |")
    print("|---|---|---|---|---|")
    for steps in args.steps:
        unsteady = [unsteady_share(steps, rho, args.runs, rng) for rho in (0.0, MACHINE_AUTOCORRELATION, 0.8)]
        left_out = warmup_left_out_share(steps, args.runs, rng)
        print(f"| {steps} | " + " | ".join(f"{share:.1%}" for share in [*unsteady, left_out]) + " |")


if __name__ == "__main__":
    main()
