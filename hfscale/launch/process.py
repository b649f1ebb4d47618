"""Running one trial's process group: start it in its own session, bound it in time and memory, end all of it.

A trial is ``accelerate launch`` plus the processes it starts (one, or a torchrun agent and its workers). They
are started as a new session (``start_new_session=True``), so that the whole group can be signalled at once
(``os.killpg``) on a timeout or a Ctrl-C, and so that a terminal's Ctrl-C reaches the sweep only, which then ends
the group itself. After the launcher exits, anything left in its group is killed too: nothing of one trial's
memory survives into the next.

What a failed group means is decided in :mod:`hfscale.launch.failures`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hfscale.core.files import write_atomic
from hfscale.core.pids import pid_alive
from hfscale.trial.watchdog import DRIVER_PID_ENV

logger = logging.getLogger(__name__)


# Environment a launcher leaves for its workers. A trial started from a sweep that runs under `accelerate launch`
# must not inherit them: its own launcher would join the outer job (same rank, port and error file).
LAUNCHER_ENV_VARS: frozenset[str] = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_SIZE",
        "CROSS_RANK",
        "CROSS_SIZE",
    }
)
LAUNCHER_ENV_PREFIXES: tuple[str, ...] = ("ACCELERATE_", "FSDP_", "MEGATRON_LM_", "TORCHELASTIC_", "TORCH_ELASTIC_")

KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when a group is ended (torchrun forwards SIGTERM to its workers)."""

PID_FILE_ENV = "HFSCALE_PID_FILE"
"""Set in a group's environment when it has a pid file: the file's absolute path. A later sweep that finds the pid
file checks it in ``/proc/PID/environ`` before ending that group (:func:`end_orphaned_group`), so a reused pid is
never signalled."""
GROUP_TAG_ENV = "HFSCALE_GROUP_TAG"
"""Set in every group's environment: a tag unique to the group, which every process it starts inherits. torchrun
starts each worker in a session of its own, outside the launcher's process group, so a launcher that dies at once
(SIGKILL, the OOM killer) leaves its workers training on; :func:`run_process_group` finds them by this tag."""


def clean_environment(base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) without launcher variables (:data:`LAUNCHER_ENV_VARS`, ``ACCELERATE_*``,
    ``TORCHELASTIC_*``, ...), with ``extra`` on top."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in LAUNCHER_ENV_VARS and not k.startswith(LAUNCHER_ENV_PREFIXES)
    }
    env.update(extra or {})
    return env


def free_port() -> int:
    """A TCP port free on this machine now (the kernel's pick for port 0). Another process may take it before the
    trial binds it; the window is a few seconds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class ProcessOutcome:
    """How a process group ended."""

    returncode: int
    """The launcher's exit status; negative when a signal ended it (``subprocess`` convention)."""
    timed_out: bool
    """True when the group was killed after ``timeout_s``."""
    wall_time_s: float
    """Start to exit of the launcher."""
    pid: int
    """The launcher's pid, which is also the group's id."""

    @property
    def signal_name(self) -> str | None:
        """``SIGKILL`` etc. when a signal ended the launcher."""
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``, from ``/proc``; empty where ``/proc`` is missing."""
    members = []
    proc = Path("/proc")
    if not proc.is_dir():
        return members
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it: while it is an unreaped zombie its pid (the group's id)
    cannot be reused, so signalling the group stays safe."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _exited(pid):
            return True
        time.sleep(0.05)
    return _exited(pid)


def _end_group(proc: subprocess.Popen, grace_s: float, tag: str | None = None) -> None:
    """SIGTERM to the group, SIGKILL after ``grace_s``, then :func:`_reap`. Does nothing once reaped."""
    if proc.returncode is not None:
        return
    pgid = proc.pid
    if not _exited(pgid):
        _signal_group(pgid, signal.SIGTERM)
        if not _wait_exit(pgid, grace_s):
            _signal_group(pgid, signal.SIGKILL)
            _wait_exit(pgid, 30.0)
    _reap(proc, tag)


def _tagged(tag: str | None) -> list[int]:
    """Live processes whose environment carries :data:`GROUP_TAG_ENV` ``= tag`` (from ``/proc``)."""
    if not tag or not Path("/proc").is_dir():
        return []
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and int(entry.name) != os.getpid()
        and _environ_of(int(entry.name)).get(GROUP_TAG_ENV) == tag
    ]


def _reap(proc: subprocess.Popen, tag: str | None = None) -> None:
    """Kill what is left of the exited launcher's group (workers a crashed launcher left behind, and processes
    carrying the group's ``tag`` outside it: torchrun's workers), wait (10 s at most) until none is alive, so that
    its memory is free, then reap the launcher. The launcher is reaped last: until then its pid, which is the
    group's id, cannot be given to another process."""
    pgid = proc.pid
    deadline = time.monotonic() + 10.0
    _signal_group(pgid, signal.SIGKILL)
    strays = _tagged(tag)
    while (group_members(pgid) or strays) and time.monotonic() < deadline:
        for pid in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)
        strays = [pid for pid in strays if pid_alive(pid)]
    proc.wait()


def _limit_memory(pid: int, limit_bytes: int) -> None:
    """``RLIMIT_AS`` of a started process; every process it starts afterwards inherits it.

    Set from outside with ``prlimit`` right after the start, not in the child between fork and exec: Python
    documents ``preexec_fn`` as unsafe in a process with threads (the driver runs the channel's server and heartbeat
    threads), where the child can deadlock before it execs. The launcher imports for seconds before it starts a
    worker, so every worker starts under the limit.
    """
    with contextlib.suppress(ProcessLookupError):  # already gone: its exit status says why
        resource.prlimit(pid, resource.RLIMIT_AS, (limit_bytes, limit_bytes))


@dataclass(frozen=True, kw_only=True)
class GroupLimits:
    """How far a process group may go: its time and address space, and how it is ended past its time."""

    timeout_s: float | None = None
    """After this many seconds the whole group is ended (SIGTERM, then SIGKILL); None: no limit."""
    memory_limit_bytes: int | None = None
    """``RLIMIT_AS`` of the launcher and every process it starts; None: no limit."""
    kill_grace_s: float = KILL_GRACE_S
    """Seconds between SIGTERM and SIGKILL."""


@dataclass(frozen=True, kw_only=True)
class GroupHooks:
    """What the caller is told while a process group runs."""

    on_start: Callable[[int], None] | None = None
    """Called with the group's id (the launcher's pid) once it is started (e.g. to watch the machine from outside
    the group)."""
    on_tick: Callable[[float], None] | None = None
    """Called every ``tick_s`` seconds with the elapsed time, for progress."""
    tick_s: float = 30.0


def run_process_group(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    stdout_path: str | os.PathLike[str],
    stderr_path: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    pid_file: str | os.PathLike[str] | None = None,
    limits: GroupLimits | None = None,
    hooks: GroupHooks | None = None,
) -> ProcessOutcome:
    """Run ``argv`` as a new session and wait for it; stdout/stderr go to the two files.

    Args:
        argv: the command (no shell).
        env: its whole environment; :data:`DRIVER_PID_ENV` (this process) and :data:`PID_FILE_ENV` are added.
        stdout_path: file for its stdout (created or truncated).
        stderr_path: file for its stderr.
        cwd: working directory.
        pid_file: where to write the launcher's pid (= the group id) once started; removed when it ends.
        limits: its time and memory (default: none), and the grace between SIGTERM and SIGKILL.
        hooks: called once it has started and every ``tick_s`` while it runs.

    Raises:
        KeyboardInterrupt: after ending the group, when the sweep was interrupted while waiting.
        OSError: when the command cannot be started.
    """
    limits = limits or GroupLimits()
    hooks = hooks or GroupHooks()
    start = time.monotonic()
    tag = uuid.uuid4().hex
    env = {**env, DRIVER_PID_ENV: str(os.getpid()), GROUP_TAG_ENV: tag}
    if pid_file is not None:
        env[PID_FILE_ENV] = str(Path(pid_file).resolve())
    proc = _start(argv, env, stdout_path, stderr_path, cwd=cwd)
    try:  # from here on, whatever fails (a full disk for the pid file, Ctrl-C) ends the group first
        if limits.memory_limit_bytes:
            _limit_memory(proc.pid, limits.memory_limit_bytes)
        if pid_file is not None:
            write_atomic(pid_file, f"{proc.pid}\n")
        if hooks.on_start is not None:
            hooks.on_start(proc.pid)
        timed_out, wall = _wait(proc, tag, start=start, limits=limits, hooks=hooks)
    except BaseException:  # KeyboardInterrupt (Ctrl-C, or SIGTERM through the sweep's handler) or a bug: no leak
        _end_group(proc, limits.kill_grace_s, tag)
        raise
    finally:
        if pid_file is not None:
            Path(pid_file).unlink(missing_ok=True)
    return ProcessOutcome(returncode=int(proc.returncode), timed_out=timed_out, wall_time_s=wall, pid=proc.pid)


def _start(
    argv: Sequence[str],
    env: Mapping[str, str],
    stdout_path: str | os.PathLike[str],
    stderr_path: str | os.PathLike[str],
    *,
    cwd: str | os.PathLike[str] | None,
) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new session, its output into the two files."""
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def _wait(
    proc: subprocess.Popen, tag: str, *, start: float, limits: GroupLimits, hooks: GroupHooks
) -> tuple[bool, float]:
    """Wait until the launcher exits (its group then reaped) or its time is up (the group ended); returns whether
    it timed out and its wall time from ``start``."""
    next_tick = start + hooks.tick_s
    while True:
        now = time.monotonic()
        if _exited(proc.pid):
            _reap(proc, tag)
            return False, now - start
        if limits.timeout_s is not None and now - start > limits.timeout_s:
            logger.info("pid %d: past its %.0f s limit, ending its process group", proc.pid, limits.timeout_s)
            _end_group(proc, limits.kill_grace_s, tag)
            return True, now - start
        if hooks.on_tick is not None and now >= next_tick:
            hooks.on_tick(now - start)
            next_tick = now + hooks.tick_s
        time.sleep(0.1)


def _environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def end_orphaned_group(pid_file: str | os.PathLike[str], *, grace_s: float = KILL_GRACE_S) -> int | None:
    """End the process group that an earlier :func:`run_process_group` recorded in ``pid_file`` and that still
    runs (its driver was killed before it could end it), then remove the pid file.

    Only a group whose processes carry ``pid_file`` in their environment (:data:`PID_FILE_ENV`) is signalled: a
    pid the kernel has given to something else since is left alone. SIGTERM to the group, SIGKILL after
    ``grace_s``, then waits (10 s at most) until none of it runs.

    Returns the group's id when it was running, else None.
    """
    path = Path(pid_file)
    try:
        pgid = int(path.read_text(encoding="utf-8").split()[0])
    except (OSError, ValueError, IndexError):
        path.unlink(missing_ok=True)
        return None
    tag = str(path.resolve())
    ours = [pid for pid in group_members(pgid) if _environ_of(pid).get(PID_FILE_ENV) == tag]
    if not ours:
        path.unlink(missing_ok=True)
        return None
    logger.info("process group %d (from %s) still runs; ending it", pgid, path)
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + 10.0
    while group_members(pgid) and time.monotonic() < deadline:
        _signal_group(pgid, signal.SIGKILL)
        time.sleep(0.05)
    path.unlink(missing_ok=True)
    return pgid


def tail(path: str | os.PathLike[str], *, max_lines: int = 40, max_bytes: int = 16384) -> str:
    """The last lines of a text file (at most ``max_bytes`` read), or '' when it is missing."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first line was cut
    return "\n".join(lines[-max_lines:])


__all__ = [
    "DRIVER_PID_ENV",
    "GROUP_TAG_ENV",
    "LAUNCHER_ENV_PREFIXES",
    "LAUNCHER_ENV_VARS",
    "PID_FILE_ENV",
    "GroupHooks",
    "GroupLimits",
    "ProcessOutcome",
    "clean_environment",
    "end_orphaned_group",
    "free_port",
    "group_members",
    "run_process_group",
    "tail",
]
