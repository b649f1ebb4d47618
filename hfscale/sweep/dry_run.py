"""``hfscale sweep --dry-run``: what would run, each launch's command and predicted peak, without launching."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from hfscale.core.units import GIB
from hfscale.launch.group import LaunchInfo, trial_command
from hfscale.launch.plan import PlannedRun, SweepSettings, device_not_visible, estimate_runs, memory_budget, plan_runs
from hfscale.recipes.schema import Recipe
from hfscale.records.search import NoiseFloor
from hfscale.results.environment import gpu_info
from hfscale.results.run_folder import RunFolder
from hfscale.sweep.adaptive import noise_floor_of, question_of
from hfscale.sweep.skip import DEFAULT_SKIP_MARGIN, skip_by_estimate


def dry_run_lines(
    recipe: Recipe,
    settings: SweepSettings,
    launch: LaunchInfo,
    *,
    noise_floor: NoiseFloor | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The expanded trials, each one's predicted peak memory and the command each would run, without running
    anything (configs go to a temporary folder, shown as ``RUN/trials/NAME``), for the recipe and settings of a
    sweep's start (:func:`hfscale.sweep.session.open_sweep`, which has refused what the sweep refuses).
    ``noise_floor``: the floor that start read (else the settings' is read).

    Raises:
        SweepError: as :func:`estimate_runs` (``--skip-predicted-oom`` without a budget).
    """
    trials = recipe.resolve(
        num_processes=settings.num_processes, num_machines=settings.num_machines, repeats=settings.repeats
    )
    gpus = gpu_info(python=python)
    runs = plan_runs(
        trials, gpu_count=int(gpus.get("gpu_count") or 0), num_machines=settings.num_machines or 1, only=settings.only
    )
    budget = memory_budget(settings, gpus)
    runs = estimate_runs(runs, budget_bytes=budget, skip_predicted_oom=settings.skip_predicted_oom)
    lines = [f"recipe {recipe.name}: {len(trials)} trials, {len(runs)} runs (baseline {recipe.baseline})"]
    if (warning := device_not_visible(recipe, runs)) is not None:
        lines.append(warning)
    if budget is not None:
        lines.append(f"memory budget {budget / GIB:.2f} GiB per device")
    if settings.search == "adaptive":
        question = question_of(settings, budget, noise_floor or noise_floor_of(settings.noise_floor))
        lines.append(
            f"adaptive search for {question.words()}: at most the grid's {len(runs)} runs, plus the largest-batch "
            "rows of the contenders where the batch is an axis (docs/search.md)"
        )
        if (floor := question.noise_floor) is not None:
            lines.append(f"noise floor {floor.sd:.1%} of one run: {floor.source}")
    if settings.find_max_batch:
        lines.append(
            f"after each trial: search the largest batch that fits (up to {settings.max_batch_limit}, warm-up + "
            f"{settings.probe_steps} steps per probe, starting from "
            + ("the estimate's largest that fits the budget)" if budget is not None else "the trial's batch size)")
        )
    with tempfile.TemporaryDirectory(prefix="hfscale-dry-run-") as tmp:
        folder = RunFolder(Path(tmp).resolve())
        for run in runs:
            if run.repeat > 0:
                continue
            strategy = run.trial.spec.strategy
            lines.append(
                f"- {run.name}: {strategy.describe()}"
                + (" [baseline]" if run.name == recipe.baseline else "")
                + (f" [batch: {run.trial.batch}: also as {run.name}-maxbatch]" if run.trial.batch != "fixed" else "")
            )
            lines.append(f"    {_estimate_line(run)}")
            if run.skip_reason:
                lines.append(f"    skipped: {run.skip_reason}")
            elif settings.search == "adaptive" and (why := _skipped_by_search(run, budget)) is not None:
                lines.append(f"    skipped by the search: {why}")
            files_dir = folder.repeat_dir(run.name, run.repeat, run.repeats)
            cmd = trial_command(
                run.trial, folder.trial_dir(run.name), files_dir, launch=launch, port=29500, python=python
            )
            lines.append("    " + " ".join(part.replace(str(folder.path), "RUN") for part in cmd))
    return lines


def _skipped_by_search(run: PlannedRun, budget: int | None) -> str | None:
    predicted = run.estimate.total_gib if run.estimate is not None else None
    return skip_by_estimate(predicted, budget / GIB if budget is not None else None, DEFAULT_SKIP_MARGIN)


def _estimate_line(run: PlannedRun) -> str:
    e = run.estimate
    if e is None:
        return f"predicted peak: not estimated ({run.estimate_error})"
    parts = ", ".join(
        f"{name} {getattr(e, f'{name}_gib'):.3f}"
        for name in ("weights", "gradients", "optimizer", "activations", "overhead")
    )
    return f"predicted peak {e.total_gib:.3f} GiB per device ({parts})"
