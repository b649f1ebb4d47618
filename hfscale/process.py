"""Running one trial's process group: start it in its own session, bound it in time and memory, end all of it.

A trial is ``accelerate launch`` plus the processes it starts (one, or a torchrun agent and its workers). They
are started as a new session (``start_new_session=True``), so that the whole group can be signalled at once
(``os.killpg``) on a timeout or a Ctrl-C, and so that a terminal's Ctrl-C reaches the sweep only, which then ends
the group itself. After the launcher exits, anything left in its group is killed too: nothing of one trial's
memory survives into the next.

What a failed group means is decided by :func:`classify` from the exit status and the tail of its stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

GIB = 2**30

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


def _end_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the group, SIGKILL after ``grace_s``, then :func:`_reap`. Does nothing once reaped."""
    if proc.returncode is not None:
        return
    pgid = proc.pid
    if not _exited(pgid):
        _signal_group(pgid, signal.SIGTERM)
        if not _wait_exit(pgid, grace_s):
            _signal_group(pgid, signal.SIGKILL)
            _wait_exit(pgid, 30.0)
    _reap(proc)


def _reap(proc: subprocess.Popen) -> None:
    """Kill what is left of the exited launcher's group (workers a crashed launcher left behind), wait (10 s at
    most) until the group has no live process, so that its memory is free, then reap the launcher. The launcher
    is reaped last: until then its pid, which is the group's id, cannot be given to another process."""
    pgid = proc.pid
    deadline = time.monotonic() + 10.0
    _signal_group(pgid, signal.SIGKILL)
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)
    proc.wait()


def _limit_memory(limit_bytes: int) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return apply


def run_process_group(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    stdout_path: str | os.PathLike[str],
    stderr_path: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    memory_limit_bytes: int | None = None,
    pid_file: str | os.PathLike[str] | None = None,
    on_tick: Callable[[float], None] | None = None,
    tick_s: float = 30.0,
    kill_grace_s: float = KILL_GRACE_S,
) -> ProcessOutcome:
    """Run ``argv`` as a new session and wait for it; stdout/stderr go to the two files.

    Args:
        argv: the command (no shell).
        env: its whole environment.
        stdout_path: file for its stdout (created or truncated).
        stderr_path: file for its stderr.
        cwd: working directory.
        timeout_s: after this many seconds the whole group is ended (SIGTERM, then SIGKILL).
        memory_limit_bytes: ``RLIMIT_AS`` of the launcher and every process it starts.
        pid_file: where to write the launcher's pid (= the group id) once started; removed when it ends.
        on_tick: called every ``tick_s`` seconds with the elapsed time, for progress.
        kill_grace_s: seconds between SIGTERM and SIGKILL.

    Raises:
        KeyboardInterrupt: after ending the group, when the sweep was interrupted while waiting.
        OSError: when the command cannot be started.
    """
    start = time.monotonic()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=_limit_memory(memory_limit_bytes) if memory_limit_bytes else None,
        )
    if pid_file is not None:
        tmp = Path(f"{pid_file}.tmp")
        tmp.write_text(f"{proc.pid}\n", encoding="utf-8")
        os.replace(tmp, pid_file)
    timed_out = False
    next_tick = start + tick_s
    try:
        while True:
            now = time.monotonic()
            if _exited(proc.pid):
                wall = now - start
                _reap(proc)
                break
            if timeout_s is not None and now - start > timeout_s:
                logger.info("pid %d: past its %.0f s limit, ending its process group", proc.pid, timeout_s)
                timed_out = True
                wall = now - start
                _end_group(proc, kill_grace_s)
                break
            if on_tick is not None and now >= next_tick:
                on_tick(now - start)
                next_tick = now + tick_s
            time.sleep(0.1)
    except BaseException:  # KeyboardInterrupt (Ctrl-C, or SIGTERM through the sweep's handler) or a bug: no leak
        _end_group(proc, kill_grace_s)
        raise
    finally:
        if pid_file is not None:
            Path(pid_file).unlink(missing_ok=True)
    return ProcessOutcome(returncode=int(proc.returncode), timed_out=timed_out, wall_time_s=wall, pid=proc.pid)


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


# -- what a failure was ------------------------------------------------------------------------------------------

_OOM_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"CUDA out of memory|torch\.OutOfMemoryError|torch\.cuda\.OutOfMemoryError"), "CUDA out of memory"),
    (re.compile(r"CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation"), "CUDA out of memory"),
    (re.compile(r"can't allocate memory|Cannot allocate memory|\[Errno 12\]|ENOMEM"), "host out of memory"),
    (re.compile(r"\bMemoryError\b|std::bad_alloc"), "host out of memory"),
    (re.compile(r"failed to map segment from shared object"), "host out of memory (mapping a library failed)"),
    (re.compile(r"[Oo]ut of memory"), "out of memory"),
)
_SIGNAL_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"Signal \d+ \((SIG[A-Z]+)\) received by PID"),  # torchrun's ChildFailedError
    re.compile(r"died with <Signals\.(SIG[A-Z]+)"),  # accelerate's single-process launcher (CalledProcessError)
    re.compile(r"exitcode\s*:\s*-(\d+)"),  # torchrun's failure table
)
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?\s.*")
_LAUNCHER_ERRORS = ("subprocess.CalledProcessError", "torch.distributed.elastic")


def stderr_excerpt(text: str, *, max_lines: int = 40, context_lines: int = 15) -> str:
    """The last ``max_lines`` of ``text``; when the last ``SomeError:`` line is further up (torchrun prints its
    failure table after the workers' tracebacks), the ``context_lines`` ending at it come first, then ``...``."""
    lines = text.splitlines()
    last = lines[-max_lines:]
    error = last_error_line(text)
    if error is None or any(error in line for line in last):
        return "\n".join(last)
    at = max(i for i, line in enumerate(lines) if error in line)
    return "\n".join([*lines[max(0, at - context_lines + 1) : at + 1], "...", *last])


def last_error_line(stderr_tail: str) -> str | None:
    """The last ``SomeError: message`` line of a traceback in ``stderr_tail``, or None."""
    found = None
    for line in stderr_tail.splitlines():
        stripped = line.strip()
        # torchrun prefixes each worker's lines with "[rank0]: "
        stripped = re.sub(r"^\[(rank|default)\d+\]:\s*", "", stripped)
        if _ERROR_LINE.match(stripped) and not stripped.startswith(_LAUNCHER_ERRORS):
            found = stripped
    return found


def oom_killed_count() -> int | None:
    """The kernel's OOM-kill count for this cgroup (cgroup v2 ``memory.events``), or None where unreadable."""
    for path in ("/sys/fs/cgroup/memory.events",):
        try:
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


@dataclass(frozen=True, kw_only=True)
class Classification:
    """A failed group, in the sweep's terms."""

    status: str
    """``oom``, ``crashed`` or ``timeout``."""
    reason: str
    """One sentence a user can act on."""


def classify(
    outcome: ProcessOutcome,
    stderr_tail: str,
    *,
    timeout_s: float | None = None,
    memory_limit_bytes: int | None = None,
    oom_kills_before: int | None = None,
) -> Classification:
    """Why a group that wrote no result failed: timeout, out of memory (device or host), or a crash.

    Out of memory is read from stderr (CUDA OOM, ``MemoryError``, "can't allocate memory", ...), or from a SIGKILL
    while the cgroup's OOM-kill count rose (``oom_kills_before``: :func:`oom_killed_count` before the start).
    """
    if outcome.timed_out:
        limit = f"{timeout_s:g} s" if timeout_s is not None else "its time limit"
        return Classification(status="timeout", reason=f"still running after {limit} (measure.timeout_s); killed")
    error_line = last_error_line(stderr_tail)
    for pattern, what in _OOM_PATTERNS:
        if pattern.search(stderr_tail):
            limit = f" (memory limit {memory_limit_bytes / GIB:g} GiB per process)" if memory_limit_bytes else ""
            detail = f": {error_line}" if error_line else ""
            return Classification(status="oom", reason=f"{what}{limit}{detail}")
    signal_name = outcome.signal_name
    if signal_name is None:
        for pattern in _SIGNAL_PATTERNS:
            match = pattern.search(stderr_tail)
            if match:
                value = match.group(1)
                signal_name = value if value.startswith("SIG") else _signal_name(int(value))
                break
    if signal_name == "SIGKILL" and oom_kills_before is not None:
        after = oom_killed_count()
        if after is not None and after > oom_kills_before:
            return Classification(status="oom", reason="killed by the kernel's OOM killer (SIGKILL, memory.events)")
    if signal_name is not None:
        who = "the launcher" if outcome.signal_name else "a process of the trial"
        detail = f"; last error: {error_line}" if error_line else ""
        return Classification(status="crashed", reason=f"{who} was killed by {signal_name}{detail}")
    detail = f": {error_line}" if error_line else " (see stderr.log)"
    return Classification(status="crashed", reason=f"exit code {outcome.returncode}{detail}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


__all__ = [
    "LAUNCHER_ENV_PREFIXES",
    "LAUNCHER_ENV_VARS",
    "Classification",
    "ProcessOutcome",
    "classify",
    "clean_environment",
    "free_port",
    "group_members",
    "last_error_line",
    "oom_killed_count",
    "run_process_group",
    "stderr_excerpt",
    "tail",
]
