"""The sweep: run every trial of a recipe, each as its own freshly launched process group, and record each result.

Three ways to start it, the same program::

    hfscale sweep RECIPE
    python -m hfscale.sweep RECIPE
    accelerate launch --num_processes N -m hfscale.sweep RECIPE

Under a launcher, one process per machine (local rank 0) is the *driver*; the other ranks exit at once (status
0). The driver never joins a process group itself: for each trial it writes the trial's configs
(:func:`hfscale.configs.write_configs`) and starts ``accelerate launch ... -m hfscale.trial`` as a new session
with a free port and a clean environment (no ``RANK``, ``MASTER_PORT``, ``ACCELERATE_*``, ... of the outer
launch), so that nothing of one trial (memory, accelerate state, a hung collective) reaches the next. A trial
that does not pin ``num_processes``/``num_machines`` in the recipe gets the outer launch's counts (or
``--num-processes``/``--num-machines``).

A failed trial is a row, not the end of the sweep: ``oom``, ``crashed`` (exit code or signal), ``timeout`` (the
whole group is killed), ``not_applied`` (the trial ran something other than its strategy), ``skipped`` (a missing
optional dependency or GPU, decided before launching). Rows are appended and fsynced one at a time; Ctrl-C ends
the running trial's group and keeps every finished row; ``--resume RUN`` runs what is missing.

Memory (``hfscale.estimate``): every row carries the trial's predicted peak (``row.estimate``), made before it
runs; ``--skip-predicted-oom`` does not launch a trial predicted not to fit ``--memory-budget`` (default: the GPU's
memory) and records it as ``skipped`` with the predicted figure. ``--find-max-batch`` then searches, for each
trial, the largest per-device batch that fits with short probe runs, each its own process group
(:func:`search_max_batch`, stored in ``row.extra["batch_search"]``). When the trials are done, every loss curve is
compared with the baseline's (``hfscale.parity``); the report derives the same from the rows, so
``results.jsonl`` stays append-only.

Run folder (``runs/RECIPE-YYYYmmdd-HHMMSS`` unless ``--run-dir``)::

    RUN/recipe.yaml        the recipe as given
    RUN/environment.json   machine, GPUs, versions, commit, the launch (see hfscale.environment)
    RUN/results.jsonl      one TrialResult per line
    RUN/trials/NAME/       accelerate.yaml, deepspeed.json, training_args.json, trial.json (the spec), result.json,
                           stdout.log, stderr.log (repeats > 1: result and logs in repeat-K/)
    RUN/trials/NAME/probes/bsN/   the same for the batch search's probe at batch N
    RUN/.lock              held while a sweep writes the folder
    RUN/report.md ...      written at the end (hfscale.report)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hfscale.batch_search import BatchProbe, ProbeOutcome
from hfscale.process import (
    GIB,
    Classification,
    ProcessOutcome,
    classify,
    clean_environment,
    free_port,
    oom_killed_count,
    run_process_group,
    stderr_excerpt,
    tail,
)
from hfscale.recipe import Recipe, RecipeError, RecipeTrial, load_recipe
from hfscale.results import (
    ENVIRONMENT_FILE,
    RECIPE_FILE,
    RESULTS_FILE,
    TRIALS_DIR,
    TrialResult,
    append_result,
    read_results,
)
from hfscale.spec import TrialSpec
from hfscale.strategy import EIGHT_BIT_OPTIMIZERS, Strategy

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
SPEC_FILE = "trial.json"
RESULT_FILE = "result.json"
PID_FILE = "pid"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
DEFAULT_OUT_DIR = "runs"
INTERRUPTED_EXIT = 130


class SweepError(RuntimeError):
    """A sweep that cannot start: the run folder exists or is locked, the recipe and run folder disagree, ..."""


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM/SIGHUP) during a sweep: the running trial's group was ended; finished rows are kept."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(f"sweep interrupted; finished trials are in {run_dir}")
        self.run_dir = run_dir


# -- where this process sits in an outer launch -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LaunchInfo:
    """This process's place in an outer ``accelerate launch``/``torchrun``, read from its environment."""

    launched: bool = False
    """True when a distributed launcher started this process (``LOCAL_RANK``/``WORLD_SIZE`` are set)."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    machine_rank: int = 0
    num_machines: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchInfo:
        env = os.environ if env is None else env
        if "LOCAL_RANK" not in env and "WORLD_SIZE" not in env:
            return cls()

        def get(name: str, default: int) -> int:
            try:
                return int(env.get(name, default))
            except ValueError:
                return default

        world = get("WORLD_SIZE", 1)
        local_world = get("LOCAL_WORLD_SIZE", world) or world
        rank = get("RANK", 0)
        return cls(
            launched=True,
            rank=rank,
            local_rank=get("LOCAL_RANK", 0),
            world_size=world,
            local_world_size=local_world,
            machine_rank=get("GROUP_RANK", get("NODE_RANK", rank // max(local_world, 1))),
            num_machines=max(world // max(local_world, 1), 1),
            master_addr=env.get("MASTER_ADDR"),
            master_port=get("MASTER_PORT", 0) or None,
        )

    @property
    def is_driver(self) -> bool:
        """One driver per machine: local rank 0."""
        return self.local_rank == 0


# -- what will run --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One launch of one trial (a trial with ``measure.repeats`` = 3 is three runs)."""

    trial: RecipeTrial
    repeat: int
    """0-based."""
    index: int
    """Position in the whole sweep, 0-based (multi-machine ports are derived from it)."""
    skip_reason: str | None = None
    """Why it will not be launched, decided before launching."""
    estimate: dict[str, Any] | None = None
    """``MemoryEstimate.to_dict()`` of the trial (:func:`estimate_runs`); None when it could not be estimated."""
    estimate_error: str | None = None
    """Why there is no estimate (a model type or optimizer the estimator does not model, ...)."""
    predicted_oom: bool = False
    """``skip_reason`` is ``--skip-predicted-oom``'s: the estimate does not fit the budget."""

    @property
    def name(self) -> str:
        return self.trial.name

    @property
    def repeats(self) -> int:
        return self.trial.spec.measure.repeats

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.repeat)

    @property
    def label(self) -> str:
        return self.name if self.repeats == 1 else f"{self.name} (repeat {self.repeat + 1}/{self.repeats})"


def skip_reason(strategy: Strategy, *, gpu_count: int, num_machines: int) -> str | None:
    """Why a strategy cannot run here, decided without launching it; None when it can be tried.

    Missing optional dependencies are found with ``importlib.util.find_spec`` (nothing is imported).
    """
    if strategy.deepspeed is not None and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'hfscale[deepspeed]')"
    if strategy.optimizer in EIGHT_BIT_OPTIMIZERS and importlib.util.find_spec("bitsandbytes") is None:
        return (
            f"optimizer {strategy.optimizer!r} needs bitsandbytes, which is not installed (pip install 'hfscale[bnb]')"
        )
    if strategy.num_machines > num_machines:
        return f"needs {strategy.num_machines} machines; this sweep was launched on {num_machines}"
    if strategy.device == "cuda":
        per_machine = strategy.num_processes // strategy.num_machines
        if gpu_count == 0:
            return "device 'cuda' but no CUDA device is visible (see environment.json)"
        if per_machine > gpu_count:
            return f"needs {per_machine} GPUs per machine; {gpu_count} visible"
    return None


def plan_runs(
    trials: Sequence[RecipeTrial], *, gpu_count: int, num_machines: int, only: Sequence[str] | None = None
) -> list[PlannedRun]:
    """Every launch, in recipe order, repeats together; ``only`` keeps the named trials.

    Raises:
        SweepError: when ``only`` names a trial the recipe does not have.
    """
    names = [t.name for t in trials]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise SweepError(f"--only: no trial named {', '.join(unknown)}; trials are {', '.join(names)}")
    runs = []
    for trial in trials:
        if only and trial.name not in only:
            continue
        reason = skip_reason(trial.spec.strategy, gpu_count=gpu_count, num_machines=num_machines)
        for repeat in range(trial.spec.measure.repeats):
            runs.append(PlannedRun(trial=trial, repeat=repeat, index=len(runs), skip_reason=reason))
    return runs


def estimate_runs(
    runs: Sequence[PlannedRun], *, budget_bytes: int | None = None, skip_predicted_oom: bool = False
) -> list[PlannedRun]:
    """Every run with its trial's memory estimate (:func:`hfscale.estimate.estimate_memory`, one per trial); with
    ``skip_predicted_oom``, a run whose estimate does not fit ``budget_bytes`` per device (CUDA context included on
    a GPU: :func:`hfscale.estimate.predict_fit`) is skipped with the predicted figure as its reason.

    The estimate is advice: a trial it cannot model (an unknown model type or optimizer) keeps no estimate, is
    launched, and the reason is logged.

    Raises:
        SweepError: when ``skip_predicted_oom`` is asked without a budget.
    """
    if skip_predicted_oom and budget_bytes is None:
        raise SweepError(_NO_BUDGET)
    from hfscale.estimate import estimate_memory, predict_fit

    by_trial: dict[str, tuple[dict[str, Any] | None, str | None, str | None]] = {}
    out = []
    for run in runs:
        if run.name not in by_trial:
            spec = run.trial.spec
            try:
                if skip_predicted_oom and budget_bytes is not None:
                    fit = predict_fit(spec, budget_bytes)
                    by_trial[run.name] = (fit.estimate.to_dict(), None, None if fit.fits else fit.reason)
                else:
                    by_trial[run.name] = (estimate_memory(spec).to_dict(), None, None)
            except Exception as exc:  # advice only: a model the estimator cannot build must not stop the sweep
                error = _short(f"{type(exc).__name__}: {exc}", 300)  # transformers lists every model type
                logger.warning("%s: no memory estimate (%s); it will be launched", run.name, error)
                by_trial[run.name] = (None, error, None)
        estimate, error, oom_reason = by_trial[run.name]
        predicted_oom = run.skip_reason is None and oom_reason is not None
        out.append(
            dataclasses.replace(
                run,
                estimate=estimate,
                estimate_error=error,
                skip_reason=oom_reason if predicted_oom else run.skip_reason,
                predicted_oom=predicted_oom,
            )
        )
    return out


_NO_BUDGET = (
    "--skip-predicted-oom needs a memory budget per device: give --memory-budget SIZE (e.g. --memory-budget 80GiB); "
    "no GPU memory is recorded for this machine to default to"
)


def _predicted_gib(run: PlannedRun) -> float | None:
    value = (run.estimate or {}).get("total_gib")
    return float(value) if isinstance(value, int | float) else None


# -- the run folder ---------------------------------------------------------------------------------------------------


def _timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def create_run_dir(*, out_dir: str | os.PathLike[str], name: str) -> Path:
    """A new folder ``OUT/NAME-TIMESTAMP`` (``-2``, ``-3`` ... when taken), created exclusively."""
    parent = Path(out_dir)
    parent.mkdir(parents=True, exist_ok=True)
    base = f"{name}-{_timestamp()}"
    for attempt in range(1, 1000):
        path = parent / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise SweepError(f"cannot create a run folder under {parent}: {base}-N all exist")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(run_dir: Path) -> Path:
    """Create ``RUN/.lock`` exclusively (pid, host, time). A lock left by a dead process on this host is replaced.

    Raises:
        SweepError: when another live sweep holds it.
    """
    path = run_dir / LOCK_FILE
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                holder = {}
            pid, host = holder.get("pid"), holder.get("host")
            if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
                logger.warning("removing a stale lock of pid %s (no longer running): %s", pid, path)
                path.unlink(missing_ok=True)
                continue
            raise SweepError(
                f"{run_dir} is being written by another sweep (pid {pid} on {host}, since {holder.get('time')}); "
                f"if it is gone, delete {path}"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "time": _utc_now()}, fh)
        return path
    raise SweepError(f"cannot take the lock {path}")


def _repair_results(path: Path) -> None:
    """Drop a torn last line (a sweep killed mid-write) so that the next append starts on a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - keep)
        with open(path, "r+b") as fh:
            fh.truncate(keep)


def _run_files(run_dir: Path, run: PlannedRun) -> tuple[Path, Path]:
    """(configs folder, folder of this repeat's logs and result)."""
    trial_dir = run_dir / TRIALS_DIR / run.name
    return trial_dir, (trial_dir if run.repeats == 1 else trial_dir / f"repeat-{run.repeat + 1}")


# -- one trial ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SweepSettings:
    """What the command line adds to a recipe; recorded in environment.json so that ``--resume`` keeps it."""

    num_processes: int | None = None
    """Processes for trials that do not pin ``num_processes`` (None: the recipe's own, 1 by default)."""
    num_machines: int | None = None
    """Machines for trials that do not pin ``num_machines``."""
    memory_limit_gib: float | None = None
    """Overrides every trial's ``run.memory_limit_gib``."""
    timeout_s: float | None = None
    """Overrides every trial's ``measure.timeout_s``."""
    only: tuple[str, ...] = ()
    """Run only these trials."""
    memory_budget_bytes: int | None = None
    """Memory per device (``--memory-budget``) for ``skip_predicted_oom``, the batch search's first size and the
    report's recommendation; None: the GPU memory ``environment.json`` records, if any."""
    skip_predicted_oom: bool = False
    """Do not launch a trial whose estimated peak does not fit the budget; its row is ``skipped`` with the figure."""
    find_max_batch: bool = False
    """After each trial, search the largest per-device batch that fits (:mod:`hfscale.batch_search`)."""
    max_batch_limit: int = 1024
    """Largest per-device batch the search tries."""
    probe_steps: int = 3
    """Optimizer steps of each batch-search probe after the trial's warm-up steps (at least 2: the steady-state
    throughput needs two timed steps)."""

    def __post_init__(self) -> None:
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes: expected a positive size, got {self.memory_budget_bytes}")
        if self.max_batch_limit < 1:
            raise ValueError(f"max_batch_limit: expected a positive batch size, got {self.max_batch_limit}")
        if self.probe_steps < 2:
            raise ValueError(
                f"probe_steps: expected 2 or more (the throughput needs two timed steps), got {self.probe_steps}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "only": list(self.only)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["only"] = tuple(kwargs.get("only") or ())
        return cls(**kwargs)


def trial_command(
    trial: RecipeTrial,
    configs_dir: Path,
    run_files_dir: Path,
    *,
    launch: LaunchInfo,
    port: int,
    python: str = sys.executable,
) -> list[str]:
    """Write the trial's configs and spec into ``configs_dir`` and return the command that runs it."""
    from hfscale.configs import write_configs

    strategy = trial.spec.strategy
    multi = strategy.num_machines > 1
    configs = write_configs(
        strategy,
        configs_dir,
        machine_rank=launch.machine_rank if multi else 0,
        main_process_ip=(launch.master_addr or "127.0.0.1") if multi else None,
        main_process_port=port,
    )
    spec_path = configs_dir.resolve() / SPEC_FILE
    trial.spec.write(spec_path)
    target = ["-m", "hfscale.trial", str(spec_path), "--result", str(run_files_dir.resolve() / RESULT_FILE)]
    return configs.launch_command(target, python=python)


def _trial_port(run: PlannedRun, launch: LaunchInfo) -> int:
    """A free port on one machine; on several, every machine's driver must agree without talking: the outer
    launch's port + 1 + the run's index (the outer rendezvous keeps its own port)."""
    if run.trial.spec.strategy.num_machines > 1:
        base = launch.master_port or 29500
        return 1024 + (base + 1 + run.index - 1024) % (65535 - 1024)
    return free_port()


def _peak_gib(row: TrialResult) -> float | None:
    memory = row.memory or {}
    value = memory.get("peak_gib")
    return float(value) if isinstance(value, int | float) else None


def _samples_per_s(row: TrialResult) -> float | None:
    value = (row.throughput or {}).get("samples_per_s")
    if isinstance(value, int | float):
        return float(value)
    return row.train_samples_per_second


def format_row(row: TrialResult) -> str:
    """One line for a finished trial: status, samples/s, peak memory (and the predicted peak), wall time (or the
    reason it failed)."""
    parts = [row.status]
    if row.status in ("ok", "not_applied"):
        sps, peak = _samples_per_s(row), _peak_gib(row)
        predicted = _number((row.estimate or {}).get("total_gib"))
        parts.append(f"{sps:.2f} samples/s" if sps is not None else "samples/s n/a")
        parts.append(
            (f"peak {peak:.2f} GiB" if peak is not None else "peak n/a")
            + (f" (predicted {predicted:.2f})" if predicted is not None else "")
        )
    if row.wall_time_s is not None:
        parts.append(f"{row.wall_time_s:.1f} s")
    line = "  ".join(parts)
    if row.status != "ok" and row.reason:
        line += f"  ({row.reason})"
    return line


def _result_row(
    run: PlannedRun,
    *,
    baseline: str,
    status: str,
    reason: str | None = None,
    **fields: Any,
) -> TrialResult:
    strategy = run.trial.spec.strategy
    extra = {"repeat": run.repeat, "repeats": run.repeats, **fields.pop("extra", {})}
    if run.estimate_error is not None:
        extra["estimate_error"] = run.estimate_error
    return TrialResult(
        trial=run.name,
        strategy=strategy.to_dict(),
        status=status,
        reason=reason,
        description=strategy.describe(),
        is_baseline=run.name == baseline,
        estimate=run.estimate,
        extra=extra,
        **fields,
    )


@dataclass(frozen=True, kw_only=True)
class _Launched:
    """How one launch of a trial's process group went, before it becomes a row or a probe outcome."""

    command: list[str]
    port: int
    outcome: ProcessOutcome
    result: dict[str, Any] | None
    """What the trial wrote to ``result.json``; None when it wrote nothing readable."""
    stderr_text: str
    """The end of its stderr (256 KiB at most), searched for the error."""
    memory_limit_gib: float | None
    timeout_s: float
    oom_kills_before: int | None
    started_at: str
    finished_at: str

    @property
    def memory_limit_bytes(self) -> int | None:
        return int(self.memory_limit_gib * GIB) if self.memory_limit_gib else None

    def failure(self) -> Classification:
        """Why a group that wrote no result (or did not exit cleanly) failed."""
        return classify(
            self.outcome,
            self.stderr_text,
            timeout_s=self.timeout_s,
            memory_limit_bytes=self.memory_limit_bytes,
            oom_kills_before=self.oom_kills_before,
        )


def _launch(
    trial: RecipeTrial,
    configs_dir: Path,
    files_dir: Path,
    *,
    port: int,
    launch: LaunchInfo,
    settings: SweepSettings,
    python: str,
    on_tick: Callable[[float], None] | None = None,
) -> _Launched:
    """Write the trial's configs, run its process group (limits from ``settings`` over the recipe's) and read what
    it left: the result file and the end of stderr."""
    files_dir.mkdir(parents=True, exist_ok=True)
    result_path = files_dir / RESULT_FILE
    result_path.unlink(missing_ok=True)  # left by an interrupted earlier attempt
    cmd = trial_command(trial, configs_dir, files_dir, launch=launch, port=port, python=python)
    memory_limit_gib = (
        settings.memory_limit_gib if settings.memory_limit_gib is not None else trial.run.memory_limit_gib
    )
    timeout_s = settings.timeout_s if settings.timeout_s is not None else trial.spec.measure.timeout_s
    env = clean_environment(extra={"PYTHONUNBUFFERED": "1", **trial.run.env})
    oom_before = oom_killed_count()
    started_at = _utc_now()
    outcome = run_process_group(
        cmd,
        env=env,
        stdout_path=files_dir / STDOUT_FILE,
        stderr_path=files_dir / STDERR_FILE,
        timeout_s=timeout_s,
        memory_limit_bytes=int(memory_limit_gib * GIB) if memory_limit_gib else None,
        pid_file=files_dir / PID_FILE,
        on_tick=on_tick,
    )
    # Search well back for the error (torchrun's failure table comes after the workers' tracebacks).
    stderr_text = tail(files_dir / STDERR_FILE, max_lines=2000, max_bytes=256 * 1024)
    return _Launched(
        command=cmd,
        port=port,
        outcome=outcome,
        result=_read_result(result_path),
        stderr_text=stderr_text,
        memory_limit_gib=memory_limit_gib,
        timeout_s=timeout_s,
        oom_kills_before=oom_before,
        started_at=started_at,
        finished_at=_utc_now(),
    )


def run_trial(
    run: PlannedRun,
    run_dir: Path,
    *,
    baseline: str,
    launch: LaunchInfo,
    settings: SweepSettings,
    python: str = sys.executable,
    progress: Callable[[str], None] = logger.info,
    prefix: str = "",
) -> TrialResult:
    """Launch one trial and turn how it ended into a row (nothing is appended here).

    Raises:
        KeyboardInterrupt: when interrupted; the trial's process group has been ended.
    """
    if run.skip_reason is not None:
        return _result_row(run, baseline=baseline, status="skipped", reason=run.skip_reason)
    configs_dir, files_dir = _run_files(run_dir, run)
    launched = _launch(
        run.trial,
        configs_dir,
        files_dir,
        port=_trial_port(run, launch),
        launch=launch,
        settings=settings,
        python=python,
        on_tick=lambda elapsed: progress(f"{prefix}{run.label}: still running, {_clock(elapsed)}"),
    )
    outcome, data = launched.outcome, launched.result
    stderr_tail = stderr_excerpt(launched.stderr_text)  # an excerpt is kept in the row
    extra: dict[str, Any] = {
        "command": launched.command,
        "main_process_port": launched.port,
        "memory_limit_gib": launched.memory_limit_gib,
        "timeout_s": launched.timeout_s,
        "trial_dir": str(files_dir.relative_to(run_dir)),
    }
    common = {
        "exit_code": outcome.returncode,
        "wall_time_s": outcome.wall_time_s,
        "started_at": launched.started_at,
        "finished_at": launched.finished_at,
    }
    if data is not None:
        # The trial measured and wrote its result: that stands even if the group then failed to exit cleanly.
        if outcome.returncode != 0 or outcome.timed_out:
            failure = classify(
                outcome,
                launched.stderr_text,
                timeout_s=launched.timeout_s,
                memory_limit_bytes=launched.memory_limit_bytes,
            )
            extra["after_result"] = f"{failure.status}: {failure.reason}"
        status = data.get("status", "crashed")
        if status not in ("ok", "not_applied"):
            status, data["reason"] = "crashed", f"result.json has status {status!r}"
        known = {f.name for f in dataclasses.fields(TrialResult)}
        # Measurements of the same name are copied; the sweep's own fields (status, times, exit, estimate) win; the
        # rest of what the trial wrote (timings, world size, merged TrainingArguments, mismatches) goes to `extra`.
        own = {"trial", "strategy", "status", "reason", "description", "is_baseline", "extra", "estimate", *common}
        measured = {k: v for k, v in data.items() if k in known and k not in own}
        extra |= {k: v for k, v in data.items() if k not in known}
        return _result_row(
            run,
            baseline=baseline,
            status=status,
            reason=data.get("reason"),
            stderr_tail=stderr_tail if status != "ok" else None,
            extra=extra,
            **common,
            **measured,
        )
    if outcome.returncode == 0 and not outcome.timed_out:
        status, reason = "crashed", f"exited 0 without writing {RESULT_FILE}"
    else:
        failure = launched.failure()
        status, reason = failure.status, failure.reason
    return _result_row(
        run, baseline=baseline, status=status, reason=reason, stderr_tail=stderr_tail, extra=extra, **common
    )


# -- the largest batch that fits ------------------------------------------------------------------------------------

PROBES_DIR = "probes"


def probe_spec(spec: TrialSpec, batch_size: int, *, probe_steps: int) -> TrialSpec:
    """The trial at another per-device batch size, trained for its warm-up steps plus ``probe_steps``.

    The data set holds exactly enough samples for that many full global batches, so that no step trains a smaller
    remainder batch (a recipe's 128 samples would otherwise cap a probe of 256).

    Raises:
        StrategyError: when the strategy refuses the batch size.
    """
    strategy = spec.strategy.replace(per_device_batch_size=batch_size)
    max_steps = spec.measure.warmup_steps + probe_steps
    global_batch = batch_size * strategy.gradient_accumulation_steps * strategy.num_processes
    return dataclasses.replace(
        spec,
        strategy=strategy,
        data=dataclasses.replace(spec.data, num_samples=global_batch * max_steps),
        measure=dataclasses.replace(spec.measure, max_steps=max_steps, num_epochs=1.0, repeats=1),
    )


def _probe_outcome(launched: _Launched) -> ProbeOutcome:
    """A probe's process group as the batch search reads it: out of memory is an outcome, anything else that did
    not train (or trained something other than the strategy) an error. The samples/s are the steady-state figure
    (warm-up steps left out), as in the report's tables."""
    data = launched.result
    if data is not None:
        if data.get("status") == "ok":
            return ProbeOutcome(
                status="fits",
                samples_per_s=_number((data.get("throughput") or {}).get("samples_per_s")),
                peak_memory_gib=_number((data.get("memory") or {}).get("peak_gib")),
            )
        return ProbeOutcome(status="error", reason=f"trained, but {data.get('reason') or data.get('status')}")
    if launched.outcome.returncode == 0 and not launched.outcome.timed_out:
        return ProbeOutcome(status="error", reason=f"exited 0 without writing {RESULT_FILE}")
    failure = launched.failure()
    return ProbeOutcome(
        status="oom" if failure.status == "oom" else "error", reason=f"{failure.status}: {failure.reason}"
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _trial_probe(row: TrialResult) -> ProbeOutcome | None:
    """The trial's own run as a probe at its batch size: it fitted (ok) or ran out of memory; None otherwise."""
    if row.status == "ok":
        return ProbeOutcome(
            status="fits",
            samples_per_s=_number((row.throughput or {}).get("samples_per_s")),
            peak_memory_gib=_peak_gib(row),
        )
    if row.status == "oom":
        return ProbeOutcome(status="oom", reason=f"the trial's own run: {row.reason}")
    return None


def search_max_batch(
    run: PlannedRun,
    run_dir: Path,
    row: TrialResult,
    *,
    budget_bytes: int | None,
    launch: LaunchInfo,
    settings: SweepSettings,
    python: str = sys.executable,
    progress: Callable[[str], None] = logger.info,
    prefix: str = "",
) -> dict[str, Any]:
    """Find the largest per-device batch that fits for a trial that has run (``row``): what
    ``row.extra["batch_search"]`` stores.

    Each probe is one launch of the trial's process group at another batch size, for the warm-up steps plus
    ``settings.probe_steps`` (:func:`probe_spec`), with the trial's memory limit and timeout; its configs, result
    and logs are in ``trials/NAME/probes/bsN/``. Out of memory bounds the search; any other failure stops it. The
    trial's own run counts as the probe at its batch size. The first size is the estimate's largest that fits the
    budget (:func:`hfscale.batch_search.suggest_start_batch`) when there is a budget, else the trial's own.

    Returns ``BatchSearchResult.to_dict()`` with ``searched``, ``start_from``, ``upper_limit``, ``probe_steps``,
    ``budget_bytes`` and ``trial_run_batch_size`` (the probe that is the trial's own run, if one is); or
    ``{"searched": False, "reason": ...}`` when the trial is not searched (skipped for another reason than a
    predicted out of memory, crashed, timed out, not applied, or spans several machines).

    Raises:
        KeyboardInterrupt: when interrupted; the running probe's group has been ended.
    """
    from hfscale.batch_search import find_max_batch, suggest_start_batch

    spec = run.trial.spec
    why_not = _why_not_searched(run, row)
    if why_not is not None:
        progress(f"{prefix}{run.name}: no batch search ({why_not})")
        return {"searched": False, "reason": why_not}

    limit = settings.max_batch_limit
    start, start_from = spec.strategy.per_device_batch_size, "the trial's batch size"
    if budget_bytes is not None:
        try:
            start = suggest_start_batch(spec, budget_bytes, upper_limit=limit)
            start_from = "the estimate"
        except Exception as exc:  # the estimate is advice: start from the trial's batch instead
            logger.warning("%s: no estimated start for the batch search (%s)", run.name, exc)
    own = _trial_probe(row)
    trial_dir = run_dir / TRIALS_DIR / run.name / PROBES_DIR

    def probe(batch: int) -> ProbeOutcome:
        if own is not None and batch == spec.strategy.per_device_batch_size:
            return own
        try:
            trial = dataclasses.replace(run.trial, spec=probe_spec(spec, batch, probe_steps=settings.probe_steps))
        except ValueError as exc:  # StrategyError: the strategy refuses this batch size
            return ProbeOutcome(status="error", reason=str(exc))
        folder = trial_dir / f"bs{batch}"
        progress(f"{prefix}{run.name}: batch search: probing batch {batch}")
        launched = _launch(trial, folder, folder, port=free_port(), launch=launch, settings=settings, python=python)
        return _probe_outcome(launched)

    def report(p: BatchProbe) -> None:
        o = p.outcome
        detail = f"{o.samples_per_s:.2f} samples/s" if o.samples_per_s is not None else (o.reason or "")
        progress(f"{prefix}{run.name}: batch {p.batch_size}: {o.status}" + (f" ({_short(detail)})" if detail else ""))

    result = find_max_batch(probe, start=start, upper_limit=limit, on_probe=report)
    found = (
        f"largest batch that fits: {result.max_batch_size}"
        + (f" ({result.samples_per_s:.2f} samples/s)" if result.samples_per_s is not None else "")
        + (f", out of memory at {result.first_oom_batch_size}" if result.first_oom_batch_size else "")
        + (f" (the upper limit {limit}: may be higher)" if result.reached_upper_limit else "")
        + (f"; stopped: {result.stopped_reason}" if result.stopped_reason else "")
    )
    progress(f"{prefix}{run.name}: {found} ({len(result.probes)} probes)")
    reused = own is not None and any(p.batch_size == spec.strategy.per_device_batch_size for p in result.probes)
    return {
        **result.to_dict(),
        "searched": True,
        "trial_run_batch_size": spec.strategy.per_device_batch_size if reused else None,
        "start_from": start_from,
        "upper_limit": limit,
        "probe_steps": settings.probe_steps,
        "budget_bytes": budget_bytes,
    }


def _why_not_searched(run: PlannedRun, row: TrialResult) -> str | None:
    """Why a trial gets no batch search, or None: a trial predicted out of memory, or that ran out of memory, is
    searched (a smaller batch may fit); one skipped for another reason, or that failed otherwise, is not."""
    if run.skip_reason is not None and not run.predicted_oom:
        return f"skipped: {run.skip_reason}"
    if row.status in ("crashed", "timeout", "not_applied"):
        return f"the trial ended {row.status}"
    if run.trial.spec.strategy.num_machines > 1:
        return "trials on several machines are not searched"
    return None


def _search_key(trial: RecipeTrial) -> str:
    """What decides a trial's largest batch: everything of its spec and launch but its name, its batch size and the
    data set's length (probes size the data set themselves)."""
    spec = trial.spec
    strategy = {k: v for k, v in spec.strategy.to_dict().items() if k not in ("name", "per_device_batch_size")}
    data = {k: v for k, v in dataclasses.asdict(spec.data).items() if k != "num_samples"}
    key = {
        "strategy": strategy,
        "model": dataclasses.asdict(spec.model),
        "data": data,
        "training_args": spec.training_args,
        "warmup_steps": spec.measure.warmup_steps,
        "timeout_s": spec.measure.timeout_s,
        "run": dataclasses.asdict(trial.run),
    }
    return json.dumps(key, sort_keys=True, default=str)


def _short(text: str, limit: int = 100) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _read_result(path: Path) -> dict[str, Any] | None:
    """The trial's result JSON, or None when it wrote none (or nothing readable: the trial writes it atomically,
    so an unreadable file means something else wrote it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("%s is unreadable (%s); the trial counts as having written no result", path, exc)
        return None
    return data if isinstance(data, dict) else None


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# -- the sweep ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SweepOutcome:
    """What :func:`run_sweep` did."""

    run_dir: Path
    rows: list[TrialResult]
    """The rows appended by this call (a resumed sweep's earlier rows are not repeated)."""
    report_paths: list[Path]
    """What :func:`hfscale.report.write_report` wrote, if it ran."""
    report_error: str | None = None
    """Why the report at the end was not written (the rows are on disk regardless); None when it was or was not
    asked for."""


def _resolve(recipe: Recipe, settings: SweepSettings) -> list[RecipeTrial]:
    return recipe.resolve(num_processes=settings.num_processes, num_machines=settings.num_machines)


def launch_settings(
    launch: LaunchInfo,
    *,
    num_processes: int | None = None,
    num_machines: int | None = None,
    memory_limit_gib: float | None = None,
    timeout_s: float | None = None,
    only: Sequence[str] = (),
    **options: Any,
) -> SweepSettings:
    """Command-line values, falling back to the outer launch's process and machine counts; ``options`` are the
    other :class:`SweepSettings` fields (``memory_budget_bytes``, ``skip_predicted_oom``, ``find_max_batch``, ...).
    """
    if num_processes is None and launch.launched:
        num_processes = launch.world_size
    if num_machines is None and launch.launched:
        num_machines = launch.num_machines
    return SweepSettings(
        num_processes=num_processes,
        num_machines=num_machines,
        memory_limit_gib=memory_limit_gib,
        timeout_s=timeout_s,
        only=tuple(only),
        **options,
    )


def _write_report(
    run_dir: Path, progress: Callable[[str], None], *, memory_budget_bytes: int | None = None
) -> tuple[list[Path], str | None]:
    """The paths written and None, or no paths and why the report failed."""
    try:
        from hfscale.report import write_report
    except ImportError as exc:
        logger.warning("no report written (%s); run `hfscale report %s` later", exc, run_dir)
        return [], f"ImportError: {exc}"
    try:
        written = write_report(run_dir, memory_budget_bytes=memory_budget_bytes)
    except Exception as exc:  # a report bug must not cost the measurements, which are already on disk
        logger.warning("writing the report failed: %s: %s; run `hfscale report %s`", type(exc).__name__, exc, run_dir)
        return [], f"{type(exc).__name__}: {exc}"
    paths = _paths(written)
    if paths:
        progress(f"report: {', '.join(str(p) for p in paths)}")
    return paths, None


def _paths(value: Any) -> list[Path]:
    """Every path in what ``write_report`` returned (a dataclass of paths, a mapping, a list, or one path)."""
    if isinstance(value, str | os.PathLike):
        return [Path(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [p for f in dataclasses.fields(value) for p in _paths(getattr(value, f.name))]
    if isinstance(value, Mapping):
        return [p for v in value.values() for p in _paths(v)]
    if isinstance(value, list | tuple):
        return [p for v in value for p in _paths(v)]
    return []


def run_sweep(
    recipe_path: str | os.PathLike[str] | None,
    *,
    out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR,
    run_dir: str | os.PathLike[str] | None = None,
    resume: str | os.PathLike[str] | None = None,
    settings: SweepSettings | None = None,
    launch: LaunchInfo | None = None,
    report: bool = True,
    python: str = sys.executable,
    progress: Callable[[str], None] = logger.info,
) -> SweepOutcome:
    """Run a recipe's trials into a run folder (new, or ``resume``'s), one fresh process group per trial.

    Args:
        recipe_path: the recipe; with ``resume``, optional (the run folder's copy is used) and must match it.
        out_dir: parent of a new run folder.
        run_dir: exactly this new run folder instead.
        resume: a run folder to complete: only runs without a row are launched, with the recorded settings.
        settings: process counts, limits and ``only`` (default: the outer launch's counts).
        launch: where this process sits in an outer launch (default: read from the environment).
        report: write ``report.md``/``report.html`` at the end.
        python: the interpreter that runs ``accelerate launch``.
        progress: receives one line per event (trial start, heartbeat, result).

    Raises:
        RecipeError: for an invalid recipe.
        SweepError: when the run folder exists, is locked, or does not match the recipe.
        KeyboardInterrupt: when interrupted; finished rows are on disk, the running trial's group was ended.
    """
    launch = launch or LaunchInfo.from_env()
    record = launch.machine_rank == 0
    if resume is not None:
        folder = Path(resume)
        stored = folder / RECIPE_FILE
        if not stored.exists():
            raise SweepError(f"--resume {folder}: no {RECIPE_FILE} there; is it a run folder?")
        if recipe_path is not None and Path(recipe_path).read_bytes() != stored.read_bytes():
            raise SweepError(f"{recipe_path} differs from {stored}; resume with the run folder's recipe (omit RECIPE)")
        recipe = load_recipe(stored)
        try:
            environment = json.loads((folder / ENVIRONMENT_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SweepError(f"--resume {folder}: cannot read {ENVIRONMENT_FILE} ({exc})") from None
        recorded = SweepSettings.from_dict(environment.get("sweep", {}))
        given = settings or SweepSettings()
        # Counts come from the first run, so an unpinned trial is the same trial; --only may narrow.
        settings = dataclasses.replace(recorded, only=given.only or recorded.only)
    else:
        if recipe_path is None:
            raise SweepError("give a RECIPE (or --resume RUN_DIR)")
        recipe = load_recipe(recipe_path)
        settings = settings or launch_settings(launch)
    trials = _resolve(recipe, settings)
    # Read before the run folder exists, so that a sweep that cannot start leaves nothing behind.
    from hfscale.environment import collect_environment

    sweep_info = {"sweep": settings.to_dict(), "launch": dataclasses.asdict(launch), "command": list(sys.argv)}
    current = collect_environment(python=python, extra=sweep_info)
    budget = memory_budget(settings, current)
    if settings.skip_predicted_oom and budget is None:
        raise SweepError(_NO_BUDGET)

    if resume is not None:
        acquire_lock(folder)
    else:
        if run_dir is not None:
            folder = Path(run_dir)
            if launch.machine_rank > 0:
                folder = folder.with_name(f"{folder.name}-machine{launch.machine_rank}")
            folder.parent.mkdir(parents=True, exist_ok=True)
            try:
                folder.mkdir()
            except FileExistsError:
                raise SweepError(f"{folder} exists; continue it with --resume {folder}, or choose another") from None
        else:
            suffix = f"-machine{launch.machine_rank}" if launch.machine_rank > 0 else ""
            folder = create_run_dir(out_dir=out_dir, name=recipe.name + suffix)
        acquire_lock(folder)
    try:
        return _run_locked(
            folder, recipe, trials, settings, launch, record, report, python, progress, resume, current, budget
        )
    except KeyboardInterrupt as exc:
        raise SweepInterrupted(folder) from exc
    finally:
        (folder / LOCK_FILE).unlink(missing_ok=True)


def _run_locked(
    folder: Path,
    recipe: Recipe,
    trials: list[RecipeTrial],
    settings: SweepSettings,
    launch: LaunchInfo,
    record: bool,
    report: bool,
    python: str,
    progress: Callable[[str], None],
    resume: str | os.PathLike[str] | None,
    current: dict[str, Any],
    budget: int | None,
) -> SweepOutcome:
    env_path = folder / ENVIRONMENT_FILE
    if resume is None:
        if recipe.path:
            shutil.copyfile(recipe.path, folder / RECIPE_FILE)
        env_path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        environment = current
    else:
        environment = json.loads(env_path.read_text(encoding="utf-8"))
        environment.setdefault("resumed", []).append(current)
        tmp = env_path.with_name(env_path.name + ".tmp")
        tmp.write_text(json.dumps(environment, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, env_path)
    gpu_count = int(current.get("gpu_count") or 0)
    machines = settings.num_machines or launch.num_machines
    runs = plan_runs(trials, gpu_count=gpu_count, num_machines=machines, only=settings.only)
    # Every machine estimates and skips alike: a trial machine 0 skips must not be started on the others.
    runs = estimate_runs(runs, budget_bytes=budget, skip_predicted_oom=settings.skip_predicted_oom)
    if launch.machine_rank > 0:
        # Other machines join only the trials that span them; machine 0 records the rows.
        runs = [r for r in runs if launch.machine_rank < r.trial.spec.strategy.num_machines and r.skip_reason is None]

    results_path = folder / RESULTS_FILE
    done: set[tuple[str, int]] = set()
    if resume is not None:
        _repair_results(results_path)
        if results_path.exists():
            done = {(r.trial, int(r.extra.get("repeat", 0))) for r in read_results(folder)}
    todo = [r for r in runs if r.key not in done]
    progress(
        f"sweep {recipe.name}: {len(todo)} of {len(runs)} runs to do"
        + (f" ({len(runs) - len(todo)} already in {folder})" if done else "")
        + f"; run folder {folder}"
    )
    start = time.monotonic()
    rows: list[TrialResult] = []
    failed_before: dict[str, str] = {}
    # Trials that differ only in their batch size have the same largest batch: search it once.
    searches: dict[str, tuple[str, dict[str, Any]]] = {}
    if resume is not None and settings.find_max_batch and results_path.exists():
        by_name = {t.name: t for t in trials}
        for earlier in read_results(folder):
            found = earlier.extra.get("batch_search")
            if earlier.trial in by_name and isinstance(found, dict) and found.get("searched"):
                searches.setdefault(_search_key(by_name[earlier.trial]), (earlier.trial, found))
    for k, run in enumerate(todo, 1):
        prefix = f"[{k}/{len(todo)}] "
        if run.name in failed_before:
            run = dataclasses.replace(run, skip_reason=failed_before[run.name])
        predicted = _predicted_gib(run)
        progress(
            f"{prefix}{run.label}: {run.trial.spec.strategy.describe()}"
            + (f"; predicted peak {predicted:.2f} GiB" if predicted is not None else "")
            + (f"; skipped: {run.skip_reason}" if run.skip_reason else "")
            + f"  (sweep elapsed {_clock(time.monotonic() - start)})"
        )
        row = run_trial(
            run,
            folder,
            baseline=recipe.baseline,
            launch=launch,
            settings=settings,
            python=python,
            progress=progress,
            prefix=prefix,
        )
        if row.status not in ("ok", "not_applied") and run.repeat + 1 < run.repeats:
            failed_before[run.name] = f"repeat {run.repeat + 1} ended {row.status}; not repeated"
        progress(f"{prefix}{run.name}: {format_row(row)}")
        if settings.find_max_batch and run.repeat == 0 and record:
            # Part of the row: a sweep interrupted during the search reruns the trial and its search on --resume.
            key = _search_key(run.trial)
            if key in searches and _why_not_searched(run, row) is None:
                other, found = searches[key]
                progress(f"{prefix}{run.name}: batch search: the same as {other}'s (only the batch size differs)")
                row.extra["batch_search"] = {**found, "same_as": other, "trial_run_batch_size": None}
            else:
                row.extra["batch_search"] = search_max_batch(
                    run,
                    folder,
                    row,
                    budget_bytes=budget,
                    launch=launch,
                    settings=settings,
                    python=python,
                    progress=progress,
                    prefix=prefix,
                )
                if row.extra["batch_search"].get("searched"):
                    searches[key] = (run.name, row.extra["batch_search"])
        if record:
            append_result(results_path, row)
        rows.append(row)
    progress(f"sweep {recipe.name}: {len(rows)} runs in {_clock(time.monotonic() - start)}; results in {results_path}")
    if record and results_path.exists():
        try:
            _check_parity(results_path.parent, rows, progress)
        except Exception as exc:  # analysis only: the rows are already on disk
            logger.warning("loss-parity check failed: %s: %s", type(exc).__name__, exc)
    report_paths: list[Path] = []
    report_error = None
    if report and record and results_path.exists():
        report_paths, report_error = _write_report(folder, progress, memory_budget_bytes=settings.memory_budget_bytes)
    return SweepOutcome(run_dir=folder, rows=rows, report_paths=report_paths, report_error=report_error)


def memory_budget(settings: SweepSettings, environment: Mapping[str, Any]) -> int | None:
    """The memory per device trials must fit: ``--memory-budget``, else the smallest GPU's memory as the
    environment record has it (:func:`hfscale.report.gpu_memory_from_environment`), else None (a CPU machine)."""
    if settings.memory_budget_bytes is not None:
        return settings.memory_budget_bytes
    from hfscale.report import gpu_memory_from_environment

    return gpu_memory_from_environment(environment)


def _check_parity(run_dir: Path, rows: list[TrialResult], progress: Callable[[str], None]) -> None:
    """Compare every ok row's loss curve in the run folder (a resumed sweep's earlier rows too) with the
    baseline's (:func:`hfscale.parity.annotate_rows`); this call's rows get ``extra["parity"]`` and a flagged one is
    announced. ``results.jsonl`` is not rewritten: the report computes the same from the curves it holds."""
    from hfscale.parity import annotate_rows

    everything = read_results(run_dir)
    annotate_rows(everything)
    by_key = {(r.trial, int(r.extra.get("repeat", 0))): r.extra.get("parity") for r in everything}
    for row in rows:
        parity = by_key.get((row.trial, int(row.extra.get("repeat", 0))))
        if parity is not None:
            row.extra["parity"] = parity
    for row in everything:
        parity = row.extra.get("parity") or {}
        if parity.get("flagged"):
            progress(
                f"loss parity: {row.trial} departs from the baseline {parity.get('baseline')}: {parity.get('reason')}"
            )


# -- dry run ------------------------------------------------------------------------------------------------------


def dry_run_lines(
    recipe: Recipe, settings: SweepSettings, launch: LaunchInfo, *, python: str = sys.executable
) -> list[str]:
    """The expanded trials, each one's predicted peak memory and the command each would run, without running
    anything (configs go to a temporary folder, shown as ``RUN/trials/NAME``).

    Raises:
        SweepError: as :func:`estimate_runs` (``--skip-predicted-oom`` without a budget).
    """
    from hfscale.environment import gpu_info

    trials = _resolve(recipe, settings)
    gpus = gpu_info(python=python)
    runs = plan_runs(
        trials, gpu_count=int(gpus.get("gpu_count") or 0), num_machines=settings.num_machines or 1, only=settings.only
    )
    budget = memory_budget(settings, gpus)
    runs = estimate_runs(runs, budget_bytes=budget, skip_predicted_oom=settings.skip_predicted_oom)
    lines = [f"recipe {recipe.name}: {len(trials)} trials, {len(runs)} runs (baseline {recipe.baseline})"]
    if budget is not None:
        lines.append(f"memory budget {budget / GIB:.2f} GiB per device")
    if settings.find_max_batch:
        lines.append(
            f"after each trial: search the largest batch that fits (up to {settings.max_batch_limit}, warm-up + "
            f"{settings.probe_steps} steps per probe, starting from "
            + ("the estimate's largest that fits the budget)" if budget is not None else "the trial's batch size)")
        )
    with tempfile.TemporaryDirectory(prefix="hfscale-dry-run-") as tmp:
        run_dir = Path(tmp).resolve()
        for run in runs:
            if run.repeat > 0:
                continue
            strategy = run.trial.spec.strategy
            lines.append(
                f"- {run.name}: {strategy.describe()}" + (" [baseline]" if run.name == recipe.baseline else "")
            )
            lines.append(f"    {_estimate_line(run)}")
            if run.skip_reason:
                lines.append(f"    skipped: {run.skip_reason}")
            configs_dir, files_dir = _run_files(run_dir, run)
            cmd = trial_command(run.trial, configs_dir, files_dir, launch=launch, port=29500, python=python)
            shown = " ".join(part.replace(str(run_dir), "RUN") for part in cmd)
            lines.append(f"    {shown}")
    return lines


def _estimate_line(run: PlannedRun) -> str:
    if run.estimate is None:
        return f"predicted peak: not estimated ({run.estimate_error})"
    e = run.estimate
    parts = ", ".join(
        f"{name} {float(e[f'{name}_gib']):.3f}"
        for name in ("weights", "gradients", "optimizer", "activations", "overhead")
        if isinstance(e.get(f"{name}_gib"), int | float)
    )
    return f"predicted peak {float(e['total_gib']):.3f} GiB per device ({parts})"


# -- command line -------------------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfscale sweep",
        description="Train a recipe's trials, each in a fresh process group, and record one result row per trial.",
        epilog="Also: python -m hfscale.sweep RECIPE, or accelerate launch [--num_processes N] -m hfscale.sweep RECIPE "
        "(trials that do not pin num_processes then use the launch's count).",
    )
    parser.add_argument("recipe", nargs="?", type=Path, help="recipe YAML (optional with --resume)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out-dir", type=Path, default=Path(DEFAULT_OUT_DIR), help="parent of the new run folder")
    where.add_argument("--run-dir", type=Path, help="the new run folder itself (must not exist)")
    where.add_argument("--resume", type=Path, metavar="RUN_DIR", help="run what is missing in this run folder")
    parser.add_argument("--dry-run", action="store_true", help="print the trials and their launch commands only")
    parser.add_argument("--num-processes", type=int, help="processes for trials that do not pin num_processes")
    parser.add_argument("--num-machines", type=int, help="machines for trials that do not pin num_machines")
    parser.add_argument("--memory-limit-gib", type=float, help="address-space limit of every trial process (GiB)")
    parser.add_argument("--timeout-s", type=float, help="wall-clock limit of every trial (overrides the recipe)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this trial (repeatable)")
    memory = parser.add_argument_group("memory estimate and batch search")
    memory.add_argument(
        "--memory-budget",
        type=_size_arg,
        metavar="SIZE",
        help="memory per device, e.g. 80GiB, 24GB, 512MiB: what --skip-predicted-oom checks the estimate against, "
        "where --find-max-batch starts, and what the report's recommendation must fit (default: the GPU's memory "
        "as environment.json records it; none on CPU)",
    )
    memory.add_argument(
        "--skip-predicted-oom",
        action="store_true",
        help="do not launch a trial whose estimated peak (hfscale estimate, plus the CUDA context on a GPU) exceeds "
        "the budget; its row is 'skipped' with the predicted figure",
    )
    memory.add_argument(
        "--find-max-batch",
        action="store_true",
        help="after each trial, find the largest per-device batch that fits by short probe runs (each its own "
        "process group; logs in RUN/trials/NAME/probes/), starting from the estimate; out of memory is expected",
    )
    memory.add_argument(
        "--max-batch-limit",
        type=int,
        default=SweepSettings.max_batch_limit,
        metavar="N",
        help=f"largest per-device batch --find-max-batch tries (default {SweepSettings.max_batch_limit})",
    )
    memory.add_argument(
        "--probe-steps",
        type=int,
        default=SweepSettings.probe_steps,
        metavar="N",
        help=f"optimizer steps per probe after the trial's warm-up steps (default {SweepSettings.probe_steps})",
    )
    parser.add_argument("--no-report", action="store_true", help="do not write report.md/report.html at the end")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def _size_arg(text: str) -> int:
    from hfscale.report import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _print(line: str) -> None:
    print(f"{datetime.now().strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: Any) -> None:
    """First Ctrl-C/SIGTERM/SIGHUP: stop the sweep. Later ones are ignored, so that ending the running trial's
    group (bounded: a few seconds' grace, then SIGKILL) is never cut short; a launcher forwards the same signal
    to this process a second time."""
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launch = LaunchInfo.from_env()
    if not launch.is_driver:
        # The driver on local rank 0 of this machine runs every trial; a second driver would run them twice.
        logger.info(
            "rank %d (local rank %d): the driver on local rank 0 runs the sweep; exiting",
            launch.rank,
            launch.local_rank,
        )
        return 0
    for number, value, least in (
        ("--num-processes", args.num_processes, 1),
        ("--num-machines", args.num_machines, 1),
        ("--max-batch-limit", args.max_batch_limit, 1),
        ("--probe-steps", args.probe_steps, 2),  # the steady-state throughput needs two timed steps
    ):
        if value is not None and value < least:
            print(f"hfscale sweep: error: {number} must be at least {least}, got {value}", file=sys.stderr)
            return 2
    settings = launch_settings(
        launch,
        num_processes=args.num_processes,
        num_machines=args.num_machines,
        memory_limit_gib=args.memory_limit_gib,
        timeout_s=args.timeout_s,
        only=args.only,
        memory_budget_bytes=args.memory_budget,
        skip_predicted_oom=args.skip_predicted_oom,
        find_max_batch=args.find_max_batch,
        max_batch_limit=args.max_batch_limit,
        probe_steps=args.probe_steps,
    )
    try:
        if args.dry_run:
            recipe_path = args.recipe or (args.resume / RECIPE_FILE if args.resume else None)
            if recipe_path is None:
                print("hfscale sweep: error: give a RECIPE", file=sys.stderr)
                return 2
            for line in dry_run_lines(load_recipe(recipe_path), settings, launch):
                print(line)
            return 0
        # Ctrl-C, a scheduler's SIGTERM and a closed terminal all end the running trial's group, then the sweep;
        # a signal the caller chose to ignore (nohup) stays ignored.
        previous = {s: signal.signal(s, _interrupt) for s in _STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
        outcome = run_sweep(
            args.recipe,
            out_dir=args.out_dir,
            run_dir=args.run_dir,
            resume=args.resume,
            settings=settings,
            launch=launch,
            report=not args.no_report,
            progress=_print,
        )
        # Not restored on an interrupt: the stop signals stay ignored until this process exits (see _interrupt).
        for s, handler in previous.items():
            signal.signal(s, handler)
    except (RecipeError, SweepError, OSError) as exc:
        print(f"hfscale sweep: error: {exc}", file=sys.stderr)
        return 2
    except SweepInterrupted as exc:
        _print(
            "interrupted: finished trials are kept, the running one was stopped and left no row; "
            f"continue with: hfscale sweep --resume {exc.run_dir}"
        )
        return INTERRUPTED_EXIT
    except KeyboardInterrupt:
        _print("interrupted before any trial started")
        return INTERRUPTED_EXIT
    failed = [r for r in outcome.rows if r.status != "ok"]
    _print(f"done: {outcome.run_dir} ({len(outcome.rows) - len(failed)} ok, {len(failed)} not ok)")
    if outcome.report_error is not None:
        _print(
            f"the results are kept but no report was written ({outcome.report_error}); "
            f"run: hfscale report {outcome.run_dir}"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
