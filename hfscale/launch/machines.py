"""One trial started as several machines on this host: a process group per machine rank, all at once, joined
through one rendezvous on 127.0.0.1.

This is how hfscale tests what a multi-machine trial does (rendezvous, ranks, what each machine holds) on one
host, and how a user can rehearse a multi-machine strategy before taking it to a cluster. The sweep on real
machines starts each machine's group from that machine's own driver (:mod:`hfscale.sweep.machines`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hfscale.launch.device_lock import hold_devices, trial_devices
from hfscale.launch.failures import Classification
from hfscale.launch.group import Launched, LaunchInfo, launch_group
from hfscale.launch.plan import SweepSettings
from hfscale.launch.process import free_port
from hfscale.recipes.recipe import RecipeTrial
from hfscale.results.run_folder import PID_FILE

logger = logging.getLogger(__name__)

# -- several machines on this host ---------------------------------------------------------------------------

MACHINE_DIR = "machine-{rank}"
"""Sub-folder of the configs and files folders that holds one machine's part of a trial run on this host."""


@dataclass(frozen=True, kw_only=True)
class MachineLaunch:
    """How one machine's process group of a trial went (:func:`launch_machines_here`)."""

    machine_rank: int
    launched: Launched | None
    """Its group's launch: command, exit, wall time, stderr; ``measured`` is set on machine 0 only (the main
    process writes the result). None when it was never started (another machine failed first)."""
    files_dir: Path
    """Where its stdout, stderr (and, on machine 0, ``result.json``) are."""
    ended_after: int | None = None
    """The machine whose group failed first, when this group was ended because of it (after the grace); None when
    it ended by itself."""

    @property
    def ok(self) -> bool:
        """Whether its group exited 0 within its time limit."""
        return self.launched is not None and self.launched.exited_cleanly


def launch_machines_here(
    trial: RecipeTrial,
    configs_dir: Path,
    files_dir: Path,
    *,
    settings: SweepSettings,
    port: int | None = None,
    python: str = sys.executable,
    peer_grace_s: float = 20.0,
    start_delay_s: Mapping[int, float] | None = None,
    progress: Callable[[str], None] = logger.info,
) -> list[MachineLaunch]:
    """Run ``trial`` as ``strategy.num_machines`` machines on this host: one process group per machine rank, all
    at once (they rendezvous on 127.0.0.1 at ``port``), each as a sweep's driver on that machine would launch it
    (:func:`launch_group`, its own configs with its ``machine_rank``). The stand-in for several machines that
    exercises the rendezvous, node ranks and world size (what a trial verifies:
    :mod:`hfscale.techniques.multi_machine`).

    Machine ``m`` writes its configs to ``configs_dir/machine-m`` and its files to ``files_dir/machine-m``. The
    device locks are taken once for all groups (one host's devices). When a group fails, the others get
    ``peer_grace_s`` seconds to fail by themselves (a lost peer usually breaks their collectives), then are ended,
    so that a dead machine never leaves the rest waiting until their time limit.

    Args:
        start_delay_s: seconds to wait before starting a machine's group (machine rank -> delay): a machine that
            starts late.

    Returns:
        One :class:`MachineLaunch` per machine, in machine-rank order.

    Raises:
        ValueError: when the strategy is for one machine.
        KeyboardInterrupt: when interrupted; every group has been ended.
        RunFolderWriteError, DeviceBusyError, OSError: as :func:`launch_group`, after every group has ended.
    """

    from hfscale.launch.process import end_orphaned_group

    strategy = trial.spec.strategy
    machines = strategy.num_machines
    if machines < 2:
        raise ValueError(f"launch_machines_here: strategy.num_machines={machines}; it runs 2 or more machines")
    port = free_port() if port is None else port
    delays = dict(start_delay_s or {})
    results: dict[int, Launched | BaseException | None] = {}
    stop = threading.Event()

    def run(rank: int) -> None:
        try:
            if stop.wait(delays.get(rank, 0.0)):
                results[rank] = None  # another machine failed during the delay
                return
            info = LaunchInfo(
                launched=True, machine_rank=rank, num_machines=machines, master_addr="127.0.0.1", master_port=port
            )
            results[rank] = launch_group(
                trial,
                configs_dir / MACHINE_DIR.format(rank=rank),
                files_dir / MACHINE_DIR.format(rank=rank),
                port=port,
                launch=info,
                settings=settings,
                python=python,
                progress=lambda line, rank=rank: progress(f"machine {rank}: {line}"),
                lock_devices=False,
            )
        except BaseException as exc:  # handed to the caller's thread
            results[rank] = exc

    pid_files = [files_dir / MACHINE_DIR.format(rank=m) / PID_FILE for m in range(machines)]
    ended_after: dict[int, int] = {}
    with hold_devices(
        trial_devices(strategy.device, strategy.num_processes // machines, os.environ),
        run_dir=files_dir,
        trial=trial.name,
        progress=progress,
    ):
        threads = [threading.Thread(target=run, args=(m,), name=f"hfscale-machine-{m}") for m in range(machines)]
        for thread in threads:
            thread.start()
        failed_at: tuple[int, float] | None = None
        try:
            while any(t.is_alive() for t in threads):
                for m, thread in enumerate(threads):
                    done = results.get(m)
                    if failed_at is None and not thread.is_alive() and m in results and not _clean(done):
                        failed_at = (m, time.monotonic())
                        stop.set()
                        progress(f"machine {m} failed; ending the other machines in {peer_grace_s:.0f} s")
                if failed_at is not None and time.monotonic() - failed_at[1] >= peer_grace_s:
                    for m, thread in enumerate(threads):
                        if thread.is_alive() and end_orphaned_group(pid_files[m]) is not None:
                            ended_after.setdefault(m, failed_at[0])
                time.sleep(0.2)
        except BaseException:
            stop.set()
            while any(t.is_alive() for t in threads):
                for m in range(machines):
                    end_orphaned_group(pid_files[m])
                time.sleep(0.2)
            raise
        for thread in threads:
            thread.join()
    errors = [r for r in results.values() if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return [
        MachineLaunch(
            machine_rank=m,
            launched=results.get(m),  # type: ignore[arg-type]
            files_dir=files_dir / MACHINE_DIR.format(rank=m),
            ended_after=ended_after.get(m),
        )
        for m in range(machines)
    ]


def machines_failure(machines: Sequence[MachineLaunch]) -> tuple[int, Classification] | None:
    """Why a trial run as several machines (:func:`launch_machines_here`) failed, for one row: the machine that
    failed first (the one the others were ended after, else the lowest failed rank) and its group's
    classification, the others' fate added to the reason. None when every machine exited cleanly."""
    failed = [m for m in machines if not m.ok]
    if not failed:
        return None
    named = [m for m in failed if any(o.ended_after == m.machine_rank for o in failed)]
    by_itself = [m for m in failed if m.ended_after is None and m.launched is not None]
    first = (named or by_itself or failed)[0]
    if first.launched is None:
        status, reason = "crashed", "it was never started"
    else:
        cls = first.launched.failure()
        status, reason = cls.status, cls.reason
    others = []
    for m in machines:
        if m is first:
            continue
        if m.ended_after is not None:
            others.append(f"machine {m.machine_rank} was ended after it")
        elif m.launched is None:
            others.append(f"machine {m.machine_rank} was not started")
        elif not m.ok:
            others.append(f"machine {m.machine_rank} failed too ({m.launched.failure().reason})")
    detail = f"machine {first.machine_rank}: {reason}" + (f"; {', '.join(others)}" if others else "")
    return first.machine_rank, Classification(status=status, reason=detail)


def _clean(result: Launched | BaseException | None) -> bool:
    return result is None or (isinstance(result, Launched) and result.exited_cleanly)


__all__ = ["MACHINE_DIR", "MachineLaunch", "launch_machines_here", "machines_failure"]
