"""Launching one trial's process group: its configs, its environment, its devices, and what came back.

The sweep's driver never joins a process group itself: for each trial it writes the trial's configs
(:func:`hfscale.configs.write_configs`) and starts ``accelerate launch ... -m hfscale.trial`` as a new session
(:func:`hfscale.launch.process.run_process_group`) with a free port and a clean environment (no ``RANK``,
``MASTER_PORT``, ``ACCELERATE_*``, ... of an outer launch), so that nothing of one trial (memory, accelerate state,
a hung collective) reaches the next. The trial's ``result.json`` is read back as a
:class:`~hfscale.records.row.TrialOutcome` (:class:`Launched`), which :mod:`hfscale.launch.rows` turns into the row:
unchanged as its ``measured``, or, when the group wrote none, classified from its exit and stderr
(:func:`hfscale.launch.failures.classify`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hfscale.configs.accelerate import visible_devices
from hfscale.core.files import utc_now
from hfscale.core.units import GIB
from hfscale.launch.activity import ActivitySampler
from hfscale.launch.device_lock import DeviceHold, hold_devices, trial_devices
from hfscale.launch.failures import Classification, classify, oom_killed_count
from hfscale.launch.plan import PlannedRun, SweepSettings
from hfscale.launch.process import (
    GroupHooks,
    GroupLimits,
    ProcessOutcome,
    clean_environment,
    free_port,
    run_process_group,
    tail,
)
from hfscale.recipes.schema import RecipeTrial
from hfscale.records.activity import MachineActivity
from hfscale.records.batch import ProbeOutcome
from hfscale.records.row import TrialOutcome
from hfscale.results.run_folder import (
    LAUNCHER_LOGS_DIR,
    PID_FILE,
    RESULT_FILE,
    SPEC_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    TRIAL_TMP_DIR,
    RunFolderWriteError,
)

logger = logging.getLogger(__name__)


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
    channel_bind: str | None = None
    """Machine 0's address for the drivers' channel (``--channel-bind``; None: the one routing to
    ``master_addr``). This machine's, like ``master_addr``: not recorded with the settings a resume reuses."""

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

    def default_counts(self, settings: SweepSettings) -> SweepSettings:
        """``settings`` with the outer launch's process and machine counts where the command line gave none."""
        import dataclasses

        if not self.launched:
            return settings
        return dataclasses.replace(
            settings,
            num_processes=settings.num_processes if settings.num_processes is not None else self.world_size,
            num_machines=settings.num_machines if settings.num_machines is not None else self.num_machines,
        )


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


def direct_command(command: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """What ``accelerate launch`` would start for ``command`` when it starts one plain process (its simple
    launcher): the same argv and the same environment, computed by accelerate's own functions here, so that the
    trial runs without accelerate's extra interpreter (about 2.8 s on 2 CPU cores, which imports torch only to
    start the one process). None when accelerate would start a launcher of its own (torchrun or DeepSpeed's, for
    several processes, or for DeepSpeed and FSDP on a GPU): then ``command`` itself runs.

    ``command`` is what :func:`hfscale.configs.launch_command` returns; ``env`` the trial's clean environment,
    which accelerate reads in place of this process's own (an outer launch's variables must not leak in). Any
    surprise from accelerate's internals (they are not public API) also gives None.
    """
    python, flag, module, *arguments = command
    if (flag, module) != ("-m", "accelerate.commands.launch") or python != sys.executable:
        return None  # another interpreter's accelerate decides for itself
    try:
        from unittest import mock

        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_simple_launcher_cmd_env

        quiet = logging.getLogger("accelerate.commands.launch")  # its "defaults used" note is for the trial's log
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        with mock.patch.dict(os.environ, dict(env), clear=True):
            try:
                args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(arguments))
            finally:
                quiet.setLevel(level)
            own_launcher = args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.multi_gpu or args.tpu
            if (own_launcher and not args.cpu) or getattr(defaults, "compute_environment", None) == "AMAZON_SAGEMAKER":
                return None
            argv, direct_env = prepare_simple_launcher_cmd_env(args)
    except Exception as exc:  # accelerate's internals moved: run its launcher as a user would
        logger.debug("launching through accelerate launch (no direct command: %s)", exc)
        return None
    if argv[0] != sys.executable:  # a launcher in front of python (mpirun): not one plain process
        return None
    return [python, *argv[1:]], dict(direct_env)


def trial_port(run: PlannedRun, launch: LaunchInfo) -> int:
    """A free port on one machine; on several, every machine's driver must agree without talking: the outer
    launch's port + 1 + the run's index (the outer rendezvous keeps its own port)."""
    if run.trial.spec.strategy.num_machines > 1:
        base = launch.master_port or 29500
        return 1024 + (base + 1 + run.index - 1024) % (65535 - 1024)
    return free_port()


@dataclass(frozen=True, kw_only=True)
class Launched:
    """How one launch of a trial's process group went, before it becomes a row or a probe outcome."""

    command: list[str]
    port: int
    outcome: ProcessOutcome
    measured: TrialOutcome | None
    """What the trial wrote to ``result.json``; None when it wrote nothing readable."""
    stderr_text: str
    """The end of its stderr (256 KiB at most), searched for the error."""
    memory_limit_gib: float | None
    timeout_s: float
    oom_kills_before: int | None
    started_at: str
    finished_at: str
    activity: MachineActivity | None = None
    """What else the machine did while the group ran (sampled from outside it)."""
    device_hold: DeviceHold | None = None
    """How the group got its devices' locks (:mod:`hfscale.launch.device_lock`)."""

    @property
    def memory_limit_bytes(self) -> int | None:
        return int(self.memory_limit_gib * GIB) if self.memory_limit_gib else None

    @property
    def exited_cleanly(self) -> bool:
        return self.outcome.returncode == 0 and not self.outcome.timed_out

    def failure(self) -> Classification:
        """Why the group failed (or, with a result, failed to exit cleanly)."""
        return classify(
            self.outcome,
            self.stderr_text,
            timeout_s=self.timeout_s,
            memory_limit_bytes=self.memory_limit_bytes,
            oom_kills_before=self.oom_kills_before,
        )

    def as_probe(self) -> ProbeOutcome:
        """A batch-search probe's launch as the search reads it: out of memory is an outcome, anything else that
        did not train (or trained something other than the strategy) an error. The samples/s are the steady-state
        figure (warm-up steps left out), as in the report's tables."""
        measured = self.measured
        if measured is not None:
            if measured.status == "ok":
                return ProbeOutcome(
                    status="fits",
                    samples_per_s=measured.throughput.samples_per_s if measured.throughput else None,
                    peak_memory_gib=measured.memory.peak_gib if measured.memory else None,
                )
            return ProbeOutcome(status="error", reason=f"trained, but {measured.reason or measured.status}")
        if self.exited_cleanly:
            return ProbeOutcome(status="error", reason=f"exited 0 without writing {RESULT_FILE}")
        failure = self.failure()
        return ProbeOutcome(
            status="oom" if failure.status == "oom" else "error", reason=f"{failure.status}: {failure.reason}"
        )


def read_measured(path: Path) -> TrialOutcome | None:
    """The trial's outcome, or None when it wrote none (or nothing readable: the trial writes it atomically, so an
    unreadable file means something else wrote it)."""
    from hfscale.trial.train import read_outcome

    try:
        return read_outcome(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("%s is unreadable (%s); the trial counts as having written no result", path, exc)
        return None


# AF_UNIX socket paths are limited to 107 bytes, and what a library makes under TMPDIR needs ~32 of them
# (multiprocessing's pymp-XXXXXXXX/listener-XXXXXXXX): a longer trial folder gets a short one in the system's.
_MAX_TMP_PATH = 72


@contextlib.contextmanager
def trial_temp_dir(files_dir: Path) -> Iterator[Path]:
    """A temporary folder for one trial's group (its ``TMPDIR``), so that nothing it makes is left in the
    system's: ``FILES/tmp``, removed when the group has ended. What the launcher left there with content
    (torchrun's per-rank ``torchelastic_*`` folders) is kept in ``FILES/launcher-logs``; the empty ones go.
    Where ``FILES/tmp`` would be too long a path for a socket, a ``hfscale-*`` folder in the system's temporary
    folder is used, and removed the same way."""
    tmp = (files_dir / TRIAL_TMP_DIR).resolve()
    shutil.rmtree(tmp, ignore_errors=True)  # left by a sweep killed before it could remove it
    if len(str(tmp)) > _MAX_TMP_PATH:
        tmp = Path(tempfile.mkdtemp(prefix="hfscale-"))
    else:
        tmp.mkdir(parents=True)
    try:
        yield tmp
    finally:
        for logs in sorted(tmp.glob("torchelastic_*")):
            if any(f.is_file() for f in logs.rglob("*")):
                with contextlib.suppress(OSError):
                    (files_dir / LAUNCHER_LOGS_DIR).mkdir(exist_ok=True)
                    shutil.move(logs, files_dir / LAUNCHER_LOGS_DIR / logs.name)
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True, kw_only=True)
class GroupRequest:
    """What launching one trial's process group needs (:func:`launch_group`): the trial, where its configs and files
    go, and where it sits among machines. A sweep's run (:func:`hfscale.launch.rows.launch_trial`), a batch-search
    probe, another machine's part of a run and the machines of one host each build one."""

    trial: RecipeTrial
    configs_dir: Path
    """Where the trial's configs and spec are written."""
    files_dir: Path
    """Where its stdout, stderr, pid file and ``result.json`` go."""
    port: int
    """The trial's rendezvous port (:func:`trial_port`)."""
    launch: LaunchInfo
    """This driver's place among machines (its machine rank and machine 0's address)."""
    settings: SweepSettings
    """The limits the command line sets over the recipe's."""
    python: str = sys.executable
    """The interpreter that runs ``accelerate launch``."""
    run_dir: Path | None = None
    """The run folder the device locks name as their holder (default ``files_dir``)."""
    lock_devices: bool = True
    """False leaves the device locks to the caller (several machines' groups of one trial on one host, which must
    run at once: :func:`hfscale.launch.machines.launch_machines_here`)."""

    @property
    def memory_limit_gib(self) -> float | None:
        """``--memory-limit-gib`` over the recipe's ``run.memory_limit_gib``."""
        given = self.settings.memory_limit_gib
        return given if given is not None else self.trial.run.memory_limit_gib

    @property
    def timeout_s(self) -> float:
        """``--timeout-s`` over the recipe's ``measure.timeout_s``."""
        given = self.settings.timeout_s
        return given if given is not None else self.trial.spec.measure.timeout_s

    def limits(self) -> GroupLimits:
        gib = self.memory_limit_gib
        return GroupLimits(timeout_s=self.timeout_s, memory_limit_bytes=int(gib * GIB) if gib else None)


def launch_group(
    request: GroupRequest,
    *,
    progress: Callable[[str], None] = logger.info,
    on_tick: Callable[[float], None] | None = None,
) -> Launched:
    """Write the trial's configs, run its process group (limits from the settings over the recipe's) and read what
    it left: the result file and the end of stderr. The group holds its devices' locks while it runs (another
    sweep's trial on them is waited for: ``progress`` names it) unless ``request.lock_devices`` is False, and has
    its own ``TMPDIR`` (:func:`trial_temp_dir`). ``on_tick`` gets the elapsed seconds every 30 s.

    Raises:
        KeyboardInterrupt: when interrupted; the group has been ended.
        RunFolderWriteError: when the configs cannot be written (disk full, read-only); the message names the path.
        DeviceBusyError: when another sweep held a device for longer than the sweep waits.
        OSError: when the launcher cannot be started.
    """
    cmd, env = _command(request)
    oom_before = oom_killed_count()
    files_dir = request.files_dir
    with contextlib.ExitStack() as held:  # the devices' locks and the TMPDIR, until the group has ended
        device_hold = _hold(held, request, env, progress)
        started_at = utc_now()
        sampler = ActivitySampler()
        try:
            outcome = run_process_group(
                cmd,
                env=env,
                stdout_path=files_dir / STDOUT_FILE,
                stderr_path=files_dir / STDERR_FILE,
                pid_file=files_dir / PID_FILE,
                limits=request.limits(),
                hooks=GroupHooks(on_start=sampler.start, on_tick=on_tick),
            )
        finally:
            activity = sampler.stop()
            finished_at = utc_now()
            held.close()  # the locks go as soon as the group has ended, before the result is read
    return Launched(
        command=cmd,
        port=request.port,
        outcome=outcome,
        measured=read_measured(files_dir / RESULT_FILE),
        # Search well back for the error (torchrun's failure table comes after the workers' tracebacks).
        stderr_text=tail(files_dir / STDERR_FILE, max_lines=2000, max_bytes=256 * 1024),
        memory_limit_gib=request.memory_limit_gib,
        timeout_s=request.timeout_s,
        oom_kills_before=oom_before,
        started_at=started_at,
        finished_at=finished_at,
        activity=activity,
        device_hold=device_hold,
    )


def _command(request: GroupRequest) -> tuple[list[str], dict[str, str]]:
    """Write the trial's configs (and clear a result an interrupted attempt left); the command that starts its group
    and that command's clean environment (:func:`direct_command`'s where accelerate would start one process).

    Raises:
        RunFolderWriteError: when the configs cannot be written.
    """
    try:
        request.files_dir.mkdir(parents=True, exist_ok=True)
        (request.files_dir / RESULT_FILE).unlink(missing_ok=True)  # left by an interrupted earlier attempt
        cmd = trial_command(
            request.trial,
            request.configs_dir,
            request.files_dir,
            launch=request.launch,
            port=request.port,
            python=request.python,
        )
    except OSError as exc:
        raise RunFolderWriteError(Path(exc.filename) if exc.filename else request.configs_dir, exc) from exc
    env = clean_environment(extra={"PYTHONUNBUFFERED": "1", **request.trial.run.env})
    direct = direct_command(cmd, env)
    return direct if direct is not None else (cmd, env)


def _hold(
    held: contextlib.ExitStack, request: GroupRequest, env: dict[str, str], progress: Callable[[str], None]
) -> DeviceHold | None:
    """Point the group's ``env`` at its devices and its own ``TMPDIR``, entered on ``held`` with the devices' locks
    (unless the caller holds them), so that all of it is released when ``held`` closes, whatever fails on the way.

    Raises:
        DeviceBusyError: as :func:`hold_devices`.
        RunFolderWriteError: when the ``TMPDIR`` cannot be made.
    """
    strategy = request.trial.spec.strategy
    devices = trial_devices(strategy.device, strategy.num_processes // strategy.num_machines, {**os.environ, **env})
    env.update(visible_devices(strategy, devices))  # data_parallel "dp": its one process sees exactly these GPUs
    device_hold = None
    if request.lock_devices:
        hold = hold_devices(
            devices, run_dir=request.run_dir or request.files_dir, trial=request.trial.name, progress=progress
        )
        device_hold = held.enter_context(hold)
    try:
        env["TMPDIR"] = str(held.enter_context(trial_temp_dir(request.files_dir)))
    except OSError as exc:
        raise RunFolderWriteError(Path(exc.filename) if exc.filename else request.files_dir, exc) from exc
    return device_hold


__all__ = [
    "GroupRequest",
    "LaunchInfo",
    "Launched",
    "direct_command",
    "launch_group",
    "read_measured",
    "trial_command",
    "trial_port",
    "trial_temp_dir",
]
