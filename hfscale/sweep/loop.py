"""The sweep: run every trial of a recipe, each as its own freshly launched process group, and record each result.

Three ways to start it, the same program: ``hfscale sweep RECIPE``, ``python -m hfscale.sweep RECIPE``, and
``accelerate launch --num_processes N -m hfscale.sweep RECIPE``. Under a launcher, one process per machine (local
rank 0) is the *driver*; the other ranks exit at once (status 0). The driver launches each trial as its own process
group (:mod:`hfscale.launch.group`); a trial that does not pin ``num_processes``/``num_machines`` in the recipe gets the
outer launch's counts (or ``--num-processes``/ ``--num-machines``). On several machines each runs a driver
(``--machine-rank K``, or an outer launch across machines): machine 0's plans, writes the rows and the report; the
others follow its plan (:mod:`hfscale.sweep.machines`, :mod:`hfscale.sweep.follow`).

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
baseline's row when that is already in the run folder (the baseline runs first unless the recipe orders it
otherwise). A row appended before its baseline carries none; the report computes those from the curves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfscale.core.text import clock
from hfscale.launch.device_lock import DeviceBusyError
from hfscale.launch.group import GroupRequest, LaunchInfo, launch_group
from hfscale.launch.plan import PlannedRun, SweepError, SweepSettings, device_not_visible, estimate_runs, plan_runs
from hfscale.launch.process import free_port
from hfscale.launch.rows import launch_trial
from hfscale.recipes.schema import Recipe, RecipeTrial
from hfscale.records.batch import BatchSearchRecord, ProbeOutcome
from hfscale.records.row import RAN_STATUSES, TrialResult
from hfscale.records.search import NoiseFloor
from hfscale.results.run_folder import RunFolder, RunFolderWriteError
from hfscale.sweep.adaptive import AdaptiveSearch, adaptive_mark, question_of
from hfscale.sweep.batch import search_key, search_trial, searched, why_not_searched
from hfscale.sweep.batch_axis import comparison_baseline, mark_max_batch, max_batch_runs
from hfscale.sweep.follow import follow_sweep
from hfscale.sweep.machines import Leader
from hfscale.sweep.outcome import INTERRUPTED_EXIT, STOPPED_EXIT, SweepInterrupted, SweepOutcome, SweepStopped
from hfscale.sweep.precision import runs_for_precision, sequential_mark
from hfscale.sweep.search import Limits
from hfscale.sweep.session import SweepStart, open_sweep, prepare_folder, resume_hint, run_folder, write_report
from hfscale.workload.spec import TrialSpec

logger = logging.getLogger(__name__)

DEFAULT_OUT_DIR = "runs"


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
    noise_floor: NoiseFloor | None = None
    """An adaptive search's noise floor, as the run recorded it (:class:`~hfscale.sweep.session.SweepStart`)."""
    python: str = sys.executable
    progress: Callable[[str], None] = logger.info
    stored: dict[tuple[str, int], TrialResult] = field(default_factory=dict)
    """Every row in the run folder, by (trial, repeat), as it stands last."""
    appended: dict[tuple[str, int], TrialResult] = field(default_factory=dict)
    searches: dict[str, tuple[str, BatchSearchRecord]] = field(default_factory=dict)
    """Searched trials by :func:`hfscale.sweep.batch.search_key`: trials that differ only in their batch size
    have the same largest batch, searched once."""
    search_errors: list[str] = field(default_factory=list)
    leader: Leader | None = None
    """Machine 0's side of a sweep on several machines (:mod:`hfscale.sweep.machines`) while it runs."""

    @classmethod
    def of(cls, folder: RunFolder, start: SweepStart, launch: LaunchInfo, progress: Callable[[str], None]) -> Sweep:
        return cls(
            folder=folder, recipe=start.recipe, trials=start.trials, settings=start.settings, launch=launch,
            environment=start.environment, budget_bytes=start.budget_bytes, noise_floor=start.noise_floor,
            progress=progress,
        )  # fmt: skip

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
        self._read_stored()
        runs = self.plan()
        if (warning := device_not_visible(self.recipe, runs)) is not None:
            self.progress(warning)  # before the first trial, not after twenty skipped rows
        todo = [r for r in runs if r.key not in self.stored or self._needs_search(r, self.stored[r.key])]
        launches = sum(r.key not in self.stored for r in todo)
        self._announce(runs, todo, launches)
        if self.launch.num_machines > 1:
            self.leader = Leader.start(
                self.folder, [r for r in todo if r.key not in self.stored], recipe=self.recipe.name,
                settings=self.settings, launch=self.launch, progress=self.progress,
            )  # fmt: skip
        try:
            if self.settings.search == "adaptive":
                self._run_adaptive(runs)
            else:
                self._run_all(runs, todo)
        finally:
            if self.leader is not None:
                self.leader.close(self.folder.path)
                self.leader = None
        return list(self.appended.values())

    def _announce(self, runs: list[PlannedRun], todo: list[PlannedRun], launches: int) -> None:
        """The sweep's first line: what it will run (an adaptive search: over how many trials) and where."""
        if self.settings.search == "adaptive":
            trials = sum(r.repeat == 0 for r in runs)
            self.progress(
                f"sweep {self.recipe.name}: adaptive search over {trials} trials (the grid: {len(runs)} runs)"
                + (f", {len(self.stored)} rows already in {self.folder.path}" if self.stored else "")
                + f"; run folder {self.folder.path}"
            )
        else:
            self.progress(
                f"sweep {self.recipe.name}: {launches} of {len(runs)} runs to do"
                + (f" ({len(runs) - launches} already in {self.folder.path})" if self.stored else "")
                + (f", {len(todo) - launches} batch searches to finish" if len(todo) > launches else "")
                + f"; run folder {self.folder.path}"
            )

    def _read_stored(self) -> None:
        """The rows already in the run folder, and the batch searches they hold."""
        if self.folder.results_path.exists():
            self.stored = {row.key: row for row in self.folder.rows()}
        by_name = {t.name: t for t in self.trials}
        for row in self.stored.values():
            found = row.batch_search
            if row.trial in by_name and found is not None and found.searched and found.same_as is None:
                self.searches.setdefault(search_key(by_name[row.trial]), (row.trial, found))

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
                if row.status not in RAN_STATUSES and run.repeat + 1 < run.repeats:
                    failed_before[run.name] = f"repeat {run.repeat + 1} ended {row.status}; not repeated"
            if self._needs_search(run, row):
                self._search(run, row, prefix)
        # sweep.batch: both|max: each searched trial again at its largest batch, after every fixed-batch run.
        originals = self.recipe.resolve(repeats=self.settings.repeats)  # each trial's measure, as this sweep runs it
        extras = max_batch_runs(runs, self.stored, originals)
        for extra in estimate_runs(extras, budget_bytes=self.budget_bytes):
            # Marked before its one append: an unmarked copy on disk would read as an ordinary trial on --resume.
            self._launch(
                extra,
                "[max batch] ",
                elapsed=time.monotonic() - start,
                mark=lambda row, extra=extra: mark_max_batch(row, extra, self.stored),
            )
        rounds = 0
        while more := runs_for_precision(runs, self.stored, index=len(runs) + rounds, progress=self.progress):
            rounds += len(more)
            for run in more:
                self._launch(run, "[precision] ", elapsed=time.monotonic() - start)
        self.progress(
            f"sweep {self.recipe.name}: {len(todo)} runs in {clock(time.monotonic() - start)}; "
            f"results in {self.folder.results_path}"
        )

    def _run_adaptive(self, runs: list[PlannedRun]) -> None:
        """The adaptive search (:mod:`hfscale.sweep.adaptive`) instead of every planned run; ``search.json`` at the
        end."""
        start = time.monotonic()
        search = AdaptiveSearch(
            firsts=[r for r in runs if r.repeat == 0],
            originals=self.recipe.resolve(repeats=self.settings.repeats),
            stored=self.stored,
            question=question_of(self.settings, self.budget_bytes, self.noise_floor),
            limits=Limits(max_time_s=self.settings.max_time_s, max_runs=self.settings.max_runs),
            baseline=comparison_baseline(self.recipe),
            launch=lambda run, prefix: self._launch(
                run, prefix, elapsed=time.monotonic() - start, mark=lambda row: adaptive_mark(row, run, self.stored)
            ),
            append=self._append,
            search_batch=lambda run, row: self._search(run, row, "[search] "),
            searched=lambda trial: searched(trial, self.settings),
            clear_summary=self.folder.clear_search,
            progress=self.progress,
        )
        summary = search.run()
        if self.records:
            self.folder.write_search(summary)
        grid = f", about {clock(summary.grid_estimate_s)}" if summary.grid_estimate_s is not None else ""
        self.progress(
            f"search {self.recipe.name}: {summary.stop_reason}; {summary.runs} runs, {clock(summary.elapsed_s)} of "
            f"run time (the grid: {summary.grid_runs} runs{grid}); results in {self.folder.results_path}"
        )

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
            + f"  (sweep elapsed {clock(elapsed)})"
        )
        if self.leader is not None and run.trial.spec.strategy.num_machines > 1:
            row = self.leader.lead(
                run,
                launch_here=lambda: self._launch_here(run, prefix),
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
            on_tick=lambda s: self.progress(f"{prefix}{run.label}: still running, {clock(s)}"),
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
            try:
                record = search_trial(
                    run.trial.spec,
                    row,
                    lambda spec: self._probe(run, spec, say),
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

    def _probe(self, run: PlannedRun, spec: TrialSpec, say: Callable[[str], None]) -> ProbeOutcome:
        """One probe of ``run``'s batch search: the trial at the probe's batch, as its own process group."""
        folder = self.folder.probe_dir(run.name, spec.strategy.per_device_batch_size)
        request = GroupRequest(
            trial=dataclasses.replace(run.trial, spec=spec), configs_dir=folder, files_dir=folder, port=free_port(),
            launch=self.launch, settings=self.settings, python=self.python, run_dir=self.folder.path,
        )  # fmt: skip
        return launch_group(request, progress=say).as_probe()

    def outcome(self, rows: list[TrialResult], *, report: bool, resume: str) -> SweepOutcome:
        """What this sweep did, with the report written at its end (``report``, machine 0's only)."""
        report_paths: list[Path] = []
        report_error = None
        if report and self.records and self.folder.results_path.exists():
            report_paths, report_error = write_report(
                self.folder.path,
                self.progress,
                memory_budget_bytes=self.settings.memory_budget_bytes,
                price_per_hour=self.settings.price_per_hour,
            )
        have = {trial for trial, _ in self.stored}
        return SweepOutcome(
            run_dir=self.folder.path,
            rows=rows,
            report_paths=report_paths,
            report_error=report_error,
            search_errors=self.search_errors,
            recipe_trials=tuple(self.recipe.trial_names),
            trials_with_rows=tuple(name for name in self.recipe.trial_names if name in have),
            resume=resume,
        )


def run_sweep(
    recipe_path: str | os.PathLike[str] | None,
    *,
    out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR,
    run_dir: str | os.PathLike[str] | None = None,
    resume: str | os.PathLike[str] | None = None,
    settings: SweepSettings | None = None,
    launch: LaunchInfo | None = None,
    report: bool = True,
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
        progress: receives one line per event (trial start, heartbeat, result).

    Raises:
        RecipeError: for an invalid recipe.
        SweepError: when the recipe and run folder disagree, or a resumed run changes its process counts.
        RunFolderError: when the run folder exists or is locked by another sweep.
        KeyboardInterrupt: when interrupted; finished rows are on disk, the running trial's group was ended.
        SweepStopped: when the run folder cannot be written (disk full, read-only) or a device stayed held by
            another sweep; finished rows are on disk.
    """
    launch = launch or LaunchInfo.from_env()
    if launch.machine_rank > 0:
        # Another machine's driver follows machine 0's plan: it needs no run folder of its own to plan from.
        return follow_sweep(
            launch, out_dir=out_dir, run_dir=run_dir, resume=resume, settings=settings, progress=progress
        )
    # Read before the run folder exists, so that a sweep that cannot start leaves nothing behind.
    start = open_sweep(recipe_path, resume=resume, settings=settings, launch=launch)
    folder = run_folder(start, out_dir=out_dir, run_dir=run_dir)
    sweep = Sweep.of(folder, start, launch, progress)
    try:
        with folder.locked():
            prepare_folder(folder, start, launch, progress)
            rows = sweep.run()
    except KeyboardInterrupt as exc:
        raise SweepInterrupted(folder.path, resume=resume_hint(folder.path, start, launch)) from exc
    except (RunFolderWriteError, DeviceBusyError) as exc:
        raise SweepStopped(folder.path, exc, resume=resume_hint(folder.path, start, launch)) from exc
    return sweep.outcome(rows, report=report, resume=resume_hint(folder.path, start, launch))


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
