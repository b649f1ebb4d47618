"""A sweep across machines: one driver per machine; machine 0's leads, the others follow its plan trial by trial.

Each machine runs the same command with its own ``--machine-rank`` (by hand, or ``srun`` under Slurm:
:mod:`hfscale.sweep.slurm`). The drivers need no process group of their own: they talk over plain HTTP on the main
machine's ``--main-process-port`` (:class:`Coordinator` on machine 0, :class:`Follower` on the others; the port
minus one under an outer ``accelerate launch``/``torchrun``, whose rendezvous keeps the port). Trial ``i`` of the
sweep rendezvouses on port + 1 + i on every machine (:func:`hfscale.launch.group.trial_port`).

The protocol, so that no machine waits without a bound and a failure anywhere is one row on machine 0:

1. Machine 0 plans (new or ``--resume``: it alone reads the run folder) and publishes ``plan``
   (:class:`~hfscale.sweep.messages.SweepPlan`): the settings and the runs on several machines still to do, in
   order, each with its trial's spec. Machine ``k`` takes that plan and nothing else, so it skips exactly what
   machine 0 skips (it needs no copy of the run folder or recipe; :mod:`hfscale.sweep.follow`).
2. Before each such run machine ``k`` says ``ready/i/k``; machine 0 waits for every machine taking part at most
   ``--machine-wait-s`` (no wait for one whose driver has gone silent) and publishes ``start/i``
   (:class:`~hfscale.sweep.messages.StartDecision`): launch, or skip.
   A machine that did not come is a ``timeout`` row naming it (``crashed`` when its driver spoke, then went
   silent); the trial is not launched.
3. After its part, machine ``k`` sends ``report/i/k`` (:class:`~hfscale.sweep.messages.MachineReport`: status,
   failing rank, host, log
   folder); machine 0 waits for the reports while their drivers are alive and merges them into its row
   (:func:`merge_machine_reports`): the row names the machine and rank that failed first.

The channel is meant for a cluster's private network. Its values are JSON, but the plan's trial specs include each
trial's environment variables (``LD_PRELOAD``, ``PYTHONPATH`` would run code on machine ``k``), so it is guarded as
:mod:`hfscale.sweep.channel` describes: machine ``k`` proves its number with a credential derived from
``HFSCALE_SWEEP_TOKEN`` (the same value in every driver's environment; the sbatch script of
:mod:`hfscale.sweep.slurm` generates one), writes only its own keys and reads only machine 0's; without the token
machine 0 serves only on a loopback address.

Logs: with a shared filesystem (what a cluster's home or scratch usually is), machine ``k`` keeps its trials'
configs and logs in ``RUN/machines/machine-K/`` of machine 0's run folder; where it cannot see that folder, in a
run folder of its own (``RUN-machineK``). Only machine 0 writes rows and the report.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from hfscale.launch.group import LaunchInfo
from hfscale.launch.plan import PlannedRun, SweepError, SweepSettings
from hfscale.launch.rows import planned_row
from hfscale.records.row import RAN_STATUSES, LaunchRecord, TrialResult
from hfscale.results.run_folder import RunFolder, RunFolderWriteError
from hfscale.sweep.channel import Absent, ChannelError, Coordinator, _absent, is_loopback, route_address
from hfscale.sweep.messages import (
    PLAN_KEY,
    MachineReport,
    StartDecision,
    SweepPlan,
    ready_key,
    report_key,
    start_key,
)

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


def machine_ranks(machine: int, num_processes: int, num_machines: int) -> list[int]:
    """The global ranks of ``machine`` (accelerate numbers ranks machine by machine)."""
    per = num_processes // num_machines
    return list(range(machine * per, (machine + 1) * per))


# -- one row from every machine's part ----------------------------------------------------------------------------

_Failure = tuple[int, str, str, list[int]]
"""(machine, status, text, failed ranks)."""


def _is_consequence(reason: str | None) -> bool:
    text = (reason or "").lower()
    return any(marker in text for marker in _PEER_ERRORS)


def _who(machine: int, ranks: list[int], host: str = "") -> str:
    where = f", {host}" if host else ""
    rank_text = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return f"machine {machine} ({rank_text}{where})"


def _rank_in(reason: str | None) -> int | None:
    match = re.search(r"\bon rank (\d+)", reason or "")
    return int(match.group(1)) if match else None


def _others_failures(
    row: TrialResult, reports: Mapping[int, MachineReport], absent: Mapping[int, Absent]
) -> tuple[list[_Failure], list[_Failure]]:
    """The other machines' failures (a driver that never came or stopped, a part that failed) and their late parts
    (a driver alive, its part still running), in machine order."""
    strategy = row.strategy
    failures: list[_Failure] = []
    late: list[_Failure] = []
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
    return failures, late


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
    absent = {m: _absent(v) for m, v in missing.items()}
    failures, late = _others_failures(row, reports, absent)
    launch = row.launch
    if launch is not None and dirs:
        launch = replace(launch, machine_dirs=dirs)
    if not failures and not late and row.status not in ("oom", "crashed", "timeout"):
        return replace(row, launch=launch)
    if row.status in RAN_STATUSES:
        if launch is not None and (failures or late):
            note = "; ".join(text for _, _, text, _ in [*failures, *late])
            launch = replace(launch, after_result="; ".join(filter(None, [launch.after_result, note])))
        return replace(row, launch=launch)
    strategy = row.strategy
    own_rank = _rank_in(row.reason)
    own_ranks = [own_rank] if own_rank is not None else machine_ranks(0, strategy.num_processes, strategy.num_machines)
    own: _Failure = (0, row.status, f"{_who(0, own_ranks)}: {row.status}: {row.reason}", own_ranks)
    everyone = [*failures, own, *late]
    gone = {m for m, why in absent.items() if why.gone}
    missing_first = [f for f in failures if f[0] in gone]
    ooms = [f for f in everyone if f[1] == "oom"]
    causes = [f for f in [*failures, own] if not _is_consequence(f[2])]
    first = (missing_first or ooms or causes or [*failures, own])[0]
    others = [f[2] for f in everyone if f is not first]
    reason = first[2] + (f"; then {'; '.join(others)}" if others else "")
    if launch is not None:
        launch = replace(launch, failed_machine=first[0], failed_ranks=list(first[3]))
    return replace(row, status=first[1], reason=reason, launch=launch)  # type: ignore[arg-type]


# -- machine 0 leading ----------------------------------------------------------------------------------------------


def _serve(port: int, settings: SweepSettings, launch: LaunchInfo, spans: tuple[PlannedRun, ...]) -> Coordinator:
    """Machine 0's channel on ``--channel-bind``, by default the address that routes to ``--main-process-ip``,
    taking the machine numbers of this sweep (the larger of ``--num-machines`` and what its runs span).

    Raises:
        SweepError: when it cannot start (no token on a reachable address, a port in use), naming the option.
    """
    machines = max(
        launch.num_machines, settings.num_machines or 1, *(r.trial.spec.strategy.num_machines for r in spans)
    )
    try:
        bind = launch.channel_bind or _default_bind(launch.master_addr)
    except ChannelError as exc:
        raise SweepError(str(exc)) from exc
    try:
        return Coordinator(port, bind=bind, machines=machines)
    except ChannelError as exc:
        raise SweepError(str(exc)) from exc
    except OSError as exc:
        raise SweepError(
            f"machine 0: cannot serve the other machines' drivers on {bind}:{port} ({exc}); choose another "
            "--main-process-port (the same on every machine) or --channel-bind"
        ) from exc


def _default_bind(main_addr: str | None) -> str:
    """The address that routes to ``main_addr``; every interface when that is loopback although ``main_addr`` is a
    name, which is what a hostname mapped to 127.0.1.1 in ``/etc/hosts`` (Debian's default) gives on machine 0 while
    the other machines resolve it to its network address (the channel then still needs the token to start)."""
    bind = route_address(main_addr)
    if main_addr is not None and is_loopback(bind) and not is_loopback(main_addr):
        logger.info("machine 0: %s routes to %s here; serving the drivers' channel on every interface", main_addr, bind)
        return "0.0.0.0"
    return bind


@dataclass(frozen=True, kw_only=True)
class Leader:
    """Machine 0's side of a sweep on several machines while it runs: the drivers' channel it serves and the plan
    it published (:meth:`start`); each run on several machines goes through :meth:`lead`."""

    coordinator: Coordinator
    plan: SweepPlan

    @classmethod
    def start(
        cls,
        folder: RunFolder,
        todo: list[PlannedRun],
        *,
        recipe: str,
        settings: SweepSettings,
        launch: LaunchInfo,
        progress: Callable[[str], None],
    ) -> Leader:
        """Serve the drivers' channel and publish the plan the other machines follow (the runs of ``todo`` on
        several machines, in order), so that machine k launches exactly what machine 0 launches, on a resume too.
        The plan's id goes into ``RUN/machines/sweep-id``, by which a machine that shares the filesystem finds this
        run folder (and keeps its logs in it).

        Raises:
            RunFolderWriteError: when the sweep id cannot be written.
            SweepError: when the port cannot be served, or the runs need more ports than this job has.
        """
        sweep_id = uuid.uuid4().hex
        try:
            folder.sweep_id_path.parent.mkdir(exist_ok=True)
            folder.sweep_id_path.write_text(sweep_id + "\n", encoding="utf-8")
        except OSError as exc:
            raise RunFolderWriteError(Path(exc.filename) if exc.filename else folder.path, exc) from exc
        port = coordination_port(launch.master_port or 29500, outer_launch=launch.launched)
        spans = tuple(r for r in todo if r.trial.spec.strategy.num_machines > 1 and r.skip_reason is None)
        check_port_block([r.index for r in spans], port)
        coordinator = _serve(port, settings, launch, spans)
        plan = SweepPlan(
            sweep_id=sweep_id, host=socket.gethostname(), run_dir=str(folder.path.resolve()),
            recipe=recipe, settings=settings, runs=spans,
        )  # fmt: skip
        coordinator.publish(PLAN_KEY, plan.to_json())
        progress(
            f"machine 0 of {launch.num_machines}: {len(spans)} runs on several machines; the other machines' "
            f"drivers follow on port {port}"
        )
        return cls(coordinator=coordinator, plan=plan)

    def lead(
        self, run: PlannedRun, *, launch_here: Callable[[], TrialResult], baseline: str, wait_s: float
    ) -> TrialResult:
        """Machine 0's part of a run on several machines: wait (at most ``wait_s``) until every machine taking part
        is ready, tell them to launch (or skip), launch this machine's part (``launch_here``), then merge their
        reports into one row (:func:`merge_machine_reports`). A run not in the plan (one added later, such as a
        ``-maxbatch`` run) is skipped: the other machines could not follow it."""
        index, coordinator = run.index, self.coordinator
        if run.skip_reason is not None:
            coordinator.publish(start_key(index), StartDecision(action="skip", reason=run.skip_reason).to_json())
            return launch_here()
        if all(planned.index != index for planned in self.plan.runs):
            return planned_row(
                run,
                baseline=baseline,
                status="skipped",
                reason="on several machines only the runs planned at the sweep's start are launched",
            )
        others = range(1, run.trial.spec.strategy.num_machines)
        missing = coordinator.wait_for({m: ready_key(index, m) for m in others}, timeout_s=wait_s)
        if missing:
            skip = StartDecision(action="skip", reason="a machine did not come")
            coordinator.publish(start_key(index), skip.to_json())
            return _not_launched(run, missing, baseline=baseline)
        coordinator.publish(start_key(index), StartDecision(action="launch").to_json())
        row = launch_here()
        missing = coordinator.wait_for({m: report_key(index, m) for m in others}, timeout_s=wait_s)
        reports = self._reports(index, [m for m in others if m not in missing], missing)
        dirs = [r.log_dir for _, r in sorted(reports.items())]
        return merge_machine_reports(row, reports, missing, dirs=dirs)

    def _reports(self, index: int, machines: list[int], missing: dict[int, Absent]) -> dict[int, MachineReport]:
        """The reports of ``machines`` for run ``index``; one that cannot be read goes into ``missing`` instead."""
        reports: dict[int, MachineReport] = {}
        for m in machines:
            try:  # a report machine 0 cannot read (another hfscale version) must not cost machine 0's measured row
                reports[m] = MachineReport.from_json(self.coordinator.value(report_key(index, m)))
            except (TypeError, KeyError, AttributeError, ValueError) as exc:
                missing[m] = Absent(kind="late", why=f"its report could not be read ({type(exc).__name__}: {exc})")
        return reports

    def close(self, run_dir: PathLike) -> None:
        """At the sweep's end: keep the environment records the other machines sent, then stop serving."""
        try:
            write_received_environments(self.coordinator, run_dir)  # machines without a shared disk
        finally:
            self.coordinator.close()


def _not_launched(run: PlannedRun, missing: Mapping[int, Absent], *, baseline: str) -> TrialResult:
    """The row of a run no machine launched because a machine did not come: a timeout, or a crash when the first
    such machine's driver spoke and then went silent."""
    strategy = run.trial.spec.strategy
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


__all__ = [
    "PORT_BLOCK_ENV",
    "Leader",
    "check_port_block",
    "coordination_port",
    "machine_ranks",
    "merge_machine_reports",
    "write_received_environments",
]
