"""Machine ``k``'s driver (``k`` > 0) of a sweep on several machines: it takes machine 0's plan, launches its part of
each run when machine 0 says so, and reports how it ended (the protocol: :mod:`hfscale.sweep.machines`).

It writes no rows: machine 0 does. Its trials' configs and logs go into ``RUN/machines/machine-K/`` of machine 0's
run folder where this machine sees it (a shared filesystem), else into a run folder of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfscale.launch.device_lock import LOCK_DIR_ENV, DeviceBusyError, lock_dir
from hfscale.launch.group import GroupRequest, Launched, LaunchInfo, launch_group, trial_port
from hfscale.launch.plan import PlannedRun, SweepError, SweepSettings
from hfscale.launch.process import end_orphaned_group
from hfscale.results.run_folder import RunFolder
from hfscale.strategy import Strategy
from hfscale.sweep.channel import ChannelRefused, Follower, MachineZeroGone
from hfscale.sweep.machines import PathLike, coordination_port, machine_ranks
from hfscale.sweep.messages import (
    PLAN_KEY,
    MachineReport,
    MessageError,
    StartDecision,
    SweepPlan,
    ready_key,
    report_key,
    start_key,
)
from hfscale.sweep.outcome import SweepInterrupted, SweepOutcome
from hfscale.sweep.slurm import resume_command

logger = logging.getLogger(__name__)


def follow_sweep(
    launch: LaunchInfo,
    *,
    out_dir: PathLike,
    run_dir: PathLike | None = None,
    resume: PathLike | None = None,
    settings: SweepSettings | None = None,
    python: str | None = None,
    progress: Callable[[str], None] = logger.info,
) -> SweepOutcome:
    """Machine ``k``'s driver (``k`` > 0): take machine 0's plan and launch this machine's part of each of its runs
    when machine 0 says so; report how each ended. Writes no rows: machine 0 does.

    Raises:
        SweepError: when machine 0 published no plan within ``--machine-wait-s``, or stopped answering.
        SweepInterrupted: when interrupted; the running trial's group was ended.
    """
    machine = launch.machine_rank
    wait_s = (settings or SweepSettings()).machine_wait_s
    port = coordination_port(launch.master_port or 29500, outer_launch=launch.launched)
    host = launch.master_addr or "127.0.0.1"
    follower = Follower(host, port, machine)
    # The heartbeat beats before anything slow (the environment probe spawns a torch process, 10 s and more on a
    # CUDA build): machine 0 takes SILENT_AFTER_S of silence as a dead driver.
    follower.start_heartbeat()
    try:
        path = _follow(follower, launch, wait_s=wait_s, out_dir=out_dir, run_dir=run_dir, resume=resume,
                       python=python or sys.executable, progress=progress)  # fmt: skip
    except MachineZeroGone as exc:
        raise SweepError(f"machine {machine}: {exc}; the runs it had not started are left to --resume") from None
    except ChannelRefused as exc:
        raise SweepError(f"machine {machine}: {exc}") from None
    finally:
        follower.stop()
    return SweepOutcome(run_dir=path, rows=[], report_paths=[])


@dataclass(frozen=True, kw_only=True)
class _Following:
    """Machine ``k``'s driver once machine 0's plan came: where it keeps its logs, and what it launches with."""

    follower: Follower
    launch: LaunchInfo
    plan: SweepPlan
    folder: RunFolder
    """This machine's folder of its trials' configs and logs."""
    shared: bool
    """Whether that folder is inside machine 0's run folder (a shared filesystem)."""
    python: str
    progress: Callable[[str], None]

    @property
    def machine(self) -> int:
        return self.follower.machine

    def say(self, line: str) -> None:
        self.progress(f"machine {self.machine}: {line}")


def _follow(
    follower: Follower,
    launch: LaunchInfo,
    *,
    wait_s: float,
    out_dir: PathLike,
    run_dir: PathLike | None,
    resume: PathLike | None,
    python: str,
    progress: Callable[[str], None],
) -> Path:
    """:func:`follow_sweep` once its heartbeat beats; returns this machine's folder."""
    machine = follower.machine
    plan = _receive_plan(follower, wait_s=wait_s, progress=progress)
    path, shared = _own_folder(plan, machine, out_dir=out_dir, run_dir=run_dir, resume=resume)
    folder = _open_folder(path, machine)
    progress(
        f"machine {machine}: {len(plan.runs)} runs on several machines; logs in {path}"
        + ("" if shared else f" (machine 0's run folder {plan.run_dir} is not visible here)")
    )
    record = _record_environment(follower, launch, where=plan.run_dir if shared else path, python=python)
    _own_device_locks(plan, machine, progress)
    part = _Following(
        follower=follower, launch=launch, plan=plan, folder=folder, shared=shared, python=python, progress=progress
    )
    try:
        for run in plan.runs:
            if machine < run.trial.spec.strategy.num_machines:
                _follow_run(part, run)
    except KeyboardInterrupt as exc:
        # The rows, and so the resume, are machine 0's: this folder holds this machine's logs only.
        raise SweepInterrupted(
            path, resume=machine_zero_resume(plan, launch, record), rows_in=Path(plan.run_dir)
        ) from exc
    except MachineZeroGone as exc:
        raise SweepError(
            f"machine {machine}: {exc}; the runs it had not started are left to a resume of machine 0's run folder "
            f"{plan.run_dir}; continue with: {machine_zero_resume(plan, launch, record)}"
        ) from None
    return path


def _receive_plan(follower: Follower, *, wait_s: float, progress: Callable[[str], None]) -> SweepPlan:
    """Machine 0's plan, once published (at most ``wait_s``).

    Raises:
        SweepError: when none came in time, or it cannot be read.
    """
    machine = follower.machine
    host, port = follower.base.removeprefix("http://").rstrip("/").rsplit(":", 1)
    progress(f"machine {machine}: waiting for machine 0's plan at {host}:{port} (at most {wait_s:g} s)")
    try:
        data = follower.wait_for(PLAN_KEY, timeout_s=wait_s, answered_before=False)
    except TimeoutError as exc:
        raise SweepError(
            f"machine {machine}: {exc}: start machine 0's driver (the same command with --machine-rank 0), or "
            "wait longer with --machine-wait-s"
        ) from None
    try:
        return SweepPlan.from_json(data)
    except MessageError as exc:
        raise SweepError(f"machine {machine}: {exc}") from None


def sees_run_folder(run_dir: str, sweep_id: str) -> bool:
    """Whether machine 0's run folder is visible here (a shared filesystem): its sweep id file has ``sweep_id``."""
    with contextlib.suppress(OSError):
        return RunFolder(Path(run_dir)).sweep_id_path.read_text(encoding="utf-8").strip() == sweep_id
    return False


def _own_folder(
    plan: SweepPlan, machine: int, *, out_dir: PathLike, run_dir: PathLike | None, resume: PathLike | None
) -> tuple[Path, bool]:
    """Machine ``k``'s folder for its trials' configs and logs, and whether it is inside machine 0's run folder."""
    if sees_run_folder(plan.run_dir, plan.sweep_id):
        return RunFolder(Path(plan.run_dir)).machine_dir(machine), True
    if resume is not None or run_dir is not None:
        return Path(f"{resume if resume is not None else run_dir}-machine{machine}"), False
    return Path(out_dir) / f"{plan.recipe}-machine{machine}-{plan.sweep_id[:8]}", False


def _open_folder(path: Path, machine: int) -> RunFolder:
    """This machine's folder, made, with the trials a killed driver of this machine left running ended.

    Raises:
        SweepError: when it cannot be made.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SweepError(f"machine {machine}: cannot create its log folder {path} ({exc})") from None
    folder = RunFolder(path)
    for pid_file in folder.pid_files():  # a trial of this machine's killed driver, still running
        end_orphaned_group(pid_file)
    return folder


def _record_environment(
    follower: Follower, launch: LaunchInfo, *, where: PathLike, python: str
) -> dict[str, Any] | None:
    """Write this machine's environment record into ``where`` and send it to machine 0 (which writes it into its
    run folder where this machine cannot see it); None when it could not be collected."""
    machine = follower.machine
    record: dict[str, Any] | None = None
    try:
        from hfscale.results.environment import collect_environment, write_machine_environment

        record = collect_environment(python=python, extra={"launch": dataclasses.asdict(launch)})
        write_machine_environment(where, machine, record=record)
    except (OSError, ImportError) as exc:
        logger.warning("machine %d: its environment record was not written (%s)", machine, exc)
    if record is not None:
        follower.put_until(f"env/{machine}", {"host": socket.gethostname(), **record})
    return record


def _own_device_locks(plan: SweepPlan, machine: int, progress: Callable[[str], None]) -> None:
    """Two "machines" on one host (a test, or a try-out): this one's part of a trial must not wait for the device
    lock machine 0's part of the same trial holds; like a real machine, it gets a lock folder of its own."""
    if plan.host != socket.gethostname():
        return
    os.environ[LOCK_DIR_ENV] = str(lock_dir() / f"machine-{machine}")
    progress(f"machine {machine}: on machine 0's host; its device locks are in {os.environ[LOCK_DIR_ENV]}")


def _follow_run(part: _Following, run: PlannedRun) -> None:
    """One run of the plan: say ready, wait for machine 0's decision, launch this machine's part, report."""
    index, machine = run.index, part.machine
    part.follower.put_until(ready_key(index, machine), True)
    decision = StartDecision.from_json(part.follower.wait_for(start_key(index), timeout_s=None))
    if decision.action != "launch":
        part.say(f"{run.label}: not launched ({decision.reason})")
        return
    part.say(f"{run.label}: launching this machine's part")
    report = _launch_part(part, run)
    part.say(f"{run.label}: {report.status}" + (f" ({report.reason})" if report.reason else ""))
    part.follower.put_until(report_key(index, machine), report.to_json())


def _launch_part(part: _Following, run: PlannedRun) -> MachineReport:
    """Launch this machine's part of ``run``; how it ended, as machine 0 is told. A part that could not start is a
    failed part (the trial fails, the sweep goes on)."""
    folder, machine = part.folder, part.machine
    files_dir = folder.repeat_dir(run.name, run.repeat, run.repeats)
    log_dir = files_dir.resolve()
    if part.shared:
        log_dir = log_dir.relative_to(Path(part.plan.run_dir))
    request = GroupRequest(
        trial=run.trial, configs_dir=folder.trial_dir(run.name), files_dir=files_dir, port=trial_port(run, part.launch),
        launch=part.launch, settings=part.plan.settings, python=part.python, run_dir=folder.path,
    )  # fmt: skip
    strategy = run.trial.spec.strategy
    try:
        launched = launch_group(request, progress=lambda line: part.say(f"{run.label}: {line}"))
        return machine_report(launched, machine, strategy, log_dir)
    except (DeviceBusyError, OSError) as exc:
        return MachineReport(
            machine=machine, status="crashed", reason=f"its part could not be launched: {exc}",
            ranks=machine_ranks(machine, strategy.num_processes, strategy.num_machines), host=socket.gethostname(),
            log_dir=str(log_dir),
        )  # fmt: skip


def machine_report(launched: Launched, machine: int, strategy: Strategy, log_dir: Path) -> MachineReport:
    """What machine ``machine`` tells machine 0 about its part of a trial (a :class:`hfscale.launch.group.Launched`)."""
    from hfscale.launch.failures import final_error

    ranks = machine_ranks(machine, strategy.num_processes, strategy.num_machines)
    common = {"machine": machine, "ranks": ranks, "host": socket.gethostname(), "log_dir": str(log_dir)}
    if launched.exited_cleanly:
        return MachineReport(status="ok", exit_code=launched.outcome.returncode, **common)
    failure = launched.failure()
    final = final_error(launched.stderr_text)
    return MachineReport(
        status=failure.status,
        reason=failure.reason,
        exit_code=launched.outcome.returncode,
        failed_rank=final.rank if final is not None and final.rank in ranks else None,
        **common,
    )


def machine_zero_resume(plan: SweepPlan, launch: LaunchInfo, record: Mapping[str, Any] | None) -> str:
    """What continues the run machine ``k`` took part in: machine 0's run folder resumed by every machine's driver
    (:func:`hfscale.sweep.slurm.resume_command`), never ``--resume`` of machine ``k``'s own folder, which holds only its
    logs."""
    return resume_command(
        plan.run_dir,
        num_machines=plan.settings.num_machines or launch.num_machines,
        num_processes=plan.settings.num_processes,
        gpus_per_node=int((record or {}).get("gpu_count") or 0),
        main_addr=launch.master_addr,
        port=launch.master_port,
    )


__all__ = ["follow_sweep", "machine_report", "machine_zero_resume", "sees_run_folder"]
