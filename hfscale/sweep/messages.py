"""The messages between the drivers of a sweep on several machines: typed, each written and read back here.

Machine 0 publishes a :class:`SweepPlan` once (key ``plan``) and, before each run on several machines, a
:class:`StartDecision` (``start/i``); machine ``k`` says it is ready (``ready/i/k``) and, after its part, sends a
:class:`MachineReport` (``report/i/k``). The channel (:mod:`hfscale.sweep.channel`) carries their JSON; who waits
for what is :mod:`hfscale.sweep.machines`' (machine 0) and :mod:`hfscale.sweep.follow`'s (machine ``k``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hfscale.launch.plan import PlannedRun, SweepSettings
from hfscale.recipes.schema import RecipeTrial, RunSpec
from hfscale.workload.spec import TrialSpec

PLAN_KEY = "plan"
"""The channel's key of machine 0's :class:`SweepPlan`."""


def start_key(index: int) -> str:
    """Machine 0's :class:`StartDecision` for run ``index``."""
    return f"start/{index}"


def ready_key(index: int, machine: int) -> str:
    """Machine ``machine`` is ready for run ``index`` (the value is ``true``)."""
    return f"ready/{index}/{machine}"


def report_key(index: int, machine: int) -> str:
    """Machine ``machine``'s :class:`MachineReport` of run ``index``."""
    return f"report/{index}/{machine}"


class MessageError(ValueError):
    """A message another driver sent that this one cannot read (another hfscale version, or not a driver's)."""


_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True, kw_only=True)
class SweepPlan:
    """What machine 0 publishes once, and machine ``k`` follows: the runs on several machines still to do, in order,
    each with its trial, and the settings they run with. Machine ``k`` launches exactly these, on a resume too (it
    needs no copy of the run folder or the recipe)."""

    sweep_id: str
    """Also in ``RUN/machines/sweep-id``: a machine that reads it there shares machine 0's filesystem."""
    host: str
    """Machine 0's host name (two "machines" on one host keep separate device locks)."""
    run_dir: str
    """Machine 0's run folder, absolute."""
    recipe: str
    """The recipe's name: a file name (a machine that cannot see machine 0's run folder names its own after it)."""
    settings: SweepSettings
    runs: tuple[PlannedRun, ...]
    """The runs on several machines still to do, each with its trial's spec and run section."""

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep_id": self.sweep_id,
            "host": self.host,
            "run_dir": self.run_dir,
            "recipe": self.recipe,
            "settings": self.settings.to_dict(),
            "runs": [
                {
                    "index": run.index,
                    "repeat": run.repeat,
                    "spec": run.trial.spec.to_dict(),
                    "run": dataclasses.asdict(run.trial.run),
                }
                for run in self.runs
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> SweepPlan:
        """The plan machine 0 published.

        Raises:
            MessageError: when its recipe name is not a file name (it names a folder here), or it cannot be read.
        """
        recipe = data.get("recipe") if isinstance(data, Mapping) else None
        if not isinstance(recipe, str) or not _FILE_NAME.fullmatch(recipe):
            raise MessageError(f"machine 0's plan names recipe {recipe!r}, not a file name")
        sweep_id = data.get("sweep_id")
        if not isinstance(sweep_id, str) or not _FILE_NAME.fullmatch(sweep_id):  # a part of a folder's name here
            raise MessageError(f"machine 0's plan has sweep_id {sweep_id!r}, not a file name")
        try:
            field = "settings"
            settings = SweepSettings.from_dict(data["settings"])
            field = "runs"
            runs = []
            for i, entry in enumerate(data["runs"]):
                field = f"runs[{i}]"
                runs.append(_planned_run(entry))
            field = "run_dir"
            return cls(
                sweep_id=sweep_id,
                host=str(data.get("host") or ""),
                run_dir=str(data["run_dir"]),
                recipe=recipe,
                settings=settings,
                runs=tuple(runs),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MessageError(
                f"machine 0's plan cannot be read: {field}: {type(exc).__name__}: {exc}; run the same hfscale on "
                "every machine"
            ) from None


def _planned_run(entry: Mapping[str, Any]) -> PlannedRun:
    trial = RecipeTrial(spec=TrialSpec.from_dict(entry["spec"]), run=RunSpec(**entry["run"]))
    return PlannedRun(trial=trial, repeat=int(entry["repeat"]), index=int(entry["index"]))


@dataclass(frozen=True, kw_only=True)
class StartDecision:
    """Machine 0's word before a run on several machines: every machine launches its part, or none does."""

    action: Literal["launch", "skip"]
    reason: str | None = None
    """Why the run is skipped (a machine did not come, the run was skipped before launching)."""

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action} if self.reason is None else {"action": self.action, "reason": self.reason}

    @classmethod
    def from_json(cls, data: Any) -> StartDecision:
        """Anything but a decision to launch is one to skip."""
        if isinstance(data, Mapping) and data.get("action") == "launch":
            return cls(action="launch")
        reason = data.get("reason") if isinstance(data, Mapping) else None
        return cls(action="skip", reason=None if reason is None else str(reason))


@dataclass(frozen=True, kw_only=True)
class MachineReport:
    """How one machine's part of a trial ended, as that machine's driver saw it (sent to machine 0)."""

    machine: int
    status: str
    """``ok``, or ``oom``/``crashed``/``timeout`` (:func:`hfscale.launch.failures.classify` of its own group)."""
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
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MachineReport:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


__all__ = [
    "PLAN_KEY",
    "MachineReport",
    "MessageError",
    "StartDecision",
    "SweepPlan",
    "ready_key",
    "report_key",
    "start_key",
]
