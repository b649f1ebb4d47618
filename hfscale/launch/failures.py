"""What a failed trial was: out of memory, a crash (with its final error), a timeout, a signal.

One classifier for the whole project (the sweep's rows and the batch search's probes both use it): a failed
process group is read from its exit status and from the final error of the failing rank in the tail of its stderr,
never from any OOM-like text anywhere in the tail (warnings, traceback source lines and unrelated messages mention
memory too).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from hfscale.core.units import GIB
from hfscale.launch.process import ProcessOutcome

# Out of memory is read from the final error of the failing rank only (never from any text in the tail: warnings,
# traceback source lines and unrelated messages mention memory too). An exception type, or an allocator's message.
_OOM_TYPES = re.compile(r"^(?:[\w.]+\.)?(?:OutOfMemoryError|MemoryError)$")
_OOM_MESSAGES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|"
            r"HIP out of memory|MPS backend out of memory"
        ),
        "CUDA out of memory",
    ),
    (re.compile(r"can't allocate memory|Cannot allocate memory|\[Errno 12\]|\bENOMEM\b"), "host out of memory"),
    (re.compile(r"std::bad_alloc"), "host out of memory"),
    (re.compile(r"OpenBLAS error: Memory allocation still failed"), "host out of memory (OpenBLAS)"),
    (re.compile(r"failed to map segment from shared object"), "host out of memory (mapping a library failed)"),
)
_SIGNAL_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"Signal \d+ \((SIG[A-Z]+)\) received by PID"),  # torchrun's ChildFailedError
    re.compile(r"died with <Signals\.(SIG[A-Z]+)"),  # accelerate's single-process launcher (CalledProcessError)
    re.compile(r"exitcode\s*:\s*-(\d+)"),  # torchrun's failure table
)
# A Python exception line is not indented (traceback source lines are); a bare name (`MemoryError`) counts too.
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:\s.*|:?\s*$)")
# Fatal messages of native code that ends the process without a Python exception.
_NATIVE_FATAL = re.compile(r"^\s*(OpenBLAS error: .*|terminate called .*|what\(\):\s.*)")
_LAUNCHER_ERRORS = ("subprocess.CalledProcessError", "torch.distributed.elastic")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d+)\]:\s?")
_ROOT_CAUSE = "Root Cause (first observed failure):"
"""torchrun's failure table names the rank that failed first after this line, and the ranks it then ended before it."""
_ROOT_CAUSE_RANK = re.compile(re.escape(_ROOT_CAUSE) + r".*?\brank\s*:\s*(\d+)", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class FinalError:
    """The error that ended a failed run: the last fatal line of the failing rank."""

    line: str
    """The ``SomeError: message`` line (or a native fatal message: OpenBLAS, ``terminate called ...``)."""
    rank: int | None
    """The rank it came from, where the lines carry a ``[rankN]:`` prefix; None for an unprefixed run."""

    @property
    def exception_type(self) -> str | None:
        """``torch.OutOfMemoryError`` for ``torch.OutOfMemoryError: CUDA out of memory...``; None for native."""
        match = _ERROR_LINE.match(self.line)
        return self.line.split(":", 1)[0].strip() if match else None

    def out_of_memory(self) -> str | None:
        """What ran out ("CUDA out of memory", "host out of memory", ...), or None when this is not an OOM."""
        kind = self.exception_type
        for pattern, what in _OOM_MESSAGES:
            if pattern.search(self.line):
                return what
        if kind is not None and _OOM_TYPES.match(kind):
            return "host out of memory" if kind == "MemoryError" else "CUDA out of memory"
        return None


def _fatal_lines(stderr_tail: str) -> list[tuple[int | None, str]]:
    """Every fatal line (exception or native) in order, with its rank (None without a ``[rankN]:`` prefix)."""
    found = []
    lines = stderr_tail.splitlines()
    for at, raw in enumerate(lines):
        line = raw.rstrip()
        rank = None
        if match := _RANK_PREFIX.match(line):
            rank, line = int(match.group(1)), line[match.end() :]
        python_error = _ERROR_LINE.match(line) is not None and not line.startswith(_LAUNCHER_ERRORS)
        if python_error and line.rstrip().endswith(":"):
            # A message that starts on the next lines (numpy's ImportError): its last line says what failed.
            line = f"{line.strip()} {_message_tail(lines[at + 1 :], rank)}".rstrip()
        if python_error or _NATIVE_FATAL.match(line):
            found.append((rank, line.strip()))
    return found


def _message_tail(following: list[str], rank: int | None) -> str:
    """The last non-empty line of a multi-line exception message: the lines after the exception's own line from
    the same rank, up to the next traceback or exception line (another rank's lines, or the launcher's, end it)."""
    last = ""
    for raw in following:
        prefix = _RANK_PREFIX.match(raw)
        if (int(prefix.group(1)) if prefix else None) != rank:
            break
        line = _RANK_PREFIX.sub("", raw).strip()
        if line.startswith("Traceback") or _ERROR_LINE.match(line) or _NATIVE_FATAL.match(line):
            break
        last = line or last
    return last


def final_error(stderr_tail: str) -> FinalError | None:
    """The error that ended a failed run, read from the end of its stderr; None when there is none.

    With several ranks (lines prefixed ``[rankN]:``), the failing rank is the one torchrun's failure table names
    as the root cause; without a table, a rank whose final error is an out-of-memory (the others then fail in the
    broken collective), else the last error printed.
    """
    fatal = _fatal_lines(stderr_tail)
    if not fatal:
        return None
    last_by_rank: dict[int | None, str] = {}
    for rank, line in fatal:
        last_by_rank[rank] = line
    if match := _ROOT_CAUSE_RANK.search(stderr_tail):
        root = int(match.group(1))
        if root in last_by_rank:
            return FinalError(line=last_by_rank[root], rank=root)
    ranked = [FinalError(line=line, rank=rank) for rank, line in last_by_rank.items() if rank is not None]
    if len(ranked) > 1:
        for candidate in ranked:
            if candidate.out_of_memory():
                return candidate
    rank, line = fatal[-1]
    return FinalError(line=line, rank=rank)


def stderr_excerpt(text: str, *, max_lines: int = 40, context_lines: int = 15) -> str:
    """The last ``max_lines`` of ``text``; when the last ``SomeError:`` line is further up (torchrun prints its
    failure table after the workers' tracebacks), the ``context_lines`` ending at it come first, then ``...``."""
    lines = text.splitlines()
    last = lines[-max_lines:]
    error = last_error_line(text)

    def shows(line: str) -> bool:
        # The error's own line; for a multi-line message (numpy's ImportError) the line it starts on.
        stripped = _RANK_PREFIX.sub("", line).strip()
        return error is not None and (error in line or (bool(stripped) and error.startswith(stripped)))

    where = [i for i, line in enumerate(lines) if shows(line)]
    if error is None or not where or any(shows(line) for line in last):
        return "\n".join(last)
    at = where[-1]
    return "\n".join([*lines[max(0, at - context_lines + 1) : at + 1], "...", *last])


def last_error_line(stderr_tail: str) -> str | None:
    """The last ``SomeError: message`` line of a traceback (or native fatal message) in ``stderr_tail``, or None;
    a ``[rankN]:`` prefix is removed."""
    fatal = _fatal_lines(stderr_tail)
    return fatal[-1][1] if fatal else None


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

    Out of memory is read from the final error of the failing rank (:func:`final_error`: an ``OutOfMemoryError``
    or ``MemoryError``, an allocator's "can't allocate memory", OpenBLAS's "Memory allocation still failed", ...),
    never from other text in the tail, or from a SIGKILL while the cgroup's OOM-kill count rose
    (``oom_kills_before``: :func:`oom_killed_count` before the start).
    """
    if outcome.timed_out:
        limit = f"{timeout_s:g} s" if timeout_s is not None else "its time limit"
        return Classification(status="timeout", reason=f"still running after {limit} (measure.timeout_s); killed")
    final = final_error(stderr_tail)
    error_line = final.line if final is not None else None
    if final is not None and (what := final.out_of_memory()) is not None:
        limit = f" (memory limit {memory_limit_bytes / GIB:g} GiB per process)" if memory_limit_bytes else ""
        who = f" on rank {final.rank}" if final.rank is not None else ""
        return Classification(status="oom", reason=f"{what}{who}{limit}: {final.line}")
    signal_name = outcome.signal_name or _trial_signal(stderr_tail)
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


def _trial_signal(stderr_tail: str) -> str | None:
    """The signal that ended a process of the trial, as the launchers print it: the root cause's in torchrun's table
    (the others it lists were ended by torchrun itself, with SIGTERM), else the first one printed."""
    _, marked, root_cause = stderr_tail.rpartition(_ROOT_CAUSE)
    for text in (root_cause, stderr_tail) if marked else (stderr_tail,):
        for pattern in _SIGNAL_PATTERNS:
            if match := pattern.search(text):
                value = match.group(1)
                return value if value.startswith("SIG") else _signal_name(int(value))
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


__all__ = [
    "Classification",
    "FinalError",
    "classify",
    "final_error",
    "last_error_line",
    "oom_killed_count",
    "stderr_excerpt",
]
