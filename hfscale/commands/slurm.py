"""``hfscale slurm``: its arguments; the sbatch script and the drivers' command lines are
:mod:`hfscale.sweep.slurm`'s."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from hfscale.commands.sweep import build_parser as sweep_parser
from hfscale.commands.sweep import driver_port, script_refusal, settings_from_args
from hfscale.core.files import os_error_text
from hfscale.launch.group import LaunchInfo
from hfscale.launch.plan import SettingError, SweepError, SweepSettings
from hfscale.recipes.schema import RecipeError
from hfscale.recipes.workload import recipe_with_script
from hfscale.results.run_folder import RunFolderError
from hfscale.sweep.session import open_sweep
from hfscale.sweep.slurm import SlurmJob


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfscale slurm",
        description="Write an sbatch script that runs a sweep on several nodes (one hfscale driver per node), and "
        "print each node's command for a cluster without Slurm.",
        epilog="Every option after -- goes to every driver's `hfscale sweep` (e.g. -- --timeout-s 900).",
    )
    parser.add_argument("recipe", help="recipe YAML (a path every node sees) or a shipped recipe's name")
    parser.add_argument("--nodes", type=int, required=True, help="nodes (machines), one driver on each")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node (0 for a CPU sweep)")
    parser.add_argument("--processes-per-node", type=int, help="trial processes per node (default: GPUs per node)")
    parser.add_argument("--resume", action="store_true", help="RECIPE is a run folder to complete")
    parser.add_argument("--run-dir", help="run folder on a shared filesystem (default runs/NAME-$SLURM_JOB_ID)")
    parser.add_argument("--job-name", help="Slurm job name (default hfscale-NAME)")
    parser.add_argument("--time", help="#SBATCH --time, e.g. 04:00:00")
    parser.add_argument("--partition", help="#SBATCH --partition")
    parser.add_argument("--account", help="#SBATCH --account")
    parser.add_argument(
        "--cpus-per-task",
        type=int,
        help="#SBATCH --cpus-per-task: cores per node (driver and trials; default 8 per GPU, at least 4)",
    )
    parser.add_argument("--python", default="python", help="interpreter on the nodes (default %(default)s)")
    parser.add_argument(
        "--setup", action="append", default=[], metavar="LINE", help="a line run before the drivers (repeatable)"
    )
    parser.add_argument("--out", type=Path, help="write the script here (default: print it)")
    parser.add_argument("--main-addr", default="MAIN_HOST", help="machine 0's address in the by-hand commands")
    parser.add_argument(
        "--port", type=driver_port, default=29500, help="the drivers' port in the by-hand commands (1024-64511)"
    )
    return parser


def what_the_drivers_refuse(job: SlurmJob) -> str | None:
    """What every node's driver would refuse at its start, found here before the job waits in the queue: an option
    after ``--`` that ``hfscale sweep`` does not take (or a value it refuses), a recipe that cannot be read, and a
    trial the job's counts do not fit (``num_processes`` not a multiple of the nodes, a batch the data cannot fill);
    None when they would all start."""
    argv = job.driver_argv("runs/check")[3:]  # less `python -m hfscale.sweep`
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, script_args = argv[:cut], argv[cut + 1 :]  # a script's own arguments are the script's
    parser = sweep_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        return f"the options after --: {exc}"
    if unknown:
        return f"the options after -- are not hfscale sweep's: {shlex.join(unknown)} (hfscale sweep --help lists them)"
    if (refusal := script_refusal(args, script_args)) is not None:
        return f"the options after --: {refusal}"
    try:
        settings = settings_from_args(args)
    except SettingError as exc:
        flag = SweepSettings.__dataclass_fields__[exc.setting].metadata["flag"]
        return f"the options after --: {flag} {exc.problem}"
    derived = None
    try:
        if args.script and not job.resume:
            derived = recipe_with_script(job.recipe, args.script, script_args)
        # The drivers' own start (it writes nothing): every check a node makes before its first trial.
        recipe, resume = (None, job.recipe) if job.resume else (derived or job.recipe, None)
        open_sweep(recipe, resume=resume, settings=settings, launch=LaunchInfo.from_env())
    except (RecipeError, SweepError, RunFolderError, OSError) as exc:
        return f"{exc} (checked here before the job waits in the queue; every node reads the same recipe)"
    finally:
        if derived is not None:
            shutil.rmtree(derived.parent, ignore_errors=True)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_list:
        at = args_list.index("--")
        args_list, extra = args_list[:at], args_list[at + 1 :]
    args = build_parser().parse_args(args_list)
    try:
        job = SlurmJob(
            recipe=args.recipe,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            processes_per_node=args.processes_per_node,
            resume=args.resume,
            run_dir=args.run_dir,
            job_name=args.job_name,
            time=args.time,
            partition=args.partition,
            account=args.account,
            cpus_per_task=args.cpus_per_task,
            python=args.python,
            setup=tuple(args.setup),
            sweep_args=tuple(extra),
        )
    except ValueError as exc:
        print(f"hfscale slurm: error: {exc}", file=sys.stderr)
        return 2
    refused = what_the_drivers_refuse(job)
    if refused is not None:
        print(f"hfscale slurm: error: {refused}", file=sys.stderr)
        return 2
    script = job.sbatch_script()
    if args.out is None:
        print(script, end="")
    else:
        try:
            args.out.write_text(script, encoding="utf-8")
        except OSError as exc:
            print(f"hfscale slurm: error: argument --out: {os_error_text(exc)}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}; submit it with: sbatch {args.out}")
    # With the script on stdout (`hfscale slurm ... > job.sbatch`), the by-hand commands go to stderr.
    out = sys.stderr if args.out is None else sys.stdout
    print("\nWithout Slurm, start one driver per node, in any order within --machine-wait-s:", file=out)
    for k, cmd in enumerate(job.node_commands(main_addr=args.main_addr, port=args.port)):
        print(f"  node {k}: {shlex.join(cmd)}", file=out)
    return 0
