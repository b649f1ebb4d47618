"""What a sweep ended with: its outcome, the two ways it can stop early, and its exit codes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hfscale.launch.plan import SkipCause, skip_cause
from hfscale.records.row import TrialResult
from hfscale.sweep.slurm import resume_command

INTERRUPTED_EXIT = 130


STOPPED_EXIT = 3


NOTHING_RAN_EXIT = 4
"""Every run this sweep added was skipped before launching (:attr:`SweepOutcome.nothing_ran` says why)."""


class SweepStopped(RuntimeError):
    """The sweep could not go on (its run folder could not be written: disk full, read-only; or a device stayed
    held by another sweep): every row written before is kept, ``resume`` goes on once the cause is gone."""

    def __init__(self, run_dir: Path, cause: Exception, *, resume: str | None = None) -> None:
        super().__init__(f"{cause}")
        self.run_dir = run_dir
        self.cause = cause
        self.resume = resume or resume_command(run_dir)
        """The command that continues the run (:func:`hfscale.sweep.slurm.resume_command`)."""


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM/SIGHUP) during a sweep: the running trial's group was ended; finished rows are kept."""

    def __init__(self, run_dir: Path, *, resume: str | None = None, rows_in: Path | None = None) -> None:
        super().__init__(f"sweep interrupted; finished trials are in {rows_in or run_dir}")
        self.run_dir = run_dir
        """This driver's folder (on machine ``k`` of several: its logs only)."""
        self.rows_in = rows_in or run_dir
        """The run folder that holds the rows: machine 0's."""
        self.resume = resume or resume_command(self.rows_in)
        """The command that continues the run (:func:`hfscale.sweep.slurm.resume_command`)."""


@dataclass(frozen=True, kw_only=True)
class SweepOutcome:
    """What :func:`run_sweep` did."""

    run_dir: Path
    rows: list[TrialResult]
    """The rows appended by this call, each as it stands last (a resumed sweep's earlier rows are not repeated,
    unless this call added their batch search)."""
    report_paths: list[Path]
    """What :func:`hfscale.report.write_report` wrote, if it ran."""
    report_error: str | None = None
    """Why the report at the end was not written (the rows are on disk regardless); None when it was or was not
    asked for."""
    search_errors: list[str] = field(default_factory=list)
    """Batch searches that raised (their trials' rows are kept without a search; ``--resume`` runs them again)."""
    recipe_trials: tuple[str, ...] = ()
    """Every trial of the recipe, in recipe order."""
    trials_with_rows: tuple[str, ...] = ()
    """The recipe's trials with at least one row in the run folder, this sweep's and earlier ones'."""
    resume: str = ""
    """The command that continues this run (:func:`hfscale.sweep.slurm.resume_command`: on several machines, every
    machine's driver)."""

    @property
    def nothing_ran(self) -> str | None:
        """Why no trial ran, when every row this sweep added was skipped before launching (a CUDA recipe on a
        machine without a visible GPU, nothing predicted to fit, ...) and no batch search launched probes, with
        what to do; None when something ran, or there was nothing to do. One sentence per cause
        (:func:`hfscale.launch.plan.skip_cause`)."""
        if not self.rows or any(row.status != "skipped" for row in self.rows):
            return None
        if self.search_errors or any(row.batch_search is not None and row.batch_search.searched for row in self.rows):
            return None  # a batch search launched its probes
        by_cause: dict[SkipCause, list[TrialResult]] = {}
        for row in self.rows:
            by_cause.setdefault(skip_cause(row.reason), []).append(row)
        causes = []
        for cause, rows in by_cause.items():
            reasons = {row.reason for row in rows}
            said = rows[0].reason if len(reasons) == 1 else f"{cause.cause} (e.g. {rows[0].trial}: {rows[0].reason})"
            causes.append(f"{said}{f' ({len(rows)} runs)' if len(by_cause) > 1 else ''}")
        remedy = "; ".join(dict.fromkeys(cause.remedy for cause in by_cause))
        return (
            f"no trial ran: all {len(self.rows)} runs were skipped before launching: {'; '.join(causes)}. "
            f"{remedy[:1].upper()}{remedy[1:]}. The skipped rows are in {self.run_dir}"
        )
