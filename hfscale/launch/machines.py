"""One trial started as several machines on this host: a process group per machine rank, all at once, joined
through one rendezvous on 127.0.0.1.

This is how hfscale tests what a multi-machine trial does (rendezvous, ranks, what each machine holds) on one
host, and how a user can rehearse a multi-machine strategy before taking it to a cluster. The sweep on real
machines starts each machine's group from that machine's own driver (:mod:`hfscale.sweep.machines`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hfscale.launch.device_lock import hold_devices, trial_devices
from hfscale.launch.failures import Classification
from hfscale.launch.group import GroupRequest, Launched, LaunchInfo, launch_group
from hfscale.launch.plan import SweepSettings
from hfscale.launch.process import end_orphaned_group, free_port
from hfscale.recipes.schema import RecipeTrial
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


@dataclass(frozen=True, kw_only=True)
class PeerTiming:
    """How the machines of one host start and end together (:func:`launch_machines_here`)."""

    peer_grace_s: float = 20.0
    """When a group fails, the others get this many seconds to fail by themselves (a lost peer usually breaks their
    collectives) before they are ended, so that a dead machine never leaves the rest waiting until their limit."""
    start_delay_s: Mapping[int, float] = field(default_factory=dict)
    """Seconds to wait before starting a machine's group (machine rank -> delay): a machine that starts late."""


def launch_machines_here(
    trial: RecipeTrial,
    configs_dir: Path,
    files_dir: Path,
    *,
    settings: SweepSettings,
    port: int | None = None,
    python: str = sys.executable,
    timing: PeerTiming | None = None,
    progress: Callable[[str], None] = logger.info,
) -> list[MachineLaunch]:
    """Run ``trial`` as ``strategy.num_machines`` machines on this host: one process group per machine rank, all
    at once (they rendezvous on 127.0.0.1 at ``port``), each as a sweep's driver on that machine would launch it
    (:func:`launch_group`, its own configs with its ``machine_rank``). The stand-in for several machines that
    exercises the rendezvous, node ranks and world size (what a trial verifies:
    :mod:`hfscale.techniques.multi_machine`).

    Machine ``m`` writes its configs to ``configs_dir/machine-m`` and its files to ``files_dir/machine-m``. The
    device locks are taken once for all groups (one host's devices). When a group fails, the others are ended after
    ``timing.peer_grace_s``; ``timing.start_delay_s`` starts some machines late.

    Returns:
        One :class:`MachineLaunch` per machine, in machine-rank order.

    Raises:
        ValueError: when the strategy is for one machine.
        KeyboardInterrupt: when interrupted; every group has been ended.
        RunFolderWriteError, DeviceBusyError, OSError: as :func:`launch_group`, after every group has ended.
    """
    strategy = trial.spec.strategy
    machines = strategy.num_machines
    if machines < 2:
        raise ValueError(f"launch_machines_here: strategy.num_machines={machines}; it runs 2 or more machines")
    port = free_port() if port is None else port
    place = LaunchInfo(launched=True, machine_rank=0, num_machines=machines, master_addr="127.0.0.1", master_port=port)
    base = GroupRequest(
        trial=trial, configs_dir=configs_dir, files_dir=files_dir, port=port, launch=place, settings=settings,
        python=python, lock_devices=False,
    )  # fmt: skip
    groups = _HostMachines(base, timing or PeerTiming(), progress)
    devices = trial_devices(strategy.device, strategy.num_processes // machines, os.environ)
    with hold_devices(devices, run_dir=files_dir, trial=trial.name, progress=progress):
        groups.run()
    return groups.launches()


class _HostMachines:
    """The process groups of one trial's machines on this host: each launched from a thread of its own, all watched
    from the caller's."""

    def __init__(self, base: GroupRequest, timing: PeerTiming, progress: Callable[[str], None]) -> None:
        self.base = base
        self.timing = timing
        self.progress = progress
        self.count = base.trial.spec.strategy.num_machines
        self.results: dict[int, Launched | BaseException | None] = {}
        self.stop = threading.Event()
        self.ended_after: dict[int, int] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(m,), name=f"hfscale-machine-{m}") for m in range(self.count)
        ]

    def request(self, rank: int) -> GroupRequest:
        """Machine ``rank``'s launch: its own configs and files folders, its machine rank."""
        folder = MACHINE_DIR.format(rank=rank)
        return dataclasses.replace(
            self.base,
            configs_dir=self.base.configs_dir / folder,
            files_dir=self.base.files_dir / folder,
            launch=dataclasses.replace(self.base.launch, machine_rank=rank),
        )

    def _run(self, rank: int) -> None:
        try:
            if self.stop.wait(self.timing.start_delay_s.get(rank, 0.0)):
                self.results[rank] = None  # another machine failed during the delay
                return
            say = lambda line: self.progress(f"machine {rank}: {line}")  # noqa: E731
            self.results[rank] = launch_group(self.request(rank), progress=say)
        except BaseException as exc:  # handed to the caller's thread
            self.results[rank] = exc

    def _alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def run(self) -> None:
        """Start every machine's group and wait until all have ended: the others ended after the first failure's
        grace, every one of them on an interrupt."""
        for thread in self.threads:
            thread.start()
        try:
            self._watch()
        except BaseException:
            self.stop.set()
            while self._alive():
                for m in range(self.count):
                    end_orphaned_group(self.request(m).files_dir / PID_FILE)
                time.sleep(0.2)
            raise
        for thread in self.threads:
            thread.join()

    def _watch(self) -> None:
        failed_at: tuple[int, float] | None = None
        while self._alive():
            if failed_at is None and (failed := self._failed()) is not None:
                failed_at = (failed, time.monotonic())
                self.stop.set()
                self.progress(f"machine {failed} failed; ending the other machines in {self.timing.peer_grace_s:.0f} s")
            if failed_at is not None and time.monotonic() - failed_at[1] >= self.timing.peer_grace_s:
                for m, thread in enumerate(self.threads):
                    if thread.is_alive() and end_orphaned_group(self.request(m).files_dir / PID_FILE) is not None:
                        self.ended_after.setdefault(m, failed_at[0])
            time.sleep(0.2)

    def _failed(self) -> int | None:
        """The first machine whose group has ended other than cleanly, if any."""
        for m, thread in enumerate(self.threads):
            if not thread.is_alive() and m in self.results and not _clean(self.results[m]):
                return m
        return None

    def launches(self) -> list[MachineLaunch]:
        """How each machine's group went.

        Raises:
            BaseException: the first that a machine's launch raised.
        """
        errors = [r for r in self.results.values() if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return [
            MachineLaunch(
                machine_rank=m,
                launched=self.results.get(m),  # type: ignore[arg-type]
                files_dir=self.request(m).files_dir,
                ended_after=self.ended_after.get(m),
            )
            for m in range(self.count)
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


__all__ = ["MACHINE_DIR", "MachineLaunch", "PeerTiming", "launch_machines_here", "machines_failure"]
