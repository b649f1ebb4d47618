"""A run folder: where one sweep keeps its recipe, its environment, its rows and each trial's files.

This module is the one place that knows the layout::

    RUN/
      recipe.yaml          the recipe as given
      environment.json     machine, GPUs, versions, commit, the launch, the sweep's settings (and noise floor);
                           each --resume adds an entry to its "resumed" list (with the settings that run used)
      results.jsonl        one TrialResult per line, appended (and fsynced) as each trial ends; a later line of the
                           same (trial, repeat) supersedes an earlier one (the batch search is appended that way)
      search.json          how an adaptive search ended (hfscale.sweep.search); absent for a grid sweep
      results.corrupt.jsonl   lines of results.jsonl that were not valid rows, moved aside by --resume
      trials/NAME/         generated configs (accelerate.yaml, deepspeed.json, training_args.json), the trial's
                           spec (trial.json), its result (result.json) and logs (stdout.log, stderr.log);
                           with repeats, the result and logs of repeat K in repeat-K/
      trials/NAME/probes/bsN/   the same for the batch search's probe at batch N
      trials/NAME/pid      the running group's id (removed when it ends; one left behind by a killed sweep is how
                           --resume finds a trial still running and ends it)
      trials/NAME/tmp/     the running group's TMPDIR (removed when it ends); launcher-logs/: what torchrun left
                           there with content (its per-rank error files)
      .lock                held (flock) while a sweep writes the folder; the kernel releases it when that process dies
      machines/            a sweep on several machines (hfscale.sweep.machines): sweep-id (the id by which machine K
                           finds this folder on a shared filesystem), machine-K.json (each machine's environment)
                           and machine-K/trials/NAME/ (machine K's configs and logs of its part of each trial)
      report.md ...        written at the end (hfscale.report)

Measuring (the trial), storing (this module) and rendering (the report) stay apart: the report reads only what is
written here, so a run folder copied from another machine renders the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from hfscale.core.files import check_writable, file_in_the_way, utc_now, write_atomic
from hfscale.records.row import SCHEMA_VERSION, TrialResult, row_from_json, to_json_text
from hfscale.records.scan import BadLine, RowScan
from hfscale.records.search import SearchSummary

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
CORRUPT_FILE = "results.corrupt.jsonl"
ENVIRONMENT_FILE = "environment.json"
SEARCH_FILE = "search.json"
RECIPE_FILE = "recipe.yaml"
LOCK_FILE = ".lock"
TRIALS_DIR = "trials"
PROBES_DIR = "probes"
SPEC_FILE = "trial.json"
RESULT_FILE = "result.json"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
PID_FILE = "pid"
TRIAL_TMP_DIR = "tmp"
LAUNCHER_LOGS_DIR = "launcher-logs"
MACHINES_DIR = "machines"
"""Per machine of a sweep on several machines: its logs (``machine-K/``) and its environment record
(``machine-K.json``, written by :func:`hfscale.results.environment.write_machine_environment`)."""
SWEEP_ID_FILE = "sweep-id"
"""Less free space than this in a run folder's filesystem is worth a warning before the first trial."""


class RunFolderError(RuntimeError):
    """A run folder that cannot be used as asked: it exists, is locked by another sweep, or cannot be created."""


class RunFolderWriteError(RunFolderError, OSError):
    """Writing into a run folder failed (disk full, read-only, a quota): the message names the path, and says
    that what was written before is kept and how to continue."""

    def __init__(self, path: str | os.PathLike[str], error: OSError) -> None:
        why = error.strerror or str(error)
        super().__init__(error.errno, f"cannot write {path}: {why}")
        self.errno, self.strerror, self.filename = error.errno, why, str(path)
        self.path = Path(path)
        self.error = error

    def __str__(self) -> str:
        return str(self.args[1])


@dataclass(frozen=True)
class RunFolder:
    """One run folder (it need not exist yet): its paths, its lock, reading and appending its rows, its environment
    record and what a resumed sweep finds there."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # -- creating ------------------------------------------------------------------------------------------------

    @classmethod
    def create(cls, *, out_dir: str | os.PathLike[str], name: str) -> RunFolder:
        """A new folder ``OUT/NAME-YYYYmmdd-HHMMSS`` (``-2``, ``-3`` ... when taken), created exclusively.

        Raises:
            RunFolderError: when no free name is left.
            RunFolderWriteError: when ``out_dir`` cannot be created or written (the message names the path).
        """
        parent = Path(out_dir)
        _refuse_what_is_in_the_way(parent)
        base = f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        for attempt in range(1, 1000):
            path = parent / (base if attempt == 1 else f"{base}-{attempt}")
            try:
                parent.mkdir(parents=True, exist_ok=True)
                path.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise RunFolderWriteError(path, exc) from exc
            return cls(path)
        raise RunFolderError(f"cannot create a run folder under {parent}: {base}-N all exist")

    @staticmethod
    def check_new(path: str | os.PathLike[str]) -> None:
        """Raise what :meth:`create_at` would (a file in the way, a folder that exists), creating nothing: a dry
        run's check."""
        path = Path(path)
        _refuse_what_is_in_the_way(path.parent)
        if os.path.lexists(path):
            _refuse_what_is_in_the_way(path)
            raise RunFolderError(f"{path} exists; continue it with --resume {path}, or choose another")

    @classmethod
    def create_at(cls, path: str | os.PathLike[str]) -> RunFolder:
        """Exactly this new folder (its parent is created).

        Raises:
            RunFolderError: when it exists (a run folder is never written by two sweeps, nor reused).
            RunFolderWriteError: when it cannot be created (read-only, no space); the message names the path.
        """
        path = Path(path)
        cls.check_new(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        except FileExistsError:  # made since the check, by another sweep
            raise RunFolderError(f"{path} exists; continue it with --resume {path}, or choose another") from None
        except OSError as exc:
            raise RunFolderWriteError(path, exc) from exc
        return cls(path)

    # -- layout --------------------------------------------------------------------------------------------------

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS_FILE

    @property
    def corrupt_path(self) -> Path:
        return self.path / CORRUPT_FILE

    @property
    def environment_path(self) -> Path:
        return self.path / ENVIRONMENT_FILE

    @property
    def recipe_path(self) -> Path:
        return self.path / RECIPE_FILE

    @property
    def lock_path(self) -> Path:
        return self.path / LOCK_FILE

    def trial_dir(self, trial: str) -> Path:
        """The trial's configs and spec (shared by its repeats)."""
        return self.path / TRIALS_DIR / trial

    def repeat_dir(self, trial: str, repeat: int, repeats: int) -> Path:
        """The folder of one run's result and logs: the trial's own folder, or ``repeat-K`` with repeats."""
        return self.trial_dir(trial) if repeats == 1 else self.trial_dir(trial) / f"repeat-{repeat + 1}"

    def probe_dir(self, trial: str, batch_size: int) -> Path:
        return self.trial_dir(trial) / PROBES_DIR / f"bs{batch_size}"

    def machine_dir(self, machine_rank: int) -> Path:
        """``machines/machine-K``: machine K's configs and logs of its part of each trial (laid out as a run folder)."""
        return self.path / MACHINES_DIR / f"machine-{machine_rank}"

    @property
    def sweep_id_path(self) -> Path:
        """``machines/sweep-id``: machine 0's id of a sweep on several machines, by which machine K, reading the same
        id there, knows it sees this folder (a shared filesystem)."""
        return self.path / MACHINES_DIR / SWEEP_ID_FILE

    def pid_files(self) -> list[Path]:
        """The pid files of groups that were running (or still run) when their sweep stopped: trials and probes."""
        trials = self.path / TRIALS_DIR
        return sorted(trials.rglob(PID_FILE)) if trials.is_dir() else []

    # -- can it be written -----------------------------------------------------------------------------------------

    def check_writable(self) -> int | None:
        """:func:`hfscale.core.files.check_writable` for the folder and its ``trials/``: a read-only or full disk is
        found before the first trial rather than after it. Returns the free bytes there (None where unknown).

        Raises:
            RunFolderWriteError: naming the path that could not be written.
        """
        try:
            return check_writable((self.path, self.path / TRIALS_DIR))
        except OSError as exc:
            raise RunFolderWriteError(Path(exc.filename) if exc.filename else self.path, exc) from exc

    # -- the lock ------------------------------------------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's lock (``RUN/.lock``, an ``flock`` through :mod:`filelock`) for the ``with`` block.

        The kernel releases an ``flock`` when its process dies, however it dies (SIGKILL, the OOM killer), so a
        crashed sweep never leaves a lock to delete by hand. The holder's pid, host and start time are written into
        the file for the message another sweep gets.

        Raises:
            RunFolderError: when another live sweep holds it.
            RunFolderWriteError: when the lock file cannot be opened for writing (read-only, no space).
        """
        from filelock import FileLock, Timeout

        lock = FileLock(self.lock_path, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise RunFolderError(f"{self.path} is being written by another sweep ({self._lock_holder()})") from None
        except OSError as exc:  # read-only, or no space for the lock file
            raise RunFolderWriteError(self.lock_path, exc) from exc
        try:
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": utc_now()}
            # never truncated on open: see filelock #591; only informative, so a full disk does not stop here
            with contextlib.suppress(OSError), open(self.lock_path, "r+", encoding="utf-8") as fh:
                fh.truncate(0)
                fh.write(json.dumps(holder) + "\n")
            yield
        finally:
            try:
                with open(self.lock_path, "r+", encoding="utf-8") as fh:
                    fh.truncate(0)
            except OSError:
                pass
            lock.release()

    def _lock_holder(self) -> str:
        try:
            holder = json.loads(self.lock_path.read_text(encoding="utf-8"))
            return f"pid {holder['pid']} on {holder['host']}, since {holder['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "its holder did not say who it is"

    # -- rows ----------------------------------------------------------------------------------------------------

    def append(self, row: TrialResult) -> None:
        """Append one row and make it durable before returning, so a crash or Ctrl-C never loses a finished trial.

        A row whose (trial, repeat) is already in the file supersedes it (:meth:`scan`).

        Raises:
            RunFolderWriteError: when the file cannot be written (disk full, read-only); the rows already written
                are kept, and what was written of this one is cut off again (so the file ends with a whole row).
        """
        line = (to_json_text(row) + "\n").encode("utf-8")
        try:
            size = self.results_path.stat().st_size
        except FileNotFoundError:
            size = 0
        try:
            with open(self.results_path, "ab") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):
                if self.results_path.stat().st_size > size:
                    os.truncate(self.results_path, size)
            raise RunFolderWriteError(self.results_path, exc) from exc

    def scan(self) -> RowScan:
        """Read ``results.jsonl``: every valid row (the latest line of each (trial, repeat), at the place its first
        line had), and the lines that are not rows.

        Raises:
            FileNotFoundError: when the folder has no results file.
            ValueError: for a row of a newer schema than this hfscale reads (upgrade hfscale; nothing is skipped).
        """
        rows: dict[tuple[str, int], TrialResult] = {}
        bad: list[BadLine] = []
        torn = False
        # newline="\n": only "\n" ends a line, so line numbers are those of the bytes on disk
        with open(self.results_path, encoding="utf-8", errors="replace", newline="\n") as fh:
            for number, line in enumerate(fh, 1):
                if not line.endswith("\n"):
                    torn = True
                    break
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                    if not isinstance(data, dict):
                        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
                except ValueError as exc:
                    bad.append(BadLine(number=number, text=line.rstrip("\n"), error=f"not JSON: {exc}"))
                    continue
                version = data.get("schema_version", 1)
                if isinstance(version, int) and version > SCHEMA_VERSION:
                    raise ValueError(
                        f"{self.results_path}:{number}: a row of schema_version {version}, written by a newer hfscale; "
                        f"this one reads schema 1 to {SCHEMA_VERSION}: upgrade hfscale to read this run"
                    )
                try:
                    row = row_from_json(data)
                except ValueError as exc:
                    bad.append(BadLine(number=number, text=line.rstrip("\n"), error=str(exc)))
                    continue
                rows[row.key] = row
        return RowScan(rows=list(rows.values()), bad_lines=bad, torn_tail=torn)

    def rows(self, *, on_bad_line: Literal["warn", "raise"] = "warn") -> list[TrialResult]:
        """Every row (the latest of each (trial, repeat)), in the order written; a torn last line (killed
        mid-write) is not a row.

        Args:
            on_bad_line: ``warn``: a line that is not a valid row is skipped and named in a logged warning (one bad
                line does not cost the run's other rows); ``raise``: it is an error.

        Raises:
            FileNotFoundError: when the folder has no results file.
            ValueError: for a row of a newer schema; with ``on_bad_line="raise"``, naming the first bad line.
        """
        scan = self.scan()
        for bad in scan.bad_lines:
            where = f"{self.results_path}:{bad.number}"
            if on_bad_line == "raise":
                raise ValueError(f"{where}: {bad.error}")
            logger.warning(
                "%s: not a valid row, skipped (%s); `hfscale sweep --resume` re-runs that trial", where, bad.error
            )
        return scan.rows

    def set_aside_bad_lines(self) -> list[BadLine]:
        """Move every line of ``results.jsonl`` that is not a row (and a torn last line) to
        ``results.corrupt.jsonl`` and rewrite ``results.jsonl`` without them (atomically), so that the next append
        starts on a line of its own and a resumed sweep re-runs those trials. Call it holding the lock.

        Returns the lines moved (a torn last line among them, with its error ``torn last line``).
        """
        if not self.results_path.exists():
            return []
        scan = self.scan()
        if not scan.bad_lines and not scan.torn_tail:
            return []
        data = self.results_path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline, else the torn line
        moved = list(scan.bad_lines)
        if tail:
            moved.append(BadLine(number=len(lines) + 1, text=tail.decode("utf-8", "replace"), error="torn last line"))
        drop = {b.number for b in moved}
        keep = [line for number, line in enumerate(lines, 1) if number not in drop]
        with open(self.corrupt_path, "a", encoding="utf-8") as fh:
            for bad in moved:
                fh.write(json.dumps({"line": bad.number, "error": bad.error, "text": bad.text, "moved_at": utc_now()}))
                fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        write_atomic(self.results_path, b"".join(line + b"\n" for line in keep), fsync=True)
        for bad in moved:
            logger.info(
                "%s:%d: not a valid row (%s); moved to %s",
                self.results_path,
                bad.number,
                bad.error,
                self.corrupt_path,
            )
        return moved

    # -- environment and recipe ----------------------------------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        """The run's environment record, or an empty dict when the folder has none.

        Raises:
            RunFolderError: when the file is not a JSON object (the message names it).
        """
        if not self.environment_path.exists():
            return {}
        try:
            record = json.loads(self.environment_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise RunFolderError(f"{self.environment_path}: cannot be read: {exc}") from exc
        if not isinstance(record, dict):
            raise RunFolderError(f"{self.environment_path}: expected a JSON object, got {type(record).__name__}")
        return record

    def write_environment(self, environment: dict[str, Any]) -> None:
        """Replace the environment record atomically (a reader never sees half a file).

        Raises:
            RunFolderWriteError: when it cannot be written; the earlier record is kept.
        """
        try:
            write_atomic(self.environment_path, json.dumps(environment, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise RunFolderWriteError(self.environment_path, exc) from exc

    def record_resume(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Add a resumed run's environment (with the settings it ran with) to ``environment["resumed"]``; returns
        the whole record."""
        environment = self.environment()
        environment.setdefault("resumed", []).append(entry)
        self.write_environment(environment)
        return environment

    def write_search(self, summary: SearchSummary) -> None:
        """Record how an adaptive search ended (a resumed one rewrites it). Raises RunFolderWriteError."""
        try:
            write_atomic(self.path / SEARCH_FILE, json.dumps(summary.to_json(), indent=2) + "\n")
        except OSError as exc:
            raise RunFolderWriteError(self.path / SEARCH_FILE, exc) from exc

    def clear_search(self) -> None:  # while a (resumed) search runs: search.json says how one ended
        (self.path / SEARCH_FILE).unlink(missing_ok=True)

    def search(self) -> SearchSummary | None:
        """How its adaptive search ended; None for a grid sweep (or one still searching)."""
        path = self.path / SEARCH_FILE
        if not path.exists():
            return None
        return SearchSummary.from_json(json.loads(path.read_text(encoding="utf-8")))

    def copy_recipe(self, source: str | os.PathLike[str]) -> None:
        try:
            shutil.copyfile(source, self.recipe_path)
        except OSError as exc:
            raise RunFolderWriteError(self.recipe_path, exc) from exc


def _refuse_what_is_in_the_way(folder: Path) -> None:
    if (file := file_in_the_way(folder)) is not None:
        raise RunFolderError(f"{file} is not a folder (a file, or a broken link): no run folder can be made there")


def read_results(run_dir: str | os.PathLike[str]) -> list[TrialResult]:
    """Every row of a run folder (:meth:`RunFolder.rows`)."""
    return RunFolder(Path(run_dir)).rows()


__all__ = [
    "CORRUPT_FILE",
    "ENVIRONMENT_FILE",
    "LAUNCHER_LOGS_DIR",
    "LOCK_FILE",
    "MACHINES_DIR",
    "PID_FILE",
    "PROBES_DIR",
    "RECIPE_FILE",
    "RESULTS_FILE",
    "RESULT_FILE",
    "SEARCH_FILE",
    "SPEC_FILE",
    "STDERR_FILE",
    "STDOUT_FILE",
    "SWEEP_ID_FILE",
    "TRIALS_DIR",
    "TRIAL_TMP_DIR",
    "BadLine",
    "RowScan",
    "RunFolder",
    "RunFolderError",
    "RunFolderWriteError",
    "read_results",
]
