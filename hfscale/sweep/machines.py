"""A sweep across machines: one driver per machine; machine 0's leads, the others follow its plan trial by trial.

Each machine runs the same command with its own ``--machine-rank`` (by hand, or ``srun`` under Slurm:
:mod:`hfscale.sweep.slurm`). The drivers need no process group of their own: they talk over plain HTTP on the main
machine's ``--main-process-port`` (:class:`Coordinator` on machine 0, :class:`Follower` on the others; the port
minus one under an outer ``accelerate launch``/``torchrun``, whose rendezvous keeps the port). Trial ``i`` of the
sweep rendezvouses on port + 1 + i on every machine (:func:`hfscale.launch.group.trial_port`).

The protocol, so that no machine waits without a bound and a failure anywhere is one row on machine 0:

1. Machine 0 plans (new or ``--resume``: it alone reads the run folder) and publishes ``plan``: the settings and
   the runs on several machines still to do, in order, each with its trial's spec. Machine ``k`` takes that plan
   and nothing else, so it skips exactly what machine 0 skips (it needs no copy of the run folder or recipe).
2. Before each such run machine ``k`` says ``ready/i/k``; machine 0 waits for every machine taking part at most
   ``--machine-wait-s`` (no wait for one whose driver has gone silent) and publishes ``start/i``: launch, or skip.
   A machine that did not come is a ``timeout`` row naming it (``crashed`` when its driver spoke, then went
   silent); the trial is not launched.
3. After its part, machine ``k`` sends ``report/i/k`` (:class:`MachineReport`: status, failing rank, host, log
   folder); machine 0 waits for the reports while their drivers are alive and merges them into its row
   (:func:`merge_machine_reports`): the row names the machine and rank that failed first.

The channel is meant for a cluster's private network. Its values are JSON, but the plan's trial specs include each
trial's environment variables (``LD_PRELOAD``, ``PYTHONPATH`` would run code on machine ``k``), so it is guarded:
every request carries the shared token of ``HFSCALE_SWEEP_TOKEN`` (the same value in every driver's environment;
the sbatch script of :mod:`hfscale.sweep.slurm` generates one), compared in constant time; a request without it is
refused (403). Machine ``k`` may write only its own keys (``ready/``, ``report/``, ``alive/``, ``env/``), at most
4 MiB each; the plan and the decisions are machine 0's alone. Without ``HFSCALE_SWEEP_TOKEN`` the channel accepts
any request from the network and machine 0 logs a warning.

Logs: with a shared filesystem (what a cluster's home or scratch usually is), machine ``k`` keeps its trials'
configs and logs in ``RUN/machines/machine-K/`` of machine 0's run folder; where it cannot see that folder, in a
run folder of its own (``RUN-machineK``). Only machine 0 writes rows and the report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.records.row import TrialResult
from hfscale.results.run_folder import RunFolder
from hfscale.sweep.channel import (
    Absent,
    ChannelRefused,
    Coordinator,
    Follower,
    MachineZeroGone,
    _absent,
)

if TYPE_CHECKING:
    from hfscale.launch.group import Launched, LaunchInfo
    from hfscale.launch.plan import PlannedRun, SweepSettings
    from hfscale.strategy import Strategy
    from hfscale.sweep.outcome import SweepOutcome

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
PORT_BLOCK_ENV = "HFSCALE_PORT_BLOCK"
"""Set by the sbatch script: how many ports above the drivers' port are this job's (trial ``i`` uses + 1 + i)."""

# Errors of a rank whose peer went away: the consequence of a failure elsewhere, not its cause.
_PEER_ERRORS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "recvbytes",
    "failed to recv",
    "socket timeout",
    "connection refused",
    "timed out",
    "stopped during the trial",
)


def coordination_port(main_process_port: int, *, outer_launch: bool) -> int:
    """The drivers' port: the main port given to every driver, or one below it under an outer launcher (its own
    rendezvous holds the main port; trials use the ports above it)."""
    return main_process_port - 1 if outer_launch else main_process_port


@dataclass(frozen=True, kw_only=True)
class MachineReport:
    """How one machine's part of a trial ended, as that machine's driver saw it (sent to machine 0)."""

    machine: int
    status: str
    """``ok``, or ``oom``/``crashed``/``timeout`` (:func:`hfscale.launch.failures.classify` of its own group)."""
    reason: str | None = None
    exit_code: int | None = None
    failed_rank: int | None = None
    """The global rank whose error ended it, where its stderr names one."""
    ranks: list[int]
    """This machine's global ranks in the trial."""
    host: str = ""
    log_dir: str = ""
    """Its folder of the trial's logs (on that machine)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MachineReport:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def machine_ranks(machine: int, num_processes: int, num_machines: int) -> list[int]:
    """The global ranks of ``machine`` (accelerate numbers ranks machine by machine)."""
    per = num_processes // num_machines
    return list(range(machine * per, (machine + 1) * per))


def _is_consequence(reason: str | None) -> bool:
    text = (reason or "").lower()
    return any(marker in text for marker in _PEER_ERRORS)


def _who(machine: int, ranks: list[int], host: str = "") -> str:
    where = f", {host}" if host else ""
    rank_text = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return f"machine {machine} ({rank_text}{where})"


def merge_machine_reports(
    row: TrialResult,
    reports: Mapping[int, MachineReport],
    missing: Mapping[int, str | Absent],
    *,
    dirs: list[str] | None = None,
) -> TrialResult:
    """Machine 0's row of a trial on several machines, with what the other machines reported: ONE row that names
    the machine and rank that failed first.

    ``reports`` are the other machines' :class:`MachineReport`; ``missing`` the machines that sent none, with why
    (:class:`Absent`; a plain string is a stopped driver). The first failure is, in this order: a machine whose
    driver never came or stopped, an out-of-memory anywhere, a failure whose error is not a lost peer (a rank's own
    exception), then machine 0's own. A machine whose driver is alive but whose part was still running (``late``)
    is a consequence, never the first failure: machine 0's own failure (an OOM, say) keeps its status. A row
    machine 0 measured stays ``ok`` (its ranks trained to the end; the collective steps bind every machine), with
    another machine's failure in ``launch.after_result``.
    """
    strategy = row.strategy
    failures: list[tuple[int, str, str, list[int]]] = []  # (machine, status, text, failed ranks)
    late: list[tuple[int, str, str, list[int]]] = []
    absent = {m: _absent(v) for m, v in missing.items()}
    gone = {m for m, a in absent.items() if a.gone}
    for machine, why in sorted(absent.items()):
        ranks = machine_ranks(machine, strategy.num_processes, strategy.num_machines)
        if why.gone:
            failures.append((machine, "crashed", f"{_who(machine, ranks)}: {why.why}", ranks))
        else:
            late.append((machine, "timeout", f"{_who(machine, ranks)}: its part was still running ({why.why})", ranks))
    for machine, report in sorted(reports.items()):
        if report.status != "ok":
            ranks = [report.failed_rank] if report.failed_rank is not None else report.ranks
            text = f"{_who(machine, ranks, report.host)}: {report.status}: {report.reason}"
            failures.append((machine, report.status, text, ranks))
    launch = row.launch
    if launch is not None and dirs:
        launch = replace(launch, machine_dirs=dirs)
    if not failures and not late and row.status not in ("oom", "crashed", "timeout"):
        return replace(row, launch=launch)
    if row.status in ("ok", "not_applied"):
        if launch is not None and (failures or late):
            note = "; ".join(text for _, _, text, _ in [*failures, *late])
            launch = replace(launch, after_result="; ".join(filter(None, [launch.after_result, note])))
        return replace(row, launch=launch)
    ranks0 = machine_ranks(0, strategy.num_processes, strategy.num_machines)
    own_rank = _rank_in(row.reason)
    own = (0, row.status, f"{_who(0, [own_rank] if own_rank is not None else ranks0)}: {row.status}: {row.reason}")
    own_ranks = [own_rank] if own_rank is not None else ranks0
    everyone = [*failures, (*own, own_ranks), *late]
    missing_first = [f for f in failures if f[0] in gone]
    ooms = [f for f in everyone if f[1] == "oom"]
    causes = [f for f in [*failures, (*own, own_ranks)] if not _is_consequence(f[2])]
    first = (missing_first or ooms or causes or [*failures, (*own, own_ranks)])[0]
    others = [f[2] for f in everyone if f is not first]
    reason = first[2] + (f"; then {'; '.join(others)}" if others else "")
    if launch is not None:
        launch = replace(launch, failed_machine=first[0], failed_ranks=list(first[3]))
    return replace(row, status=first[1], reason=reason, launch=launch)  # type: ignore[arg-type]


def _rank_in(reason: str | None) -> int | None:
    import re

    match = re.search(r"\bon rank (\d+)", reason or "")
    return int(match.group(1)) if match else None


def lead_run(
    coordinator: Coordinator,
    run: PlannedRun,
    *,
    launch_here: Callable[[], TrialResult],
    published: bool,
    baseline: str,
    wait_s: float,
) -> TrialResult:
    """Machine 0's part of a run on several machines: wait (at most ``wait_s``) until every machine taking part
    is ready, tell them to launch (or skip), launch this machine's part (``launch_here``), then merge their
    reports into one row (:func:`merge_machine_reports`). ``published`` says whether the run is in the plan the
    other machines follow (a run added later, such as a ``-maxbatch`` run, is not)."""
    from hfscale.launch.group import planned_row
    from hfscale.records.row import LaunchRecord

    index, strategy = run.index, run.trial.spec.strategy
    if run.skip_reason is not None:
        coordinator.publish(f"start/{index}", {"action": "skip", "reason": run.skip_reason})
        return launch_here()
    if not published:
        return planned_row(
            run,
            baseline=baseline,
            status="skipped",
            reason="on several machines only the runs planned at the sweep's start are launched",
        )
    others = range(1, strategy.num_machines)
    missing = coordinator.wait_for({m: f"ready/{index}/{m}" for m in others}, timeout_s=wait_s)
    if missing:
        coordinator.publish(f"start/{index}", {"action": "skip", "reason": "a machine did not come"})
        first = min(missing)
        reason = "; ".join(f"machine {m}: {why.why}" for m, why in sorted(missing.items()))
        return planned_row(
            run,
            baseline=baseline,
            status="crashed" if missing[first].kind == "stopped" else "timeout",
            reason=f"not launched: {reason}",
            launch=LaunchRecord(
                failed_machine=first,
                failed_ranks=machine_ranks(first, strategy.num_processes, strategy.num_machines),
            ),
        )
    coordinator.publish(f"start/{index}", {"action": "launch"})
    row = launch_here()
    missing = coordinator.wait_for({m: f"report/{index}/{m}" for m in others}, timeout_s=wait_s)
    reports: dict[int, MachineReport] = {}
    for m in others:
        if m in missing:
            continue
        try:  # a report machine 0 cannot read (another hfscale version) must not cost machine 0's measured row
            reports[m] = MachineReport.from_json(coordinator.value(f"report/{index}/{m}"))
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            missing[m] = Absent(kind="late", why=f"its report could not be read ({type(exc).__name__}: {exc})")
    dirs = [r.log_dir for _, r in sorted(reports.items())]
    return merge_machine_reports(row, reports, missing, dirs=dirs)


def sees_run_folder(run_dir: str, sweep_id: str) -> bool:
    """Whether machine 0's run folder is visible here (a shared filesystem): its sweep id file has ``sweep_id``."""
    with contextlib.suppress(OSError):
        return RunFolder(Path(run_dir)).sweep_id_path.read_text(encoding="utf-8").strip() == sweep_id
    return False


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


def _own_folder(
    plan: Mapping[str, Any], machine: int, *, out_dir: PathLike, run_dir: PathLike | None, resume: PathLike | None
) -> tuple[Path, bool]:
    """Machine ``k``'s folder for its trials' configs and logs, and whether it is inside machine 0's run folder."""
    if sees_run_folder(plan["run_dir"], plan["sweep_id"]):
        return RunFolder(Path(plan["run_dir"])).machine_dir(machine), True
    if resume is not None or run_dir is not None:
        return Path(f"{resume if resume is not None else run_dir}-machine{machine}"), False
    return Path(out_dir) / f"{plan['recipe']}-machine{machine}-{plan['sweep_id'][:8]}", False


def _follow(
    follower: Follower,
    launch: LaunchInfo,
    *,
    wait_s: float,
    out_dir: PathLike,
    run_dir: PathLike | None,
    resume: PathLike | None,
    python: str | None,
    progress: Callable[[str], None],
) -> Path:
    """:func:`follow_sweep` once its heartbeat beats; returns this machine's folder."""
    import dataclasses
    import sys

    from hfscale.launch.device_lock import DeviceBusyError
    from hfscale.launch.group import launch_group, trial_port
    from hfscale.launch.plan import PlannedRun, SweepError, SweepSettings
    from hfscale.launch.process import end_orphaned_group
    from hfscale.recipes.recipe import RecipeTrial, RunSpec
    from hfscale.sweep.outcome import SweepInterrupted
    from hfscale.workload.spec import TrialSpec

    machine = follower.machine
    host, port = follower.base.removeprefix("http://").rstrip("/").rsplit(":", 1)
    progress(f"machine {machine}: waiting for machine 0's plan at {host}:{port} (at most {wait_s:g} s)")
    try:
        plan = follower.wait_for("plan", timeout_s=wait_s, answered_before=False)
    except TimeoutError as exc:
        raise SweepError(
            f"machine {machine}: {exc}: start machine 0's driver (the same command with --machine-rank 0), or "
            "wait longer with --machine-wait-s"
        ) from None
    if not isinstance(plan.get("recipe"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", plan["recipe"]):
        raise SweepError(f"machine {machine}: machine 0's plan names recipe {plan.get('recipe')!r}, not a file name")
    path, shared = _own_folder(plan, machine, out_dir=out_dir, run_dir=run_dir, resume=resume)
    folder = RunFolder(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SweepError(f"machine {machine}: cannot create its log folder {path} ({exc})") from None
    for pid_file in folder.pid_files():  # a trial of this machine's killed driver, still running
        end_orphaned_group(pid_file)
    progress(
        f"machine {machine}: {len(plan['runs'])} runs on several machines; logs in {path}"
        + ("" if shared else f" (machine 0's run folder {plan['run_dir']} is not visible here)")
    )
    recorded = SweepSettings.from_dict(plan["settings"])
    record: dict[str, Any] | None = None
    try:
        from hfscale.results.environment import collect_environment, write_machine_environment

        record = collect_environment(python=python or sys.executable, extra={"launch": dataclasses.asdict(launch)})
        write_machine_environment(plan["run_dir"] if shared else path, machine, record=record)
    except (OSError, ImportError) as exc:
        logger.warning("machine %d: its environment record was not written (%s)", machine, exc)
    if record is not None:  # machine 0 writes it into its run folder where this machine cannot see it
        follower.put_until(f"env/{machine}", {"host": socket.gethostname(), **record})
    if plan.get("host") == socket.gethostname():
        # Two "machines" on one host (a test, or a try-out): this one's part of a trial must not wait for the
        # device lock machine 0's part of the same trial holds; like a real machine, it has a lock folder of its own.
        from hfscale.launch.device_lock import LOCK_DIR_ENV, lock_dir

        os.environ[LOCK_DIR_ENV] = str(lock_dir() / f"machine-{machine}")
        progress(f"machine {machine}: on machine 0's host; its device locks are in {os.environ[LOCK_DIR_ENV]}")
    try:
        for entry in plan["runs"]:
            spec = TrialSpec.from_dict(entry["spec"])
            trial = RecipeTrial(spec=spec, run=RunSpec(**entry["run"]))
            run = PlannedRun(trial=trial, repeat=entry["repeat"], index=entry["index"])
            if machine >= spec.strategy.num_machines:
                continue
            index = run.index
            follower.put_until(f"ready/{index}/{machine}", True)
            decision = follower.wait_for(f"start/{index}", timeout_s=None)
            if decision.get("action") != "launch":
                progress(f"machine {machine}: {run.label}: not launched ({decision.get('reason')})")
                continue
            progress(f"machine {machine}: {run.label}: launching this machine's part")
            files_dir = folder.repeat_dir(run.name, run.repeat, run.repeats)
            log_dir = files_dir.resolve()
            if shared:
                log_dir = log_dir.relative_to(Path(plan["run_dir"]))
            try:
                launched = launch_group(
                    trial, folder.trial_dir(run.name), files_dir, port=trial_port(run, launch), launch=launch,
                    settings=recorded, python=python or sys.executable, run_dir=folder.path,
                    progress=lambda line, label=run.label: progress(f"machine {machine}: {label}: {line}"),
                )  # fmt: skip
                report = machine_report(launched, machine, spec.strategy, log_dir)
            except (DeviceBusyError, OSError) as exc:  # its part could not start: the trial fails, the sweep goes on
                ranks = machine_ranks(machine, spec.strategy.num_processes, spec.strategy.num_machines)
                report = MachineReport(
                    machine=machine, status="crashed", reason=f"its part could not be launched: {exc}", ranks=ranks,
                    host=socket.gethostname(), log_dir=str(log_dir),
                )  # fmt: skip
            progress(
                f"machine {machine}: {run.label}: {report.status}" + (f" ({report.reason})" if report.reason else "")
            )
            follower.put_until(f"report/{index}/{machine}", report.to_json())
    except KeyboardInterrupt as exc:
        # The rows, and so the resume, are machine 0's: this folder holds this machine's logs only.
        raise SweepInterrupted(
            path, resume=machine_zero_resume(plan, launch, record), rows_in=Path(plan["run_dir"])
        ) from exc
    except MachineZeroGone as exc:
        raise SweepError(
            f"machine {machine}: {exc}; the runs it had not started are left to a resume of machine 0's run folder "
            f"{plan['run_dir']}; continue with: {machine_zero_resume(plan, launch, record)}"
        ) from None
    return path


def machine_zero_resume(plan: Mapping[str, Any], launch: LaunchInfo, record: Mapping[str, Any] | None) -> str:
    """What continues the run machine ``k`` took part in: machine 0's run folder resumed by every machine's driver
    (:func:`hfscale.sweep.slurm.resume_command`), never ``--resume`` of machine ``k``'s own folder, which holds only its
    logs."""
    from hfscale.launch.plan import SweepSettings
    from hfscale.sweep.slurm import resume_command

    recorded = SweepSettings.from_dict(plan.get("settings") or {})
    return resume_command(
        plan["run_dir"],
        num_machines=recorded.num_machines or launch.num_machines,
        num_processes=recorded.num_processes,
        gpus_per_node=int((record or {}).get("gpu_count") or 0),
        main_addr=launch.master_addr,
        port=launch.master_port,
    )


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
    from hfscale.launch.plan import SweepError, SweepSettings
    from hfscale.sweep.outcome import SweepOutcome

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
                       python=python, progress=progress)  # fmt: skip
    except MachineZeroGone as exc:
        raise SweepError(f"machine {machine}: {exc}; the runs it had not started are left to --resume") from None
    except ChannelRefused as exc:
        raise SweepError(f"machine {machine}: {exc}") from None
    finally:
        follower.stop()
    return SweepOutcome(run_dir=path, rows=[], report_paths=[])


def write_received_environments(coordinator: Coordinator, run_dir: PathLike) -> list[Path]:
    """Machine 0, at the sweep's end: write each other machine's environment record it received (``env/<m>``)
    into ``RUN/machines/machine-M.json`` where that machine could not (no shared filesystem); returns those
    written."""
    from hfscale.results.environment import machine_environment_path, write_machine_environment

    written = []
    for machine, record in sorted(coordinator.received_environments().items()):
        if machine < 1 or machine_environment_path(run_dir, machine).exists():
            continue
        try:
            written.append(write_machine_environment(run_dir, machine, record=record, hostname=record.get("host")))
        except OSError as exc:
            logger.warning("machine 0: machine %d's environment record was not written (%s)", machine, exc)
    return written


def check_port_block(indices: list[int], port: int) -> None:
    """Refuse a sweep whose trials on several machines would rendezvous on ports beyond this job's block
    (``HFSCALE_PORT_BLOCK``, set by the sbatch script of :mod:`hfscale.sweep.slurm`): trial ``i`` uses port + 1 + i.

    Raises:
        SweepError: when the largest such index does not fit.
    """
    from hfscale.launch.plan import SweepError

    block = os.environ.get(PORT_BLOCK_ENV)
    if not block or not indices:
        return
    if not block.isdigit():
        raise SweepError(f"{PORT_BLOCK_ENV}={block!r}: expected a number of ports")
    if max(indices) + 1 >= int(block):
        raise SweepError(
            f"the sweep's run {max(indices)} on several machines would rendezvous on port {port + 1 + max(indices)}, "
            f"beyond this job's {block} ports from {port} ({PORT_BLOCK_ENV}): two jobs on one node would collide; "
            "split the recipe (--only) into sweeps of fewer runs"
        )


def hostname() -> str:
    return socket.gethostname()


__all__ = [
    "MachineReport",
    "check_port_block",
    "coordination_port",
    "follow_sweep",
    "lead_run",
    "machine_ranks",
    "machine_report",
    "machine_zero_resume",
    "merge_machine_reports",
    "sees_run_folder",
    "write_received_environments",
]
