"""One planned run of a trial as a row: launched (or skipped before launching) and how it ended, typed.

What the plan knows (strategy, repeat, estimate) and what only the driver saw (the launch, the exit, the machine's
activity) are added to what the trial measured; nothing is appended here (the sweep appends, with loss parity).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from hfscale.launch.failures import stderr_excerpt
from hfscale.launch.group import GroupRequest, Launched, LaunchInfo, launch_group, trial_port
from hfscale.launch.plan import PlannedRun, SweepSettings
from hfscale.records.row import LaunchRecord, TrialResult
from hfscale.results.run_folder import RESULT_FILE, RunFolder

logger = logging.getLogger(__name__)


def planned_row(
    run: PlannedRun, *, baseline: str, status: str, reason: str | None = None, **fields: Any
) -> TrialResult:
    """A row for ``run`` with what the plan knows (strategy, repeat, estimate) and ``fields``."""
    strategy = run.trial.spec.strategy
    return TrialResult(
        trial=run.name,
        repeat=run.repeat,
        repeats=run.repeats,
        strategy=strategy,
        description=strategy.describe(),
        is_baseline=run.name == baseline,
        status=status,  # type: ignore[arg-type]
        reason=reason,
        estimate=run.estimate,
        estimate_error=run.estimate_error,
        **fields,
    )


def launch_trial(
    run: PlannedRun,
    folder: RunFolder,
    *,
    baseline: str,
    launch: LaunchInfo,
    settings: SweepSettings,
    python: str = sys.executable,
    on_tick: Callable[[float], None] | None = None,
    progress: Callable[[str], None] = logger.info,
) -> TrialResult:
    """Launch one run of a trial (or not, when it is to be skipped) and turn how it ended into a row; nothing is
    appended here.

    Raises:
        KeyboardInterrupt: when interrupted; the trial's process group has been ended.
        RunFolderWriteError: when its configs cannot be written.
        DeviceBusyError: when another sweep held its devices for longer than the sweep waits.
        OSError: when its launcher cannot be started.
    """
    if run.skip_reason is not None:
        return planned_row(run, baseline=baseline, status="skipped", reason=run.skip_reason)
    files_dir = folder.repeat_dir(run.name, run.repeat, run.repeats)
    request = GroupRequest(
        trial=run.trial,
        configs_dir=folder.trial_dir(run.name),
        files_dir=files_dir,
        port=trial_port(run, launch),
        launch=launch,
        settings=settings,
        python=python,
        run_dir=folder.path,
    )
    launched = launch_group(request, progress=progress, on_tick=on_tick)
    return launched_row(run, launched, baseline=baseline, trial_dir=str(files_dir.relative_to(folder.path)))


def launched_row(run: PlannedRun, launched: Launched, *, baseline: str, trial_dir: str) -> TrialResult:
    """The row of a run whose group ran: what the trial measured, else why its group failed (``trial_dir``: its
    files' folder, relative to the run folder)."""
    outcome, measured = launched.outcome, launched.measured
    after_result = None
    if measured is not None and not launched.exited_cleanly:
        # The trial measured and wrote its result: that stands even if the group then failed to exit cleanly.
        failure = launched.failure()
        after_result = f"{failure.status}: {failure.reason}"
    hold = launched.device_hold
    record = LaunchRecord(
        command=launched.command,
        main_process_port=launched.port,
        memory_limit_gib=launched.memory_limit_gib,
        timeout_s=launched.timeout_s,
        trial_dir=trial_dir,
        after_result=after_result,
        device_lock_waited_s=hold.waited_s if hold else None,
        device_shared_with=hold.shared_with if hold else None,
    )
    stderr_tail = stderr_excerpt(launched.stderr_text)  # an excerpt is kept in the row
    common: dict[str, Any] = {
        "exit_code": outcome.returncode,
        "wall_time_s": outcome.wall_time_s,
        "started_at": launched.started_at,
        "finished_at": launched.finished_at,
        "launch": record,
        "activity": launched.activity,
    }
    if measured is not None:
        return planned_row(
            run,
            baseline=baseline,
            status=measured.status,
            reason=measured.reason,
            stderr_tail=stderr_tail if measured.status != "ok" else None,
            measured=measured,
            **common,
        )
    if launched.exited_cleanly:
        status, reason = "crashed", f"exited 0 without writing {RESULT_FILE}"
    else:
        failure = launched.failure()
        status, reason = failure.status, failure.reason
    return planned_row(run, baseline=baseline, status=status, reason=reason, stderr_tail=stderr_tail, **common)


__all__ = ["launch_trial", "launched_row", "planned_row"]
