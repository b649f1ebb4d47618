"""A real A/A check of the verdicts on this machine: ``benchmarks/aa_cpu.yaml`` (a baseline, five identical
trials and gradient checkpointing) swept several times, then judged as the report judges it.

Every "faster"/"slower" said of ``same-1`` .. ``same-5`` is a false verdict; ``ckpt`` must be found slower every
time. Each sweep runs every trial ``--repeats`` times in interleaved rounds, so its first r rounds are themselves a
sweep of r runs a trial: the check is made at each ``--at`` r from the same runs. Nothing is simulated.

    python benchmarks/aa.py --sweeps 4 --repeats 5            # about 6 minutes a sweep on 2 quiet cores
    python benchmarks/aa.py --analyse runs/aa/sweep-*          # judge finished sweeps again
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

RECIPE = Path(__file__).with_name("aa_cpu.yaml")
IDENTICAL = tuple(f"same-{k}" for k in range(1, 6))


def sweep(out: Path, repeats: int) -> tuple[Path, float]:
    """One sweep of the A/A recipe with ``repeats`` runs a trial; its folder and its seconds."""
    import yaml

    from hfscale.sweep.loop import run_sweep

    data = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    data["measure"]["repeats"] = repeats
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "aa.yaml"
    recipe.write_text(yaml.safe_dump(data), encoding="utf-8")
    start = time.monotonic()
    outcome = run_sweep(recipe, run_dir=out / "run", report=False, progress=lambda line: print(line, flush=True))
    return outcome.run_dir, time.monotonic() - start


def judge(run_dir: Path, rounds: int) -> dict[str, str]:
    """Each trial's verdict against the baseline from the first ``rounds`` runs of every trial."""
    from hfscale.report import summarize
    from hfscale.results.run_folder import RunFolder

    rows = [r for r in RunFolder(run_dir).rows() if r.repeat < rounds]
    frame = summarize(rows).trials
    return {name: str(frame.loc[name, "verdict"]) for name in frame.index}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweeps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--at", type=int, action="append", help="judge at this many runs a trial (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "aa")
    parser.add_argument("--analyse", type=Path, nargs="*", help="run folders of finished sweeps: judge only")
    args = parser.parse_args()
    folders = list(args.analyse or [])
    for k in range(len(folders), args.sweeps if not folders else 0):
        folder, seconds = sweep(args.out / f"sweep-{k + 1}", args.repeats)
        print(f"sweep {k + 1}: {seconds:.0f} s")
        folders.append(folder)
    for rounds in args.at or [2, 3, args.repeats]:
        verdicts = [judge(folder, rounds) for folder in folders]
        false = sum(any(v.get(n) in ("faster", "slower") for n in IDENTICAL) for v in verdicts)
        pairs = sum(v.get(n) in ("faster", "slower") for v in verdicts for n in IDENTICAL)
        ckpt = sum(v.get("ckpt") == "slower" for v in verdicts)
        print(
            f"{rounds} runs a trial: {false} of {len(verdicts)} sweeps called an identical trial different "
            f"({pairs} of {len(verdicts) * len(IDENTICAL)} pairs); ckpt found slower in {ckpt} of {len(verdicts)}"
        )


if __name__ == "__main__":
    main()
