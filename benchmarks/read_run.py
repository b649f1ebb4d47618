"""What reading a finished run costs: ``hfscale.load_run`` and ``hfscale report`` of a committed run folder.

Usage::

    python benchmarks/read_run.py                              # results/cpu_small-cpu2 and results/bert_large-h100
    python benchmarks/read_run.py RUN [RUN ...] --runs 10 --json read_run.json

Each measurement is a fresh interpreter (``python -c``), as a user meets it: the interpreter's start, the imports
(pandas, and whatever else reading pulls in) and the work, timed from outside as the process's wall time. The two
tasks alternate (load_run, report, load_run, report, ...) so that drift of the machine (other processes, the page
cache) reaches both alike. The report is written into a temporary folder, never into the committed run folder.

Printed per run folder and task: the median wall time over the runs with a distribution-free interval for it
(order statistics of the binomial: with 7 runs the slowest and fastest bound it at 98%), the fastest and slowest,
and whether any run imported torch or transformers (reading a finished run must not: issue 28). The goals of
issue 28, on 2 cores: ``load_run`` in 1.5 s or less, a report of 5 trials in 3 s or less.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RUNS = (REPO / "results" / "cpu_small-cpu2", REPO / "results" / "bert_large-h100")
GOALS_S = {"load_run": 1.5, "report": 3.0}

_CHILD = """
import sys
import hfscale
task, run, out = sys.argv[1:4]
if task == "load_run":
    hfscale.load_run(run)
else:
    from hfscale.report import write_report
    write_report(run, out_dir=out)
heavy = [name for name in ("torch", "transformers") if name in sys.modules]
print("heavy=" + ",".join(heavy))
"""


def run_once(task: str, run_dir: Path, out_dir: Path) -> tuple[float, list[str]]:
    """One fresh interpreter doing ``task``: its wall time in seconds and the heavy modules it imported.

    Raises:
        RuntimeError: with the child's stderr, when it failed.
    """
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, task, str(run_dir), str(out_dir)],
        capture_output=True,
        text=True,
        check=False,
        cwd=out_dir,
    )
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{task} of {run_dir} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("heavy="))
    return wall_s, [name for name in line.removeprefix("heavy=").split(",") if name]


def median_interval(samples: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The order-statistic interval for the median: the widest-inside pair (x_k, x_{n-k+1}) whose coverage,
    ``1 - 2 P(Binomial(n, 1/2) < k)``, is at least ``confidence`` (no distribution assumed); returns the bounds and
    that coverage. With too few samples for ``confidence`` it is the range, with its own (lower) coverage."""
    ordered = sorted(samples)
    n = len(ordered)

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= n // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def summarize(samples: list[float]) -> dict[str, Any]:
    low, high, cover = median_interval(samples)
    return {
        "median_s": statistics.median(samples),
        "median_low_s": low,
        "median_high_s": high,
        "median_interval_coverage": cover,
        "min_s": min(samples),
        "max_s": max(samples),
        "samples_s": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="*", type=Path, default=list(DEFAULT_RUNS), help="run folders to read")
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters per task and folder (default 7)")
    parser.add_argument("--json", type=Path, help="write every sample and statistic here")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2")
    results: dict[str, Any] = {"python": sys.version.split()[0], "cpus": _cpus(), "runs": {}}
    print(f"{args.runs} fresh interpreters per task; median [interval] (min-max) in seconds; {results['cpus']} CPUs")
    for run_dir in args.run_dirs:
        rows = sum(1 for line in (run_dir / "results.jsonl").read_text(encoding="utf-8").splitlines() if line.strip())
        samples: dict[str, list[float]] = {"load_run": [], "report": []}
        heavy: set[str] = set()
        with tempfile.TemporaryDirectory(prefix="hfscale-read-run-") as tmp:
            for _ in range(args.runs):
                for task in samples:
                    wall_s, imported = run_once(task, run_dir, Path(tmp))
                    samples[task].append(wall_s)
                    heavy.update(imported)
        entry = {"rows": rows, "imported": sorted(heavy), **{task: summarize(s) for task, s in samples.items()}}
        results["runs"][str(run_dir)] = entry
        for task in samples:
            s = entry[task]
            print(
                f"{run_dir.name} ({rows} rows) {task}: {s['median_s']:.2f} [{s['median_low_s']:.2f}, "
                f"{s['median_high_s']:.2f} at {s['median_interval_coverage']:.0%}] ({s['min_s']:.2f}-{s['max_s']:.2f})"
                f"; goal {GOALS_S[task]:g}"
            )
        print(f"{run_dir.name}: imported {', '.join(sorted(heavy)) or 'neither torch nor transformers'}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
