"""The sweep: run every trial of a recipe, each as its own freshly launched process group, and record each result.

Three ways to start it, the same program: ``hfscale sweep RECIPE``, ``python -m hfscale.sweep RECIPE``, and
``accelerate launch --num_processes N -m hfscale.sweep RECIPE``. Under a launcher, one process per machine (local
rank 0) is the *driver*; the other ranks exit at once (status 0). The driver launches each trial as its own process
group (:mod:`hfscale.launch.group`); a trial that does not pin ``num_processes``/``num_machines`` in the recipe gets the
outer launch's counts (or ``--num-processes``/ ``--num-machines``). On several machines each runs a driver
(``--machine-rank K``, or an outer launch across machines): machine 0's plans, writes the rows and the report; the
others follow its plan (:mod:`hfscale.sweep.machines`).

A failed trial is a row, not the end of the sweep: ``oom``, ``crashed`` (exit code or signal), ``timeout`` (the
whole group is killed), ``not_applied`` (the trial ran something other than its strategy), ``skipped`` (a missing
optional dependency or GPU, decided before launching). Rows are appended and fsynced one at a time to the run
folder (:class:`hfscale.results.run_folder.RunFolder`, which owns the layout and the lock); Ctrl-C, SIGTERM and SIGHUP
end the running trial's group and keep every finished row; ``--resume RUN`` runs what is missing.

Memory (:mod:`hfscale.estimate`): every row carries the trial's predicted peak (``row.estimate``), made before it
runs; ``--skip-predicted-oom`` does not launch a trial predicted not to fit ``--memory-budget`` (default: the GPU's
memory) and records it as ``skipped`` with the predicted figure. ``--find-max-batch`` then searches, for each
trial, the largest per-device batch that fits (:func:`hfscale.sweep.batch.search_trial`): the measured row is
appended first, and appended again with its ``batch_search`` when the search ends (a later line of the same
(trial, repeat) supersedes the earlier), so a failed or interrupted search never costs the measurement, and
``--resume`` runs only the search.

Loss parity (:mod:`hfscale.results.parity`) is computed here, once per row, as the row is appended: against the
baseline's
row when that is already in the run folder (the baseline runs first unless the recipe orders it otherwise). A row
appended before its baseline carries none; the report computes those from the curves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfscale.launch.device_lock import DeviceBusyError
from hfscale.launch.group import LaunchInfo, launch_group, launch_trial
from hfscale.launch.plan import (
    NO_BUDGET,
    PlannedRun,
    SweepError,
    SweepSettings,
    device_not_visible,
    estimate_runs,
    memory_budget,
    plan_runs,
)
from hfscale.launch.process import end_orphaned_group, free_port
from hfscale.recipes.recipe import Recipe, RecipeTrial, load_recipe
from hfscale.records.batch import BatchSearchRecord, ProbeOutcome
from hfscale.records.row import TrialResult
from hfscale.results.run_folder import RECIPE_FILE, RunFolder, RunFolderWriteError
from hfscale.sweep.batch import (
    batch_settings,
    comparison_baseline,
    fixed_batch_trials,
    mark_max_batch,
    max_batch_runs,
    search_key,
    search_trial,
    searched,
    why_not_searched,
)
from hfscale.sweep.channel import Coordinator
from hfscale.sweep.machines import lead_run, write_received_environments
from hfscale.sweep.outcome import INTERRUPTED_EXIT, STOPPED_EXIT, SweepInterrupted, SweepOutcome, SweepStopped
from hfscale.sweep.slurm import resume_command
from hfscale.workload.spec import SEQUENTIAL_MIN_RUNS, MeasureSpec, TrialSpec

logger = logging.getLogger(__name__)

DEFAULT_OUT_DIR = "runs"


def sequential_mark(row: TrialResult, measure: MeasureSpec) -> TrialResult:
    """``row`` saying that its trial's run count follows the sequential rule, when its recipe asks for a target
    precision (the rule stops on the results, and a reader should know)."""
    if measure.target_precision is None:
        return row
    return dataclasses.replace(
        row,
        stopping=(
            f"sequential: more runs until the run-level 95% interval is within ± {measure.target_precision:.1%}, "
            f"at least {SEQUENTIAL_MIN_RUNS} and at most {measure.most_runs} runs"
        ),
    )


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# -- the sweep ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Sweep:
    """One sweep over a locked run folder: what to run, with which settings, and the rows it appends."""

    folder: RunFolder
    recipe: Recipe
    trials: list[RecipeTrial]
    settings: SweepSettings
    launch: LaunchInfo
    environment: dict[str, Any]
    """This machine's record (``environment.json``, or this resumed run's entry in it)."""
    budget_bytes: int | None
    python: str = sys.executable
    progress: Callable[[str], None] = logger.info
    stored: dict[tuple[str, int], TrialResult] = field(default_factory=dict)
    """Every row in the run folder, by (trial, repeat), as it stands last."""
    appended: dict[tuple[str, int], TrialResult] = field(default_factory=dict)
    searches: dict[str, tuple[str, BatchSearchRecord]] = field(default_factory=dict)
    """Searched trials by :func:`hfscale.sweep.batch.search_key`: trials that differ only in their batch size
    have the same largest batch, searched once."""
    search_errors: list[str] = field(default_factory=list)
    coordinator: Coordinator | None = None
    """Machine 0's end of the drivers' channel (:mod:`hfscale.sweep.machines`) while a sweep on several machines
    runs."""
    across: set[int] = field(default_factory=set)
    """Indices of the runs on several machines published to the other machines' drivers."""

    @property
    def records(self) -> bool:
        """Machine 0's driver writes the rows; the others only join the trials that span them."""
        return self.launch.machine_rank == 0

    def plan(self) -> list[PlannedRun]:
        gpu_count = int(self.environment.get("gpu_count") or 0)
        machines = self.settings.num_machines or self.launch.num_machines
        runs = plan_runs(self.trials, gpu_count=gpu_count, num_machines=machines, only=self.settings.only)
        # The other machines follow this plan as machine 0 publishes it (hfscale.sweep.machines), never their own.
        return estimate_runs(runs, budget_bytes=self.budget_bytes, skip_predicted_oom=self.settings.skip_predicted_oom)

    def _needs_search(self, run: PlannedRun, row: TrialResult | None) -> bool:
        return (
            searched(run.trial, self.settings)
            and self.records
            and run.repeat == 0
            and row is not None
            and row.batch_search is None
        )

    def run(self) -> list[TrialResult]:
        """Launch every planned run without a row (and search every trial without its search); returns the rows
        appended, each as it stands last.

        Raises:
            KeyboardInterrupt: when interrupted; finished rows are on disk, the running trial's group was ended.
        """
        if self.folder.results_path.exists():
            self.stored = {row.key: row for row in self.folder.rows()}
        by_name = {t.name: t for t in self.trials}
        for row in self.stored.values():
            found = row.batch_search
            if row.trial in by_name and found is not None and found.searched and found.same_as is None:
                self.searches.setdefault(search_key(by_name[row.trial]), (row.trial, found))
        runs = self.plan()
        if (warning := device_not_visible(self.recipe, runs)) is not None:
            self.progress(warning)  # before the first trial, not after twenty skipped rows
        todo = [r for r in runs if r.key not in self.stored or self._needs_search(r, self.stored[r.key])]
        launches = sum(r.key not in self.stored for r in todo)
        self.progress(
            f"sweep {self.recipe.name}: {launches} of {len(runs)} runs to do"
            + (f" ({len(runs) - launches} already in {self.folder.path})" if self.stored else "")
            + (f", {len(todo) - launches} batch searches to finish" if len(todo) > launches else "")
            + f"; run folder {self.folder.path}"
        )
        if self.launch.num_machines > 1:
            self._lead([r for r in todo if r.key not in self.stored])
        try:
            self._run_all(runs, todo)
        finally:
            if self.coordinator is not None:
                write_received_environments(self.coordinator, self.folder.path)  # machines without a shared disk
                self.coordinator.close()
                self.coordinator = None
        return list(self.appended.values())

    def _lead(self, todo: list[PlannedRun]) -> None:
        """Machine 0 of several: serve the drivers' channel and publish the plan the other machines follow (the
        runs on several machines still to do, in order, each with its trial's spec), so that machine k launches
        exactly what machine 0 launches, on a resume too. The plan's id goes into ``RUN/machines/sweep-id``, by
        which a machine that shares the filesystem finds this run folder (and keeps its logs in it)."""
        import socket
        import uuid

        from hfscale.sweep.machines import check_port_block, coordination_port

        sweep_id = uuid.uuid4().hex
        try:
            self.folder.sweep_id_path.parent.mkdir(exist_ok=True)
            self.folder.sweep_id_path.write_text(sweep_id + "\n", encoding="utf-8")
        except OSError as exc:
            raise RunFolderWriteError(Path(exc.filename) if exc.filename else self.folder.path, exc) from exc
        port = coordination_port(self.launch.master_port or 29500, outer_launch=self.launch.launched)
        try:
            self.coordinator = Coordinator(port)
        except OSError as exc:
            raise SweepError(
                f"machine 0: cannot serve the other machines' drivers on port {port} ({exc}); choose another "
                "--main-process-port (the same on every machine)"
            ) from exc
        spans = [r for r in todo if r.trial.spec.strategy.num_machines > 1 and r.skip_reason is None]
        self.across = {r.index for r in spans}
        check_port_block([r.index for r in spans], port)
        self.coordinator.publish(
            "plan",
            {
                "sweep_id": sweep_id,
                "host": socket.gethostname(),
                "run_dir": str(self.folder.path.resolve()),
                "recipe": self.recipe.name,
                "settings": self.settings.to_dict(),
                "runs": [
                    {
                        "index": r.index,
                        "repeat": r.repeat,
                        "spec": r.trial.spec.to_dict(),
                        "run": dataclasses.asdict(r.trial.run),
                    }
                    for r in spans
                ],
            },
        )
        self.progress(
            f"machine 0 of {self.launch.num_machines}: {len(spans)} runs on several machines; the other machines' "
            f"drivers follow on port {port}"
        )

    def _run_all(self, runs: list[PlannedRun], todo: list[PlannedRun]) -> None:
        start = time.monotonic()
        failed_before: dict[str, str] = {}
        for k, run in enumerate(todo, 1):
            prefix = f"[{k}/{len(todo)}] "
            row = self.stored.get(run.key)
            if row is None:
                if run.name in failed_before:
                    run = dataclasses.replace(run, skip_reason=failed_before[run.name])
                row = self._launch(run, prefix, elapsed=time.monotonic() - start)
                if row.status not in ("ok", "not_applied") and run.repeat + 1 < run.repeats:
                    failed_before[run.name] = f"repeat {run.repeat + 1} ended {row.status}; not repeated"
            if self._needs_search(run, row):
                self._search(run, row, prefix)
        # sweep.batch: both|max: each searched trial again at its largest batch, after every fixed-batch run.
        for extra in estimate_runs(max_batch_runs(runs, self.stored, self.recipe), budget_bytes=self.budget_bytes):
            # Marked before its one append: an unmarked copy on disk would read as an ordinary trial on --resume.
            self._launch(
                extra,
                "[max batch] ",
                elapsed=time.monotonic() - start,
                mark=lambda row, extra=extra: mark_max_batch(row, extra, self.stored),
            )
        rounds = 0
        while more := self._runs_for_precision(runs, len(runs) + rounds):
            rounds += len(more)
            for run in more:
                self._launch(run, "[precision] ", elapsed=time.monotonic() - start)
        self.progress(
            f"sweep {self.recipe.name}: {len(todo)} runs in {_clock(time.monotonic() - start)}; "
            f"results in {self.folder.results_path}"
        )

    def _runs_for_precision(self, runs: list[PlannedRun], index: int) -> list[PlannedRun]:
        """One more run of every trial whose recipe asks for a target precision it has not reached (interleaved
        rounds, like the planned repeats): fewer than :data:`SEQUENTIAL_MIN_RUNS` ok runs, or a run-level interval
        (its geometric mean over runs, the sweep's run-to-run noise pooled: the verdicts' own statistics) wider
        than the target, while runs and time are left. A trial with a failed run, or on several machines (the
        other machines' drivers could not follow the decision), gets no more."""
        from hfscale.report.noise import run_rates
        from hfscale.results.stats import sweep_noise

        by_trial: dict[str, list[TrialResult]] = {}
        for key, row in self.stored.items():
            by_trial.setdefault(key[0], []).append(row)
        evidence = sweep_noise({name: run_rates(rows) for name, rows in by_trial.items()})
        more = []
        for first in (r for r in runs if r.repeat == 0 and r.skip_reason is None):
            measure = first.trial.spec.measure
            if measure.target_precision is None or first.trial.spec.strategy.num_machines > 1:
                continue
            rows = by_trial.get(first.name, [])
            if len(rows) >= first.repeats or any(r.status != "ok" for r in rows):
                continue
            if measure.max_time_s is not None and sum(r.wall_time_s or 0.0 for r in rows) >= measure.max_time_s:
                continue
            level = evidence.level(first.name)
            precision = level.half_width_rel if level is not None else math.inf
            usable = len(evidence.runs.get(first.name, ()))  # runs with a figure, not rows
            if usable >= SEQUENTIAL_MIN_RUNS and precision <= measure.target_precision:
                continue
            self.progress(
                f"{first.name}: ± {precision:.1%} after {len(rows)} run(s) (run-level), target "
                f"± {measure.target_precision:.1%} with at least {SEQUENTIAL_MIN_RUNS} runs: one more run"
            )
            repeat = max(key[1] for key in self.stored if key[0] == first.name) + 1  # never an existing key
            more.append(dataclasses.replace(first, repeat=repeat, index=index + len(more)))
        return more

    def _launch(
        self,
        run: PlannedRun,
        prefix: str,
        *,
        elapsed: float,
        mark: Callable[[TrialResult], TrialResult] = lambda row: row,
    ) -> TrialResult:
        predicted = run.estimate.total_gib if run.estimate is not None else None
        self.progress(
            f"{prefix}{run.label}: {run.trial.spec.strategy.describe()}"
            + (f"; predicted peak {predicted:.2f} GiB" if predicted is not None else "")
            + (f"; skipped: {run.skip_reason}" if run.skip_reason else "")
            + f"  (sweep elapsed {_clock(elapsed)})"
        )
        if self.coordinator is not None and run.trial.spec.strategy.num_machines > 1:
            row = lead_run(
                self.coordinator,
                run,
                launch_here=lambda: self._launch_here(run, prefix),
                published=run.index in self.across,
                baseline=comparison_baseline(self.recipe),
                wait_s=self.settings.machine_wait_s,
            )
        else:
            row = self._launch_here(run, prefix)
        row = sequential_mark(mark(row), run.trial.spec.measure)
        self._append(row)  # on disk before anything else can fail
        self.progress(f"{prefix}{run.name}: {row.progress_line()}")
        return row

    def _launch_here(self, run: PlannedRun, prefix: str) -> TrialResult:
        return launch_trial(
            run,
            self.folder,
            baseline=comparison_baseline(self.recipe),
            launch=self.launch,
            settings=self.settings,
            python=self.python,
            on_tick=lambda s: self.progress(f"{prefix}{run.label}: still running, {_clock(s)}"),
            progress=lambda line: self.progress(f"{prefix}{run.label}: {line}"),
        )

    def _append(self, row: TrialResult) -> None:
        """Append the row (machine 0 only), with its loss parity when the baseline's row is in the folder."""
        if not self.records:
            return
        earlier = [r for key, r in self.stored.items() if key != row.key]
        if row.status == "ok" and row.parity is None and (row.is_baseline or any(r.is_baseline for r in earlier)):
            from hfscale.results.parity import annotate_rows

            try:  # parity is advice on a row; a failure here must not cost the measurement
                # Copies: the earlier rows stand as they were written.
                annotate_rows([*(dataclasses.replace(r) for r in earlier), row])
            except Exception as exc:
                logger.warning("%s: loss parity not computed (%s: %s)", row.trial, type(exc).__name__, exc)
            if row.parity is not None and row.parity.flagged:
                self.progress(
                    f"loss parity: {row.trial} departs from the baseline {row.parity.baseline}: {row.parity.reason}"
                )
        self.folder.append(row)
        self.stored[row.key] = row
        self.appended[row.key] = row

    def _search(self, run: PlannedRun, row: TrialResult, prefix: str) -> None:
        """The trial's batch search, appended as the row again with ``batch_search`` set."""
        say = lambda line: self.progress(f"{prefix}{run.name}: {line}")  # noqa: E731
        key = search_key(run.trial)
        why_not = why_not_searched(row, predicted_oom=run.predicted_oom)
        if why_not is not None:
            say(f"no batch search ({why_not})")
            record = BatchSearchRecord(searched=False, reason=why_not)
        elif key in self.searches:
            other, found = self.searches[key]
            say(f"batch search: the same as {other}'s (only the batch size differs)")
            record = dataclasses.replace(found, same_as=other, trial_run_batch_size=None)
        else:

            def launch_probe(spec: TrialSpec) -> ProbeOutcome:
                folder = self.folder.probe_dir(run.name, spec.strategy.per_device_batch_size)
                trial = dataclasses.replace(run.trial, spec=spec)
                launched = launch_group(
                    trial, folder, folder, port=free_port(), launch=self.launch, settings=self.settings,
                    python=self.python, progress=say, run_dir=self.folder.path,
                )  # fmt: skip
                return launched.as_probe()

            try:
                record = search_trial(
                    run.trial.spec,
                    row,
                    launch_probe,
                    budget_bytes=self.budget_bytes,
                    upper_limit=self.settings.max_batch_limit,
                    probe_steps=self.settings.probe_steps,
                    progress=say,
                )
            except Exception as exc:  # the measured row is on disk; --resume runs the search again
                error = f"{run.name}: the batch search failed: {type(exc).__name__}: {exc}"
                logger.warning("%s; its row is kept, resuming %s searches again", error, self.folder.path)
                self.search_errors.append(error)
                return
            self.searches[key] = (run.name, record)
        self._append(dataclasses.replace(row, batch_search=record))


def _write_report(
    run_dir: Path,
    progress: Callable[[str], None],
    *,
    memory_budget_bytes: int | None = None,
    price_per_hour: float | None = None,
) -> tuple[list[Path], str | None]:
    """The paths written and None, or no paths and why the report failed."""
    try:
        from hfscale.report import write_report
    except ImportError as exc:
        logger.warning("no report written (%s); run `hfscale report %s` later", exc, run_dir)
        return [], f"ImportError: {exc}"
    try:
        written = write_report(run_dir, memory_budget_bytes=memory_budget_bytes, price_per_hour=price_per_hour)
    except Exception as exc:  # a report bug must not cost the measurements, which are already on disk
        logger.warning("writing the report failed: %s: %s; run `hfscale report %s`", type(exc).__name__, exc, run_dir)
        if isinstance(exc, OSError) and not exc.filename:  # a full disk's write() names no file
            return [], f"{type(exc).__name__} writing into {run_dir}: {exc}"
        return [], f"{type(exc).__name__}: {exc}"
    paths = [written.markdown, written.html, written.csv, *written.figures]
    if paths:
        progress(f"report: {', '.join(str(p) for p in paths)}")
    return paths, None


def run_sweep(
    recipe_path: str | os.PathLike[str] | None,
    *,
    out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR,
    run_dir: str | os.PathLike[str] | None = None,
    resume: str | os.PathLike[str] | None = None,
    settings: SweepSettings | None = None,
    launch: LaunchInfo | None = None,
    report: bool = True,
    python: str = sys.executable,
    progress: Callable[[str], None] = logger.info,
) -> SweepOutcome:
    """Run a recipe's trials into a run folder (new, or ``resume``'s), one fresh process group per trial.

    Args:
        recipe_path: the recipe (a path, or a shipped recipe's name); with ``resume``, optional (the run folder's
            copy is used) and must match it.
        out_dir: parent of a new run folder.
        run_dir: exactly this new run folder instead.
        resume: a run folder to complete: only runs without a row are launched (and searches without a record run),
            with the recorded settings; of ``settings``, what differs from the defaults applies
            (:meth:`SweepSettings.for_resume`: ``timeout_s``, ``memory_limit_gib``, ``only``, ...).
        settings: process counts, limits and ``only`` (default: the outer launch's counts).
        launch: where this process sits in an outer launch (default: read from the environment).
        report: write ``report.md``/``report.html`` at the end.
        python: the interpreter that runs ``accelerate launch``.
        progress: receives one line per event (trial start, heartbeat, result).

    Raises:
        RecipeError: for an invalid recipe.
        SweepError: when the recipe and run folder disagree, or a resumed run changes its process counts.
        RunFolderError: when the run folder exists or is locked by another sweep.
        KeyboardInterrupt: when interrupted; finished rows are on disk, the running trial's group was ended.
        SweepStopped: when the run folder cannot be written (disk full, read-only) or a device stayed held by
            another sweep; finished rows are on disk.
    """
    from hfscale.recipes.catalog import resolve_recipe
    from hfscale.results.environment import collect_environment

    launch = launch or LaunchInfo.from_env()
    if launch.machine_rank > 0:
        from hfscale.sweep.machines import follow_sweep

        # Another machine's driver follows machine 0's plan: it needs no run folder of its own to plan from.
        return follow_sweep(
            launch, out_dir=out_dir, run_dir=run_dir, resume=resume, settings=settings, python=python, progress=progress
        )
    if resume is not None:
        folder = RunFolder(Path(resume))
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
        settings = SweepSettings.from_dict(recorded.get("sweep", {})).for_resume(settings or SweepSettings())
    else:
        if recipe_path is None:
            raise SweepError("give a RECIPE (or --resume RUN_DIR)")
        recipe = load_recipe(recipe_path)
        settings = settings or launch.default_counts(SweepSettings())
    settings = batch_settings(recipe.sweep, settings)
    trials = recipe.resolve(num_processes=settings.num_processes, num_machines=settings.num_machines)
    trials = fixed_batch_trials(trials)
    # Read before the run folder exists, so that a sweep that cannot start leaves nothing behind.
    sweep_info = {"sweep": settings.to_dict(), "launch": dataclasses.asdict(launch), "command": list(sys.argv)}
    current = collect_environment(python=python, extra=sweep_info)
    budget = memory_budget(settings, current)
    if settings.skip_predicted_oom and budget is None:
        raise SweepError(NO_BUDGET)

    if resume is None:
        if run_dir is not None:
            folder = RunFolder.create_at(Path(run_dir))
        else:
            folder = RunFolder.create(out_dir=out_dir, name=recipe.name)
    sweep = Sweep(
        folder=folder,
        recipe=recipe,
        trials=trials,
        settings=settings,
        launch=launch,
        environment=current,
        budget_bytes=budget,
        python=python,
        progress=progress,
    )
    try:
        with folder.locked():
            folder.check_writable()  # a read-only or full disk is found before the first trial, not after it
            if resume is None:
                if recipe.path:
                    folder.copy_recipe(recipe.path)
                folder.write_environment(current)
            else:
                # A trial of a sweep killed with SIGKILL (its watchdog normally ends it within a second) must not
                # run next to the trials resumed here.
                for pid_file in folder.pid_files():
                    if (pgid := end_orphaned_group(pid_file)) is not None:
                        progress(
                            f"{pid_file.parent.relative_to(folder.path)}: still running from an earlier sweep of "
                            f"this folder (process group {pgid}); stopped it"
                        )
                folder.record_resume(current)
                for bad in folder.set_aside_bad_lines():
                    progress(
                        f"{folder.results_path}:{bad.number}: not a valid row ({bad.error}); moved to "
                        f"{folder.corrupt_path.name}, its trial runs again"
                    )
            if launch.num_machines > 1:  # every machine's driver records its own (the others: hfscale.sweep.machines)
                from hfscale.results.environment import write_machine_environment

                try:
                    write_machine_environment(folder.path, 0, record=current)
                except OSError as exc:
                    raise RunFolderWriteError(folder.path, exc) from exc
            rows = sweep.run()
    except KeyboardInterrupt as exc:
        raise SweepInterrupted(folder.path, resume=_resume_hint(folder.path, settings, launch, current)) from exc
    except (RunFolderWriteError, DeviceBusyError) as exc:
        raise SweepStopped(folder.path, exc, resume=_resume_hint(folder.path, settings, launch, current)) from exc
    report_paths: list[Path] = []
    report_error = None
    if report and sweep.records and folder.results_path.exists():
        report_paths, report_error = _write_report(
            folder.path,
            progress,
            memory_budget_bytes=settings.memory_budget_bytes,
            price_per_hour=settings.price_per_hour,
        )
    have = {trial for trial, _ in sweep.stored}
    return SweepOutcome(
        run_dir=folder.path,
        rows=rows,
        report_paths=report_paths,
        report_error=report_error,
        search_errors=sweep.search_errors,
        recipe_trials=tuple(recipe.trial_names),
        trials_with_rows=tuple(name for name in recipe.trial_names if name in have),
        resume=_resume_hint(folder.path, settings, launch, current),
    )


def _resume_hint(run_dir: Path, settings: SweepSettings, launch: LaunchInfo, environment: dict[str, Any]) -> str:
    """The command that continues this run (:func:`hfscale.sweep.slurm.resume_command`): on several machines, every
    machine's driver (under Slurm, a new job), never machine 0's alone."""
    return resume_command(
        run_dir,
        num_machines=launch.num_machines,
        num_processes=settings.num_processes,
        gpus_per_node=int(environment.get("gpu_count") or 0),
        main_addr=launch.master_addr,
        port=launch.master_port,
    )


__all__ = [
    "DEFAULT_OUT_DIR",
    "INTERRUPTED_EXIT",
    "STOPPED_EXIT",
    "Sweep",
    "SweepError",
    "SweepInterrupted",
    "SweepOutcome",
    "SweepStopped",
    "run_sweep",
]
