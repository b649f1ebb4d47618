"""``hfscale sweep`` / ``python -m hfscale.sweep`` / ``accelerate launch -m hfscale.sweep``: the command line.

Every option is declared once, on :class:`~hfscale.launch.plan.SweepSettings`' fields (flag, help, bounds); the parser
is derived from them, and a bound a value breaks is reported as ``hfscale sweep: error: --flag ...`` with exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import typing
from datetime import datetime
from pathlib import Path
from typing import Any

from hfscale.launch.group import LaunchInfo
from hfscale.launch.plan import SettingError, SweepError, SweepSettings
from hfscale.recipes.schema import RecipeError
from hfscale.recipes.workload import recipe_with_script
from hfscale.results.run_folder import RunFolder, RunFolderError
from hfscale.sweep.dry_run import dry_run_lines
from hfscale.sweep.loop import DEFAULT_OUT_DIR, run_sweep
from hfscale.sweep.outcome import (
    INTERRUPTED_EXIT,
    NOTHING_RAN_EXIT,
    STOPPED_EXIT,
    SweepInterrupted,
    SweepOutcome,
    SweepStopped,
)

logger = logging.getLogger(__name__)


def _log_level(text: str) -> str:
    """An ``argparse`` type: a level name the ``logging`` module knows (``WARN`` too), upper-cased."""
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {text!r}")
    return level


def driver_port(text: str) -> int:
    """An ``argparse`` type: the drivers' port, with room above it for a trial's rendezvous (PORT + 1 + i)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1024 <= port <= 65535 - 1024:
        raise argparse.ArgumentTypeError(f"must be between 1024 and 64511 (trials rendezvous above it), got {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """``hfscale sweep``'s parser; the options of :class:`SweepSettings` come from its fields' metadata."""
    parser = argparse.ArgumentParser(
        prog="hfscale sweep",
        description="Train a recipe's trials, each in a fresh process group, and record one result row per trial.",
        epilog="Also: python -m hfscale.sweep RECIPE, or accelerate launch [--num_processes N] -m hfscale.sweep RECIPE "
        "(trials that do not pin num_processes then use the launch's count). Exit status: 0 every trial has a row "
        "(failed trials included), 1 the rows are kept but the report (or a batch search) failed, 2 bad input, "
        "3 stopped: the run folder could not be written (disk full, read-only) or a device stayed in use by another "
        "sweep (the rows are kept; the message names the resume), 4 no trial ran: every run was skipped before "
        "launching (e.g. a cuda recipe where no GPU is visible; the message names the cause), 130 interrupted (the "
        "message names the resume).",
    )
    parser.add_argument("recipe", nargs="?", help="recipe YAML, or a shipped recipe's name (optional with --resume)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out-dir", type=Path, default=Path(DEFAULT_OUT_DIR), help="parent of the new run folder")
    where.add_argument("--run-dir", type=Path, help="the new run folder itself (must not exist)")
    where.add_argument("--resume", type=Path, metavar="RUN_DIR", help="run what is missing in this run folder")
    parser.add_argument("--dry-run", action="store_true", help="print the trials and their launch commands only")
    parser.add_argument(
        "--script",
        metavar="TRAIN_PY",
        help="run your own training script in every trial instead of the recipe's model and data; its arguments "
        "follow a -- at the end (hfscale sweep --script train.py RECIPE -- --dataset x ...)",
    )
    groups: dict[str | None, Any] = {
        None: parser,
        "memory": parser.add_argument_group("memory estimate and batch search"),
        "search": parser.add_argument_group(
            "adaptive search",
            "stop running trials that cannot win (docs/search.md); the question is the fastest "
            "trial that fits the memory budget, or with --min-samples-per-s the least memory at that speed",
        ),
    }
    hints = typing.get_type_hints(SweepSettings)
    for f in dataclasses.fields(SweepSettings):
        meta, kind = f.metadata, hints[f.name]
        options: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if kind is bool:
            options |= {"action": "store_true"}
        elif f.name == "only":
            options |= {"action": "append", "default": [], "metavar": meta["metavar"]}
        else:
            scalar = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
            options |= {"type": meta["parse"] or scalar, "default": f.default}
            if meta["metavar"]:
                options["metavar"] = meta["metavar"]
        groups[meta["group"]].add_argument(meta["flag"], **options)
    machines = parser.add_argument_group(
        "several machines",
        "one driver per machine, each started with the same command and its own --machine-rank (hfscale slurm "
        "writes them); machine 0 writes the rows and the report",
    )
    machines.add_argument("--machine-rank", type=int, metavar="K", help="this machine's rank, 0 to --num-machines - 1")
    machines.add_argument("--main-process-ip", metavar="HOST", help="machine 0's address, the same on every machine")
    machines.add_argument(
        "--main-process-port",
        type=driver_port,
        default=29500,
        metavar="PORT",
        help="machine 0's port for the drivers; trial i rendezvouses on PORT + 1 + i (default %(default)s)",
    )
    machines.add_argument(
        "--channel-bind",
        metavar="ADDR",
        help="machine 0's address for the other drivers (default: the one that routes to --main-process-ip; "
        "without HFSCALE_SWEEP_TOKEN only a loopback address)",
    )
    parser.add_argument("--no-report", action="store_true", help="do not write report.md/report.html at the end")
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=_log_level,
        help="logging level: DEBUG, INFO, WARNING (or WARN), ERROR, CRITICAL (default INFO)",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> SweepSettings:
    """The :class:`SweepSettings` of parsed arguments.

    Raises:
        SettingError: for a value out of its bounds (``SweepSettings.__post_init__``).
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SweepSettings)}
    return SweepSettings(**{**values, "only": tuple(values["only"])})


def machine_launch(args: argparse.Namespace, given: SweepSettings, launch: LaunchInfo) -> LaunchInfo:
    """This driver's place among several machines from ``--machine-rank``/``--main-process-ip`` (a driver started
    directly, one per machine); ``launch`` unchanged when neither is given.

    Raises:
        ValueError: naming the flag, when the place is incomplete or out of range, or also set by an outer launch.
    """
    if args.machine_rank is None and args.main_process_ip is None:
        return launch
    if launch.launched:
        raise ValueError(
            "--machine-rank/--main-process-ip: this driver was started by accelerate launch/torchrun, which sets its "
            "machine rank; start the driver directly on each machine (python -m hfscale.sweep ... --machine-rank K)"
        )
    if args.machine_rank is None or args.main_process_ip is None or given.num_machines is None:
        raise ValueError("several machines need --num-machines N, --machine-rank K and --main-process-ip HOST together")
    if not 0 <= args.machine_rank < given.num_machines:
        raise ValueError(f"--machine-rank {args.machine_rank} is out of range for --num-machines {given.num_machines}")
    return LaunchInfo(
        machine_rank=args.machine_rank,
        num_machines=given.num_machines,
        master_addr=args.main_process_ip,
        master_port=args.main_process_port,
    )


def _print(line: str) -> None:
    print(f"{datetime.now().strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: Any) -> None:
    """First Ctrl-C/SIGTERM/SIGHUP: stop the sweep. Later ones are ignored, so that ending the running trial's
    group (bounded: a few seconds' grace, then SIGKILL) is never cut short; a launcher forwards the same signal
    to this process a second time."""
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _parse_with_script(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments; with ``--script TRAIN_PY``, ``args.recipe`` is the recipe rewritten to run that script with
    the arguments after ``--`` (:func:`hfscale.recipes.workload.recipe_with_script`).

    Raises:
        RecipeError, OSError: when the recipe cannot be rewritten (not a mapping, no such script).
    """
    cut = argv.index("--") if "--" in argv else len(argv)
    args, script_args = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if (refusal := script_refusal(args, script_args)) is not None:
        parser.error(refusal)
    if args.script:
        args.recipe = str(recipe_with_script(args.recipe, args.script, script_args))
    return args


def script_refusal(args: argparse.Namespace, script_args: list[str]) -> str | None:
    """What the sweep refuses in ``--script`` and the arguments after ``--`` (``hfscale slurm`` asks the same before
    the job waits in the queue); None when they go together."""
    if script_args and not args.script:
        return "arguments after -- are the --script's: give --script TRAIN_PY"
    if args.script and (args.resume or not args.recipe):
        return "--script needs a RECIPE (a resumed run keeps the script its recipe copy names)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = _parse_with_script(parser, list(sys.argv[1:] if argv is None else argv))
    except (RecipeError, OSError) as exc:
        print(f"hfscale sweep: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launch = LaunchInfo.from_env()
    if not launch.is_driver:
        # The driver on local rank 0 of this machine runs every trial; a second driver would run them twice.
        logger.info(
            "rank %d (local rank %d): the driver on local rank 0 runs the sweep; exiting",
            launch.rank,
            launch.local_rank,
        )
        return 0
    try:
        given = settings_from_args(args)
    except SettingError as exc:
        flag = SweepSettings.__dataclass_fields__[exc.setting].metadata["flag"]
        print(f"hfscale sweep: error: {flag} {exc.problem}", file=sys.stderr)
        return 2
    try:
        launch = dataclasses.replace(machine_launch(args, given, launch), channel_bind=args.channel_bind)
    except ValueError as exc:
        print(f"hfscale sweep: error: {exc}", file=sys.stderr)
        return 2
    # A resumed run keeps its recorded counts; only a new run takes the outer launch's.
    settings = given if args.resume else launch.default_counts(given)
    try:
        if args.dry_run:
            return _dry_run(args, settings, launch)
        outcome = _sweep(args, settings, launch)
    except SweepStopped as exc:
        print(
            f"hfscale sweep: error: {exc}. Every row written before is kept in {exc.run_dir}; "
            f"once that is fixed, continue with: {exc.resume}",
            file=sys.stderr,
        )
        return STOPPED_EXIT
    except (RecipeError, SweepError, RunFolderError, OSError) as exc:
        print(f"hfscale sweep: error: {exc}", file=sys.stderr)
        return 2
    except SweepInterrupted as exc:
        where = "" if exc.rows_in == exc.run_dir else f" in machine 0's run folder {exc.rows_in}"
        _print(
            f"interrupted: finished trials are kept{where}, the running one was stopped and left no row; "
            f"continue with: {exc.resume}"
        )
        return INTERRUPTED_EXIT
    except KeyboardInterrupt:
        _print("interrupted before any trial started")
        return INTERRUPTED_EXIT
    if launch.machine_rank > 0:
        _print(f"done: machine {launch.machine_rank}'s part; its logs are in {outcome.run_dir}, the rows on machine 0")
        return 0
    return _finish(outcome)


def _dry_run(args: argparse.Namespace, settings: SweepSettings, launch: LaunchInfo) -> int:
    """``--dry-run``: print the trials and their launch commands, after what the sweep refuses at its start
    (:func:`hfscale.sweep.session.open_sweep`). With ``--resume``, what that run would go on with: its recipe's
    copy, its recorded settings (with what the command line changes) and its recorded noise floor.

    Raises:
        RecipeError: for an invalid recipe.
        SweepError: for a run folder that cannot be resumed.
    """
    if args.resume is None and args.recipe is None:
        print("hfscale sweep: error: give a RECIPE", file=sys.stderr)
        return 2
    from hfscale.sweep.session import open_sweep

    # The sweep's own start, which writes nothing: every check it makes before the first trial, made here too.
    start = open_sweep(args.recipe, resume=args.resume, settings=settings, launch=launch)
    if args.resume is None and args.run_dir is not None:
        RunFolder.check_new(args.run_dir)  # what RunFolder.create_at refuses when the sweep makes the folder
    lines = dry_run_lines(start.recipe, start.settings, launch, noise_floor=start.noise_floor)
    for line in lines:
        print(line)
    return 0


def _sweep(args: argparse.Namespace, settings: SweepSettings, launch: LaunchInfo) -> SweepOutcome:
    """The sweep, with Ctrl-C, a scheduler's SIGTERM and a closed terminal (SIGHUP) each ending the running trial's
    group, then the sweep; a signal the caller chose to ignore (nohup) stays ignored.

    Raises:
        as :func:`hfscale.sweep.loop.run_sweep`.
    """
    previous = {s: signal.signal(s, _interrupt) for s in _STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    outcome = run_sweep(
        args.recipe,
        out_dir=args.out_dir,
        run_dir=args.run_dir,
        resume=args.resume,
        settings=settings,
        launch=launch,
        report=not args.no_report,
        progress=_print,
    )
    # Not restored on an interrupt: the stop signals stay ignored until this process exits (see _interrupt).
    for s, handler in previous.items():
        signal.signal(s, handler)
    return outcome


def _finish(outcome: SweepOutcome) -> int:
    """Machine 0's last lines and the exit status: what this sweep added beside what the run folder now holds,
    what to run for anything that failed, and why nothing ran when nothing did."""
    _print(done_line(outcome))
    for error in outcome.search_errors:
        _print(f"{error}; the row is kept, continue with: {outcome.resume}")
    if outcome.report_error is not None:
        _print(
            f"the results are kept but no report was written ({outcome.report_error}); "
            f"run: hfscale report {outcome.run_dir}"
        )
    if (why := outcome.nothing_ran) is not None:
        print(f"hfscale sweep: error: {why}", file=sys.stderr)
        return NOTHING_RAN_EXIT
    return 1 if outcome.report_error is not None or outcome.search_errors else 0


def done_line(outcome: SweepOutcome) -> str:
    """``done: RUN: 1 row added (1 ok, 0 not ok); 4 of the recipe's 4 trials have rows``: a resumed sweep adds only
    what was missing, so its own count alone reads as if trials were missing."""
    decided = sum(r.search is not None for r in outcome.rows)  # an adaptive search's skipped and pruned rows
    failed = sum(r.status != "ok" for r in outcome.rows) - decided
    added = len(outcome.rows)
    have, of = len(outcome.trials_with_rows), len(outcome.recipe_trials)
    by_search = f", {decided} skipped or pruned by the search" if decided else ""
    return (
        f"done: {outcome.run_dir}: {added} row{'' if added == 1 else 's'} added ({added - failed - decided} ok, "
        f"{failed} not ok{by_search}); {have} of the recipe's {of} trials {'has' if have == 1 else 'have'} rows"
    )


__all__ = ["build_parser", "done_line", "main"]
