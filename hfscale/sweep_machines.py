"""A sweep across machines: one driver per machine; machine 0's leads, the others follow its plan trial by trial.

Each machine runs the same command with its own ``--machine-rank`` (by hand, or ``srun`` under Slurm:
:mod:`hfscale.slurm`). The drivers need no process group of their own: they talk over plain HTTP on the main
machine's ``--main-process-port`` (:class:`Coordinator` on machine 0, :class:`Follower` on the others; the port
minus one under an outer ``accelerate launch``/``torchrun``, whose rendezvous keeps the port). Trial ``i`` of the
sweep rendezvouses on port + 1 + i on every machine (:func:`hfscale.launch.trial_port`).

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
the sbatch script of :mod:`hfscale.slurm` generates one), compared in constant time; a request without it is
refused (403). Machine ``k`` may write only its own keys (``ready/``, ``report/``, ``alive/``, ``env/``), at most
4 MiB each; the plan and the decisions are machine 0's alone. Without ``HFSCALE_SWEEP_TOKEN`` the channel accepts
any request from the network and machine 0 logs a warning.

Logs: with a shared filesystem (what a cluster's home or scratch usually is), machine ``k`` keeps its trials'
configs and logs in ``RUN/machines/machine-K/`` of machine 0's run folder; where it cannot see that folder, in a
run folder of its own (``RUN-machineK``). Only machine 0 writes rows and the report.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.results import TrialResult
from hfscale.run_folder import RunFolder

if TYPE_CHECKING:
    from hfscale.launch import Launched, LaunchInfo
    from hfscale.plan import PlannedRun, SweepSettings
    from hfscale.strategy import Strategy
    from hfscale.sweep import SweepOutcome

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
"""How often a follower tells machine 0 it is alive (also while its trial runs)."""
SILENT_AFTER_S = 10.0
"""A driver not heard from for this long is taken as gone: nobody waits for it any more."""
_POLL_S = 0.5
PathLike = str | os.PathLike[str]
_MACHINE_HEADER = "X-Hfscale-Machine"
_TOKEN_HEADER = "X-Hfscale-Token"
TOKEN_ENV = "HFSCALE_SWEEP_TOKEN"
"""The shared secret every driver of one sweep has in its environment (see the module's docstring)."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest value a follower may write (an environment record or a report is a few KiB)."""
PORT_BLOCK_ENV = "HFSCALE_PORT_BLOCK"
"""Set by the sbatch script: how many ports above the drivers' port are this job's (trial ``i`` uses + 1 + i)."""
# What machine k may write: its own keys only (never ``plan`` or ``start/i``, machine 0's).
_WRITABLE = re.compile(r"(?:ready|report)/\d+/\d+|(?:alive|env)/\d+")

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
    """``ok``, or ``oom``/``crashed``/``timeout`` (:func:`hfscale.failures.classify` of its own group)."""
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


@dataclass(frozen=True, kw_only=True)
class Absent:
    """Why a machine's key did not come while machine 0 waited (:meth:`Coordinator.wait_for`)."""

    kind: str
    """``never`` (its driver never spoke), ``stopped`` (it spoke, then went silent: dead) or ``late`` (its driver
    is alive, its part still running or not ready in time)."""
    why: str

    @property
    def gone(self) -> bool:
        """Its driver never came or stopped: a cause of failure, not a consequence."""
        return self.kind in ("never", "stopped")


def _absent(value: str | Absent) -> Absent:
    return value if isinstance(value, Absent) else Absent(kind="stopped", why=value)


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


# -- the drivers' channel -------------------------------------------------------------------------------------


class MachineZeroGone(RuntimeError):
    """Machine 0's driver stopped answering (it finished, was killed, or its host is unreachable)."""


class ChannelRefused(RuntimeError):
    """Machine 0's driver refused a request (403): this driver's ``HFSCALE_SWEEP_TOKEN`` is not machine 0's."""


class _Store:
    """Keys and JSON values, and when each machine last spoke."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.last_seen: dict[int, float] = {}
        self.lock = threading.Lock()


def _handler(store: _Store, token: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _refuse(self, code: int) -> None:
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _allowed(self) -> bool:
            """The shared token matches (or machine 0 has none); else answers 403."""
            if token is not None:
                given = self.headers.get(_TOKEN_HEADER) or ""
                if not hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8")):
                    self._refuse(403)
                    return False
            machine = self.headers.get(_MACHINE_HEADER)
            if machine is not None and machine.isdigit():
                with store.lock:
                    store.last_seen[int(machine)] = time.monotonic()
            return True

        def do_GET(self) -> None:
            if not self._allowed():
                return
            key = self.path.lstrip("/")
            with store.lock:
                found, value = key in store.values, store.values.get(key)
            if not found:
                self.send_response(404)
                self.end_headers()
                return
            body = json.dumps(value).encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self) -> None:
            if not self._allowed():
                return
            if not _WRITABLE.fullmatch(self.path.lstrip("/")):
                self._refuse(403)
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self._refuse(400)
                return
            if length < 0 or length > MAX_BODY_BYTES:
                self.close_connection = True
                self._refuse(413)
                return
            try:
                value = json.loads(self.rfile.read(length) or b"null")
            except ValueError:
                self._refuse(400)
                return
            with store.lock:
                store.values[self.path.lstrip("/")] = value
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("coordinator: " + format, *args)

    return Handler


class Coordinator:
    """Machine 0's end: an HTTP server (every interface, the given port) holding the plan, the decisions and the
    other machines' reports."""

    def __init__(self, port: int, *, token: str | None = None) -> None:
        self.store = _Store()
        token = token or os.environ.get(TOKEN_ENV) or None
        if token is None:
            logger.warning(
                "machine 0: %s is not set: the drivers' channel on port %d accepts any request from the network; "
                "export the same random value on every machine",
                TOKEN_ENV,
                port,
            )
        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("", port), _handler(self.store, token))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="hfscale-coordinator", daemon=True)
        self.thread.start()

    def publish(self, key: str, value: Any) -> None:
        with self.store.lock:
            self.store.values[key] = value

    def value(self, key: str) -> Any | None:
        with self.store.lock:
            return self.store.values.get(key)

    def silent_for(self, machine: int) -> float | None:
        """Seconds since ``machine``'s driver last spoke; None when it never did."""
        with self.store.lock:
            seen = self.store.last_seen.get(machine)
        return None if seen is None else time.monotonic() - seen

    def wait_for(
        self, keys: Mapping[int, str], *, timeout_s: float, sleep: Callable[[float], None] = time.sleep
    ) -> dict[int, Absent]:
        """Wait until every machine's key in ``keys`` is published, at most ``timeout_s``; a machine that spoke
        and then went silent for :data:`SILENT_AFTER_S` is not waited for. Returns the machines whose key did not
        come, with why: their driver never spoke, went silent (both gone), or is alive but late."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = {m: k for m, k in keys.items() if self.value(k) is None}
            gone = {m for m in missing if (s := self.silent_for(m)) is not None and s > SILENT_AFTER_S}
            if not missing or set(missing) == gone or time.monotonic() >= deadline:
                break
            sleep(_POLL_S)
        problems = {}
        for machine in missing:
            silent = self.silent_for(machine)
            if silent is None:
                why = f"its driver never contacted machine 0 (waited {timeout_s:g} s, --machine-wait-s)"
                problems[machine] = Absent(kind="never", why=why)
            elif silent > SILENT_AFTER_S:
                problems[machine] = Absent(kind="stopped", why=f"its driver stopped (last heard {silent:.0f} s ago)")
            else:
                why = f"its driver is alive but did not answer within {timeout_s:g} s (--machine-wait-s)"
                problems[machine] = Absent(kind="late", why=why)
        return problems

    def received_environments(self) -> dict[int, dict[str, Any]]:
        """The environment records the other machines sent (``env/<m>``), by machine."""
        with self.store.lock:
            items = list(self.store.values.items())
        return {int(k[4:]): v for k, v in items if k.startswith("env/") and k[4:].isdigit() and isinstance(v, dict)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Follower:
    """Machine ``k``'s end: reads and writes machine 0's keys, and tells it every :data:`HEARTBEAT_S` that this
    driver is alive."""

    def __init__(self, host: str, port: int, machine: int) -> None:
        self.base = f"http://{host}:{port}/"
        self.machine = machine
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None
        self._last_answer = time.monotonic()
        self.token = os.environ.get(TOKEN_ENV) or None

    def _request(self, key: str, data: bytes | None = None) -> Any | None:
        headers = {_MACHINE_HEADER: str(self.machine), "Content-Type": "application/json"}
        if self.token is not None:
            headers[_TOKEN_HEADER] = self.token
        request = urllib.request.Request(
            self.base + key, data=data, method="PUT" if data is not None else "GET", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                self._last_answer = time.monotonic()
                return None
            if exc.code == 403:
                raise ChannelRefused(
                    f"machine 0's driver at {self.base} refused {key!r} (403): set the same {TOKEN_ENV} on every "
                    "machine (and write only this machine's keys)"
                ) from None
            raise
        self._last_answer = time.monotonic()
        return json.loads(body) if body else None

    def get(self, key: str) -> Any | None:
        """The value, or None when it is not published yet (or machine 0 does not answer now)."""
        try:
            return self._request(key)
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: Any) -> bool:
        """Publish ``value``; False when machine 0 did not take it."""
        try:
            self._request(key, json.dumps(value).encode("utf-8"))
            return True
        except (OSError, ValueError):
            return False

    def put_until(self, key: str, value: Any) -> None:
        """Publish ``value``, retrying until machine 0 takes it.

        Raises:
            MachineZeroGone: when machine 0 has not answered for :data:`SILENT_AFTER_S`.
            ChannelRefused: when machine 0 refuses it (another token).
        """
        data = json.dumps(value).encode("utf-8")
        while True:
            try:
                self._request(key, data)
                return
            except (OSError, ValueError):
                silent = time.monotonic() - self._last_answer
                if silent > SILENT_AFTER_S:
                    raise MachineZeroGone(
                        f"machine 0's driver at {self.base} did not take {key!r}: no answer for {silent:.0f} s"
                    ) from None
                time.sleep(_POLL_S)

    def wait_for(self, key: str, *, timeout_s: float | None, answered_before: bool = True) -> Any:
        """The value of ``key`` once machine 0 publishes it.

        Raises:
            TimeoutError: after ``timeout_s`` (None: no limit while machine 0 answers).
            MachineZeroGone: when machine 0, having answered before (``answered_before``), has not answered for
                :data:`SILENT_AFTER_S`.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            value = self.get(key)
            if value is not None:
                return value
            now = time.monotonic()
            if answered_before and now - self._last_answer > SILENT_AFTER_S:
                raise MachineZeroGone(
                    f"machine 0's driver at {self.base} stopped answering {now - self._last_answer:.0f} s ago"
                )
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"nothing from machine 0's driver at {self.base} within {timeout_s:g} s")
            time.sleep(_POLL_S)

    def start_heartbeat(self) -> None:
        """Beat once now, then every :data:`HEARTBEAT_S` in a thread until :meth:`stop`."""

        def beat() -> None:
            with contextlib.suppress(ChannelRefused):
                while True:
                    self.put(f"alive/{self.machine}", time.time())
                    if self._stop.wait(HEARTBEAT_S):
                        return

        with contextlib.suppress(ChannelRefused):
            self.put(f"alive/{self.machine}", time.time())

        self._heart = threading.Thread(target=beat, name="hfscale-heartbeat", daemon=True)
        self._heart.start()

    def stop(self) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join(timeout=HEARTBEAT_S + 6)


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
    from hfscale.launch import planned_row
    from hfscale.results import LaunchRecord

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
    reports = {m: MachineReport.from_json(coordinator.value(f"report/{index}/{m}")) for m in others if m not in missing}
    dirs = [r.log_dir for _, r in sorted(reports.items())]
    return merge_machine_reports(row, reports, missing, dirs=dirs)


def sees_run_folder(run_dir: str, sweep_id: str) -> bool:
    """Whether machine 0's run folder is visible here (a shared filesystem): its sweep id file has ``sweep_id``."""
    with contextlib.suppress(OSError):
        return RunFolder(Path(run_dir)).sweep_id_path.read_text(encoding="utf-8").strip() == sweep_id
    return False


def machine_report(launched: Launched, machine: int, strategy: Strategy, log_dir: Path) -> MachineReport:
    """What machine ``machine`` tells machine 0 about its part of a trial (a :class:`hfscale.launch.Launched`)."""
    from hfscale.failures import final_error

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

    from hfscale.device_lock import DeviceBusyError
    from hfscale.launch import launch_group, trial_port
    from hfscale.plan import PlannedRun, SweepError, SweepSettings
    from hfscale.process import end_orphaned_group
    from hfscale.recipe import RecipeTrial, RunSpec
    from hfscale.spec import TrialSpec
    from hfscale.sweep import SweepInterrupted

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
        from hfscale.environment import collect_environment, write_machine_environment

        record = collect_environment(python=python or sys.executable, extra={"launch": dataclasses.asdict(launch)})
        write_machine_environment(plan["run_dir"] if shared else path, machine, record=record)
    except (OSError, ImportError) as exc:
        logger.warning("machine %d: its environment record was not written (%s)", machine, exc)
    if record is not None:  # machine 0 writes it into its run folder where this machine cannot see it
        follower.put_until(f"env/{machine}", {"host": socket.gethostname(), **record})
    if plan.get("host") == socket.gethostname():
        # Two "machines" on one host (a test, or a try-out): this one's part of a trial must not wait for the
        # device lock machine 0's part of the same trial holds; like a real machine, it has a lock folder of its own.
        from hfscale.device_lock import LOCK_DIR_ENV, lock_dir

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
        raise SweepInterrupted(path) from exc
    return path


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
    from hfscale.plan import SweepError, SweepSettings
    from hfscale.sweep import SweepOutcome

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
    from hfscale.environment import machine_environment_path, write_machine_environment

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
    (``HFSCALE_PORT_BLOCK``, set by the sbatch script of :mod:`hfscale.slurm`): trial ``i`` uses port + 1 + i.

    Raises:
        SweepError: when the largest such index does not fit.
    """
    from hfscale.plan import SweepError

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
    "HEARTBEAT_S",
    "SILENT_AFTER_S",
    "Absent",
    "ChannelRefused",
    "Coordinator",
    "Follower",
    "MachineReport",
    "MachineZeroGone",
    "check_port_block",
    "coordination_port",
    "follow_sweep",
    "lead_run",
    "machine_ranks",
    "machine_report",
    "merge_machine_reports",
    "sees_run_folder",
    "write_received_environments",
]
