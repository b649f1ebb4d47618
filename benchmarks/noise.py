"""How the 95% interval of steady-state samples/s narrows with measured steps and with repeats.

Runs a recipe (default: the shipped ``cpu_small``, only the trials named with ``--only``) with ``--repeats`` runs of
each trial, interleaved as the sweep runs them, then recomputes each trial's interval from the first k measured
steps of the first r runs (``hfscale.stats.bootstrap_interval``: over steps within one run, hierarchical over runs
and steps with several). Every figure comes from the step times the sweep stored; nothing is simulated.

    python benchmarks/noise.py --only fp32 --only bf16 --repeats 4
    python benchmarks/noise.py --run-dir runs/noise-...        # analyse a finished run again
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from hfscale.recipe import load_recipe
from hfscale.run_folder import RunFolder
from hfscale.stats import bootstrap_interval, ratio_interval, verdict


def run(recipe: str, only: list[str], repeats: int, out: Path) -> tuple[Path, float]:
    """Sweep ``recipe`` with every trial repeated ``repeats`` times into ``out``; the run folder and its seconds."""
    import yaml

    from hfscale.sweep import run_sweep

    loaded = load_recipe(recipe)
    data = yaml.safe_load(Path(loaded.path).read_text(encoding="utf-8"))
    data.setdefault("measure", {})["repeats"] = repeats
    data["measure"].pop("target_precision", None)
    data["trials"] = [t for t in data.get("trials", []) if not only or t.get("name") in only]
    data.pop("matrix", None)
    if only and data.get("baseline") not in only:
        data["baseline"] = only[0]
    path = out / f"{loaded.name}-noise.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    start = time.monotonic()
    outcome = run_sweep(path, run_dir=out / "run", report=False, progress=lambda line: print(line, flush=True))
    return outcome.run_dir, time.monotonic() - start


def table(run_dir: Path, steps: list[int]) -> list[str]:
    """Half-width of each trial's samples/s interval for the first k steps of the first r runs, and the verdict
    of each trial against the baseline with all of it."""
    rows = [r for r in RunFolder(run_dir).rows() if r.status == "ok" and r.throughput and r.throughput.step_times_s]
    by_trial: dict[str, list[list[float]]] = {}
    per_step: dict[str, int] = {}
    for row in sorted(rows, key=lambda r: r.repeat):
        by_trial.setdefault(row.trial, []).append(row.throughput.step_times_s)
        per_step[row.trial] = row.throughput.samples_per_step or 1
    lines = ["trial            runs  " + "  ".join(f"{k:>3} steps" for k in steps)]
    for trial, runs in by_trial.items():
        for r in range(1, len(runs) + 1):
            cells = []
            for k in steps:
                sample = [times[:k] for times in runs[:r]]
                if any(len(times) < k for times in sample):
                    cells.append("        -")
                    continue
                cells.append(f"± {bootstrap_interval(sample if r > 1 else sample[0]).half_width_rel:6.1%}")
            lines.append(f"{trial:16s} {r:4d}  " + "  ".join(cells))
    baseline = next((r.trial for r in rows if r.is_baseline), None)
    if baseline in by_trial:
        lines.append("")
        lines.append(f"against {baseline} (samples/s ratio, 95% interval, all steps of all runs):")
        for trial, runs in by_trial.items():
            if trial == baseline:
                continue
            # samples/s ratio = (trial samples per step / trial step time) / (baseline's)
            scale = per_step[trial] / per_step[baseline]
            ratio = ratio_interval(by_trial[baseline], runs).map(lambda x, scale=scale: x * scale)
            lines.append(
                f"  {trial:16s} {ratio.value:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}]  {verdict(ratio)}"
                + (f"  (first run only: {_first_run(by_trial[baseline], runs, scale)})" if len(runs) > 1 else "")
            )
    return lines


def _first_run(base: list[list[float]], runs: list[list[float]], scale: float) -> str:
    ratio = ratio_interval(base[0], runs[0]).map(lambda x: x * scale)
    return f"{ratio.value:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] {verdict(ratio)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="cpu_small")
    parser.add_argument("--only", action="append", default=[], help="trials to run (default: all)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 8, 14])
    parser.add_argument("--run-dir", type=Path, help="analyse this finished run instead of sweeping")
    args = parser.parse_args()
    if args.run_dir is None:
        out = Path(tempfile.mkdtemp(prefix="hfscale-noise-"))
        run_dir, seconds = run(args.recipe, args.only, args.repeats, out)
        print(f"\n{args.repeats} runs of each trial in {seconds:.0f} s; run folder {run_dir}\n")
    else:
        run_dir = args.run_dir
    print("\n".join(table(run_dir, args.steps)))
    print("\nhalf-width of the 95% bootstrap interval of steady-state samples/s, relative to the value")


if __name__ == "__main__":
    main()
