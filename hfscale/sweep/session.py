"""A sweep's dealings with its run folder: what it starts with (a new run or a resumed one), the folder made ready
under its lock, the report at the end, and the command that continues it.

Everything that can refuse a sweep (a bad recipe, a resumed run's changed counts, no memory budget) is read and
checked by :func:`open_sweep` before the run folder exists, so that a sweep that cannot start leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfscale.launch.device_lock import check_lock_environment
from hfscale.launch.group import LaunchInfo
from hfscale.launch.plan import NO_BUDGET, SettingError, SweepError, SweepSettings, memory_budget
from hfscale.launch.process import end_orphaned_group
from hfscale.recipes.recipe import load_recipe
from hfscale.recipes.schema import Recipe, RecipeTrial
from hfscale.records.search import NoiseFloor
from hfscale.results.run_folder import RECIPE_FILE, RunFolder, RunFolderWriteError
from hfscale.sweep.adaptive import (
    check_adaptive,
    noise_floor_of,
    recorded_floor,
    refuse_search_keys,
    search_settings,
)
from hfscale.sweep.batch import check_batch_search
from hfscale.sweep.batch_axis import batch_settings, fixed_batch_trials
from hfscale.sweep.slurm import resume_command

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


@dataclass(frozen=True, kw_only=True)
class SweepStart:
    """What a sweep runs with, read and checked before its run folder is created or locked."""

    recipe: Recipe
    trials: list[RecipeTrial]
    """The recipe's trials with the sweep's process and machine counts, as the sweep runs them at their own batch."""
    settings: SweepSettings
    """The command line's settings (a resumed run's recorded ones, with what may change for it)."""
    environment: dict[str, Any]
    """This machine's record (``environment.json``, or this resumed run's entry in it)."""
    budget_bytes: int | None
    """The memory per device trials must fit (:func:`hfscale.launch.plan.memory_budget`)."""
    resumed: RunFolder | None
    """The run folder to complete; None for a new run."""
    noise_floor: NoiseFloor | None = None
    """An adaptive search's noise floor, read once when the run starts and recorded in ``environment.json``: a
    resumed search keeps it even if the folder it came from has changed or gone."""


def open_sweep(
    recipe_path: PathLike | None,
    *,
    resume: PathLike | None,
    settings: SweepSettings | None,
    launch: LaunchInfo,
    python: str = sys.executable,
) -> SweepStart:
    """The recipe, trials, settings and environment of a new sweep (``recipe_path``) or of a resumed run folder
    (``resume``: its recorded recipe and settings; of ``settings``, what :meth:`SweepSettings.for_resume` lets
    change). Nothing is written.

    Raises:
        RecipeError: for an invalid recipe.
        SweepError: when the recipe and run folder disagree, a resumed run changes its process counts, or
            ``--skip-predicted-oom`` has no memory budget.
    """
    from hfscale.results.environment import collect_environment

    try:
        check_lock_environment()
    except ValueError as exc:
        raise SweepError(str(exc)) from None
    resumed = RunFolder(Path(resume)) if resume is not None else None
    recorded: dict[str, Any] = {}
    if resumed is not None:
        recipe, settings, recorded = _resumed(resumed, recipe_path, settings or SweepSettings())
    elif recipe_path is None:
        raise SweepError("give a RECIPE (or --resume RUN_DIR)")
    else:
        recipe = load_recipe(recipe_path)
        settings = settings or launch.default_counts(SweepSettings())
        refuse_search_keys(recipe.sweep, settings)
    settings = search_settings(recipe.sweep, batch_settings(recipe.sweep, settings))
    trials = recipe.resolve(
        num_processes=settings.num_processes, num_machines=settings.num_machines, repeats=settings.repeats
    )
    check_adaptive(trials, settings, num_machines=max(settings.num_machines or 1, launch.num_machines))
    check_batch_search(trials, settings)
    floor = _resumed_floor(resumed, recorded) if resumed is not None else None
    if floor is None and settings.search == "adaptive" and settings.noise_floor is not None:
        if resumed is not None:
            logger.warning("%s recorded no noise floor: reading it from %s again", resumed.path, settings.noise_floor)
        floor = noise_floor_of(settings.noise_floor)
    sweep_info = {"sweep": settings.to_dict(), "launch": dataclasses.asdict(launch), "command": list(sys.argv)}
    if floor is not None:
        sweep_info["noise_floor"] = dataclasses.asdict(floor)
    environment = collect_environment(python=python, extra=sweep_info)
    budget = memory_budget(settings, environment)
    if settings.skip_predicted_oom and budget is None:
        raise SweepError(NO_BUDGET)
    return SweepStart(
        recipe=recipe,
        trials=fixed_batch_trials(trials),
        settings=settings,
        environment=environment,
        budget_bytes=budget,
        resumed=resumed,
        noise_floor=floor,
    )


def _resumed_floor(folder: RunFolder, recorded: dict[str, Any]) -> NoiseFloor | None:
    """The noise floor a resumed search started with: as its ``environment.json`` recorded it, else, for a search
    run before that record, as its ``search.json`` did (written when it ended; a resumed search removes it)."""
    floor = recorded_floor(recorded)
    if floor is None:
        try:
            summary = folder.search()
        except (OSError, ValueError):  # a torn search.json: the floor is read from its source again
            summary = None
        floor = summary.noise_floor if summary is not None else None
    return floor


def _resumed(
    folder: RunFolder, recipe_path: PathLike | None, given: SweepSettings
) -> tuple[Recipe, SweepSettings, dict[str, Any]]:
    """A resumed run folder's recipe (its copy, which ``recipe_path``, when given, must match), its recorded
    settings with what ``given`` changes, and its recorded environment.

    Raises:
        SweepError: when it is no run folder, the recipes differ, or its record cannot be read.
    """
    from hfscale.recipes.catalog import resolve_recipe

    if not folder.recipe_path.exists():
        raise SweepError(f"--resume {folder.path}: no {RECIPE_FILE} there; is it a run folder?")
    if recipe_path is not None and resolve_recipe(recipe_path).read_bytes() != folder.recipe_path.read_bytes():
        raise SweepError(
            f"{recipe_path} differs from {folder.recipe_path}; resume with the run folder's recipe (omit RECIPE)"
        )
    recipe = load_recipe(folder.recipe_path)
    try:
        recorded = json.loads(folder.environment_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SweepError(f"--resume {folder.path}: cannot read {folder.environment_path.name} ({exc})") from None
    if not isinstance(recorded, dict):
        raise SweepError(
            f"--resume {folder.path}: {folder.environment_path.name} is not a JSON object (a {type(recorded).__name__})"
        )
    try:
        settings = SweepSettings.from_dict(recorded.get("sweep", {}))
    except SettingError as exc:
        raise SweepError(f"--resume {folder.path}: {folder.environment_path.name} records {exc}") from None
    return recipe, settings.for_resume(given), recorded


def run_folder(start: SweepStart, *, out_dir: PathLike, run_dir: PathLike | None) -> RunFolder:
    """The resumed run folder, or a new one: ``run_dir`` exactly, else one named after the recipe in ``out_dir``.

    Raises:
        RunFolderError: when the new folder exists.
    """
    if start.resumed is not None:
        return start.resumed
    if run_dir is not None:
        return RunFolder.create_at(Path(run_dir))
    return RunFolder.create(out_dir=out_dir, name=start.recipe.name)


def prepare_folder(folder: RunFolder, start: SweepStart, launch: LaunchInfo, progress: Callable[[str], None]) -> None:
    """Under the folder's lock, before the first trial: check it can be written, then record a new run (recipe,
    environment) or ready a resumed one (groups an earlier sweep left running ended, this resume recorded, unreadable
    lines set aside); on several machines, machine 0's own environment record.

    Raises:
        RunFolderWriteError: when the folder cannot be written (read-only, full).
    """
    folder.check_writable()  # a read-only or full disk is found before the first trial, not after it
    if start.resumed is None:
        if start.recipe.path:
            folder.copy_recipe(start.recipe.path)
        folder.write_environment(start.environment)
    else:
        # A trial of a sweep killed with SIGKILL (its watchdog normally ends it within a second) must not run next
        # to the trials resumed here.
        for pid_file in folder.pid_files():
            if (pgid := end_orphaned_group(pid_file)) is not None:
                progress(
                    f"{pid_file.parent.relative_to(folder.path)}: still running from an earlier sweep of this folder "
                    f"(process group {pgid}); stopped it"
                )
        folder.record_resume(start.environment)
        for bad in folder.set_aside_bad_lines():
            progress(
                f"{folder.results_path}:{bad.number}: not a valid row ({bad.error}); moved to "
                f"{folder.corrupt_path.name}, its trial runs again"
            )
    if launch.num_machines > 1:  # every machine's driver records its own (the others: hfscale.sweep.follow)
        from hfscale.results.environment import write_machine_environment

        try:
            write_machine_environment(folder.path, 0, record=start.environment)
        except OSError as exc:
            raise RunFolderWriteError(folder.path, exc) from exc


def write_report(
    run_dir: Path,
    progress: Callable[[str], None],
    *,
    memory_budget_bytes: int | None = None,
    price_per_hour: float | None = None,
) -> tuple[list[Path], str | None]:
    """The paths written and None, or no paths and why the report failed."""
    try:
        from hfscale.report import write_report as write
    except ImportError as exc:
        logger.warning("no report written (%s); run `hfscale report %s` later", exc, run_dir)
        return [], f"ImportError: {exc}"
    try:
        written = write(run_dir, memory_budget_bytes=memory_budget_bytes, price_per_hour=price_per_hour)
    except Exception as exc:  # a report bug must not cost the measurements, which are already on disk
        logger.warning("writing the report failed: %s: %s; run `hfscale report %s`", type(exc).__name__, exc, run_dir)
        if isinstance(exc, OSError) and not exc.filename:  # a full disk's write() names no file
            return [], f"{type(exc).__name__} writing into {run_dir}: {exc}"
        return [], f"{type(exc).__name__}: {exc}"
    paths = [written.markdown, written.html, written.csv, *written.figures]
    if paths:
        progress(f"report: {', '.join(str(p) for p in paths)}")
    return paths, None


def resume_hint(run_dir: Path, start: SweepStart, launch: LaunchInfo) -> str:
    """The command that continues this run (:func:`hfscale.sweep.slurm.resume_command`): on several machines, every
    machine's driver (under Slurm, a new job), never machine 0's alone."""
    return resume_command(
        run_dir,
        num_machines=launch.num_machines,
        num_processes=start.settings.num_processes,
        gpus_per_node=int(start.environment.get("gpu_count") or 0),
        main_addr=launch.master_addr,
        port=launch.master_port,
    )


__all__ = ["SweepStart", "open_sweep", "prepare_folder", "resume_hint", "run_folder", "write_report"]
