"""``hfscale report`` and ``hfscale compare``: their arguments and exit codes (0 written, 1 a significant
regression with ``compare --fail-on-regression``, 2 bad input)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hfscale.core.files import os_error_text
from hfscale.core.units import parse_memory_size
from hfscale.report.analysis import ReportError, summarize_run
from hfscale.report.compare import FAILED_IN_B, regressions, workload_difference, write_comparison_of
from hfscale.report.write import write_report


def _budget_arg(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _percent(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a percentage of 0 or more (e.g. 5 or 5%), got {text!r}")
    return value


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, message already printed)
        return int(exc.code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """``hfscale report RUN_FOLDER [--memory-budget 16GiB] [--out DIR]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="hfscale report",
        description="Write report.md, report.html and results.csv (tables, plots, recommendation) for a run folder.",
    )
    parser.add_argument("run_dir", metavar="RUN_FOLDER", help="a folder written by 'hfscale sweep'")
    parser.add_argument(
        "--memory-budget",
        type=_budget_arg,
        default=None,
        metavar="SIZE",
        help="per-device memory the recommended strategy must fit in, e.g. 16GiB, 80GB, 512MiB "
        "(default: the budget the sweep recorded, its recipe's sweep.memory_budget_gib or --memory-budget; else "
        "the GPU memory environment.json records; else none)",
    )
    parser.add_argument(
        "--price-per-hour",
        type=_positive,
        default=None,
        metavar="PRICE",
        help="price of one device for an hour (any currency): adds the cost per million tokens beside samples/s "
        "(devices = processes of the trial)",
    )
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write (default: the run folder)")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        paths = write_report(
            args.run_dir, memory_budget_bytes=args.memory_budget, out_dir=args.out, price_per_hour=args.price_per_hour
        )
    except ReportError as exc:
        print(f"hfscale report: error: argument RUN_FOLDER: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"hfscale report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hfscale report: error: cannot write the report: {os_error_text(exc)}", file=sys.stderr)
        return 2
    for path in (paths.markdown, paths.html, paths.csv, *paths.figures):
        print(path)
    return 0


def compare_main(argv: Sequence[str] | None = None) -> int:
    """``hfscale compare RUN_A RUN_B [--out DIR] [--fail-on-regression PCT]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="hfscale compare",
        description="The same trials (matched by name) of two run folders side by side, with B/A ratios, and for "
        "each trial in both a significance test of the change in speed ('B is 7.0% ± 2.1% slower' or 'no "
        "significant change': both runs' run-to-run noise pooled, Šidák-adjusted over the trials, 2% noise "
        "threshold).",
        epilog="Exit codes: 0 written (and no regression beyond --fail-on-regression); 1 --fail-on-regression PCT "
        "was given and a trial is significantly slower in B by more than PCT percent, or a trial that finished ok "
        "in A did not in B (the files are still written); 2 bad input.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="a folder written by 'hfscale sweep'")
    parser.add_argument("run_b", metavar="RUN_B", help="another one (other machine, other library versions)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write (default: ./compare-A-vs-B)")
    parser.add_argument(
        "--fail-on-regression",
        type=_percent,
        default=None,
        metavar="PCT",
        help="exit 1 when any trial is significantly slower in B (time per sample, 95%% interval beyond the 2%% "
        "noise threshold) by more than PCT percent, or finished ok in A and not in B (a run crashed, ran out of "
        "memory or timed out); changes that cannot be tested (fewer than two runs a side, or a trial that may be "
        "unstable) never fail",
    )
    parser.add_argument(
        "--allow-different-workloads",
        action="store_true",
        help="compare runs whose recipes trained different models, data or scripts (refused by default: the same "
        "trial name would then name different jobs)",
    )
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    summaries = []
    for name, value in (("RUN_A", args.run_a), ("RUN_B", args.run_b)):
        try:
            summaries.append(summarize_run(value))
        except ReportError as exc:
            print(f"hfscale compare: error: argument {name}: {exc}", file=sys.stderr)
            return 2
    different = workload_difference(*summaries)
    if different and not args.allow_different_workloads:
        print(f"hfscale compare: error: {different}; pass --allow-different-workloads to compare them", file=sys.stderr)
        return 2
    try:
        paths, tests = write_comparison_of(*summaries, out_dir=args.out)
    except ImportError as exc:
        print(f"hfscale compare: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hfscale compare: error: cannot write the comparison: {os_error_text(exc)}", file=sys.stderr)
        return 2
    for path in (paths.markdown, paths.html, paths.csv, *paths.figures):
        print(path)
    for _, test in tests.iterrows():
        print(f"{test['trial']}: {test['change_text']}")
    if args.fail_on_regression is not None:
        failing = regressions(tests, args.fail_on_regression)
        if failing:
            failed = [name for name in failing if tests.loc[name, "change"] == FAILED_IN_B]
            slower = [name for name in failing if name not in failed]
            said = [f"{', '.join(slower)} significantly slower in B by more than {args.fail_on_regression:g}%"]
            said = (said if slower else []) + ([f"{', '.join(failed)} finished ok in A, not in B"] if failed else [])
            print(f"hfscale compare: regression: {'; '.join(said)}", file=sys.stderr)
            return 1
    return 0


__all__ = ["compare_main", "main"]

if __name__ == "__main__":
    sys.exit(main())
