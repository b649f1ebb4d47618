"""``python -m hfscale.trial SPEC.json --result RESULT.json``: the trial process's command line, which runs a
recipe trial (:func:`hfscale.trial.train.run_trial`) or the user's own script (:func:`hfscale.trial.script.run_script`)
as the spec says."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from hfscale.configs import TRAINING_ARGS_FILE
from hfscale.core.collector import exit_without_teardown
from hfscale.trial.script import run_script
from hfscale.trial.train import leave_out_peft_unless_used, process_start_time, run_trial
from hfscale.workload.spec import TrialSpec

logger = logging.getLogger("hfscale.trial.train")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hfscale.trial",
        description="Run one trial (one rank of it): train, verify what ran, write the result (main process).",
        epilog="Launched by the sweep as: accelerate launch --config_file accelerate.yaml -m hfscale.trial "
        "SPEC.json --result RESULT.json. Exit 0: result written (status ok or not_applied); non-zero: training "
        "raised (traceback on stderr); 2: usage error.",
    )
    parser.add_argument("spec", type=Path, help="the TrialSpec JSON (TrialSpec.write)")
    parser.add_argument("--result", type=Path, default=None, help="where the main process writes the result JSON")
    parser.add_argument(
        "--training-args",
        type=Path,
        default=None,
        help=f"the strategy's TrainingArguments keywords (JSON); default: {TRAINING_ARGS_FILE} next to the spec, "
        "else computed from the spec's strategy",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level of hfscale (default WARNING)",
    )
    return parser


def main(argv: list[str] | None = None, *, process_ends: bool = False) -> int:
    """Entry point of ``python -m hfscale.trial``; returns the exit status.

    ``process_ends``: the process is the trial's own and exits right after (``__main__``). What the training stack's
    imports leave alive is then frozen out of the garbage collector's sight, before any user code runs
    (:mod:`hfscale.core.collector`); what a script or a factory makes later is collected as usual, at exit too. A
    recipe's own model and data then end here without the interpreter's teardown (a user's script or factory, whose
    objects may have finalisers to run, keeps it).
    """
    process_start = process_start_time()
    from hfscale.trial.watchdog import watch_driver

    watch_driver()  # a trial never outlives the sweep that started it (its whole group is killed when it dies)
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank{os.environ.get('RANK', '0')}] %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("hfscale").setLevel(args.log_level)
    try:
        spec = TrialSpec.read(args.spec)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        parser.error(f"{args.spec}: not a readable trial spec ({type(exc).__name__}: {exc})")
    if spec.script is None:  # a user's script may import peft itself
        leave_out_peft_unless_used(spec)
    ta_path = args.training_args
    if ta_path is None and (args.spec.parent / TRAINING_ARGS_FILE).is_file():
        ta_path = args.spec.parent / TRAINING_ARGS_FILE
    strategy_kwargs = None
    if ta_path is not None:
        try:
            strategy_kwargs = json.loads(ta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            parser.error(f"{ta_path}: not readable TrainingArguments JSON ({exc})")
        logger.info("strategy TrainingArguments from %s", ta_path)
    if spec.script is not None:
        run_script(
            spec,
            strategy_kwargs=strategy_kwargs,
            result_path=args.result,
            process_start=process_start,
            own_process=process_ends,
        )
        return 0
    run_trial(
        spec,
        strategy_kwargs=strategy_kwargs,
        result_path=args.result,
        process_start=process_start,
        own_process=process_ends,
    )
    if process_ends and spec.model.factory is None and spec.data.factory is None:
        exit_without_teardown(0)  # hfscale's own model and data, the result written: the teardown has nothing to do
    return 0
