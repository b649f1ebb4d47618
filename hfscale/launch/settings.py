"""What the command line adds to a recipe: :class:`SweepSettings`, each option declared once.

Each field's flag, help, bounds and how ``--resume`` treats it sit in its metadata; the parser of ``hfscale sweep``
is derived from it (:func:`hfscale.commands.sweep.build_parser`), and the bounds are checked in one place
(``__post_init__``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hfscale.core.units import noise_floor_spec

logger = logging.getLogger(__name__)


class SweepError(RuntimeError):
    """A sweep that cannot start: the run folder exists or is locked, the recipe and run folder disagree, ..."""


class SettingError(ValueError):
    """A setting out of its bounds; ``setting`` is the field's name (the command line names the flag instead)."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem


def _memory_size(text: str) -> int:
    """``--memory-budget``'s parser: argparse prints an ArgumentTypeError's own message (a ValueError's it hides)."""
    import argparse

    from hfscale.core.units import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _search_mode(text: str) -> str:
    """``--search``'s parser."""
    import argparse

    if text not in ("grid", "adaptive"):
        raise argparse.ArgumentTypeError(f"expected grid or adaptive, got {text!r}")
    return text


def _noise_floor(text: str) -> str:
    """``--noise-floor``'s parser: a run-to-run noise (0.15, 15%), kept as its fraction, or a run folder, kept as its
    absolute path (:func:`hfscale.sweep.adaptive.noise_floor_of` reads it)."""
    import argparse

    try:
        return noise_floor_spec(text, Path.cwd())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _duration(text: str) -> float:
    """``--max-time``'s parser: seconds, or a number with s, m or h (90, 90s, 20m, 1.5h)."""
    import argparse

    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(text[-1:].lower())
    number = text[:-1] if scale is not None else text
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or a number with s, m or h (20m), got {text!r}") from None
    return seconds


ResumeRule = Literal["keep", "override"]


UNLIMITED = frozenset({"timeout_s", "max_time_s"})
"""Settings for which ``inf`` means no limit (times); every other number must be finite."""


def _option(
    flag: str,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    least: float | None = None,
    positive: bool = False,
    group: str | None = None,
    resume: ResumeRule = "override",
) -> dict[str, Any]:
    """A field's metadata: its command-line flag and help, its bounds, and what ``--resume`` does with it
    (``keep``: it defines the trials, so a resumed run must use the recorded value; ``override``: a value given
    on the command line of the resumed run applies to the runs still to do, and is recorded in its entry)."""
    return {
        "flag": flag,
        "help": help,
        "parse": parse,
        "metavar": metavar,
        "least": least,
        "positive": positive,
        "group": group,
        "resume": resume,
    }


@dataclass(frozen=True, kw_only=True)
class SweepSettings:
    """What the command line adds to a recipe; recorded in environment.json so that ``--resume`` keeps it."""

    num_processes: int | None = field(
        default=None,
        metadata=_option(
            "--num-processes", "processes for trials that do not pin num_processes", least=1, resume="keep"
        ),
    )
    """Processes for trials that do not pin ``num_processes`` (None: the outer launch's, else the recipe's own)."""
    num_machines: int | None = field(
        default=None,
        metadata=_option("--num-machines", "machines for trials that do not pin num_machines", least=1, resume="keep"),
    )
    """Machines for trials that do not pin ``num_machines``."""
    memory_limit_gib: float | None = field(
        default=None,
        metadata=_option(
            "--memory-limit-gib", "address-space limit of every trial process (GiB), over the recipe's", positive=True
        ),
    )
    """Overrides every trial's ``run.memory_limit_gib``."""
    timeout_s: float | None = field(
        default=None,
        metadata=_option(
            "--timeout-s",
            "wall-clock limit of every trial in seconds, over the recipe's (with --resume: for the runs still to do)",
            positive=True,
        ),
    )
    """Overrides every trial's ``measure.timeout_s``."""
    repeats: int | None = field(
        default=None,
        metadata=_option(
            "--repeats",
            "runs of every trial, over the recipe's measure.repeats (with a target_precision: the fewest)",
            metavar="N",
            least=1,
        ),
    )
    """Overrides every trial's ``measure.repeats``."""
    only: tuple[str, ...] = field(
        default=(), metadata=_option("--only", "run only this trial (repeatable)", metavar="NAME")
    )
    """Run only these trials."""
    memory_budget_bytes: int | None = field(
        default=None,
        metadata=_option(
            "--memory-budget",
            "memory per device, e.g. 80GiB, 24GB, 512MiB: what --skip-predicted-oom checks the estimate against, "
            "where --find-max-batch starts, and what the report's recommendation must fit (default: the recipe's "
            "sweep.memory_budget_gib, else the GPU's memory as environment.json records it; none on CPU)",
            parse=_memory_size,
            metavar="SIZE",
            least=1,
            group="memory",
        ),
    )
    """Memory per device (``--memory-budget``) for ``skip_predicted_oom``, the batch search's first size and the
    report's recommendation; None: the GPU memory ``environment.json`` records, if any."""
    skip_predicted_oom: bool = field(
        default=False,
        metadata=_option(
            "--skip-predicted-oom",
            "do not launch a trial whose estimated peak (hfscale estimate, plus the CUDA context on a GPU) exceeds "
            "the budget; its row is 'skipped' with the predicted figure",
            group="memory",
        ),
    )
    """Do not launch a trial whose estimated peak does not fit the budget; its row is ``skipped`` with the figure."""
    find_max_batch: bool = field(
        default=False,
        metadata=_option(
            "--find-max-batch",
            "after each trial, find the largest per-device batch that fits by short probe runs (each its own "
            "process group; logs in RUN/trials/NAME/probes/), starting from the estimate; out of memory is expected",
            group="memory",
        ),
    )
    """After each trial, search the largest per-device batch that fits (:mod:`hfscale.sweep.batch`)."""
    max_batch_limit: int = field(
        default=1024,
        metadata=_option(
            "--max-batch-limit",
            "largest per-device batch --find-max-batch tries (default %(default)s)",
            metavar="N",
            least=1,
            group="memory",
        ),
    )
    """Largest per-device batch the search tries."""
    probe_steps: int = field(
        default=3,
        metadata=_option(
            "--probe-steps",
            "optimizer steps per probe after the trial's warm-up steps (default %(default)s; at least 2: the "
            "steady-state throughput needs two timed steps)",
            metavar="N",
            least=2,
            group="memory",
        ),
    )
    """Optimizer steps of each batch-search probe after the trial's warm-up steps (at least 2: the steady-state
    throughput needs two timed steps)."""
    price_per_hour: float | None = field(
        default=None,
        metadata=_option(
            "--price-per-hour",
            "price of one device for one hour, in your currency: the report adds the cost per million tokens",
            metavar="PRICE",
            positive=True,
        ),
    )
    """Price of one device-hour; the report's cost per million tokens (None: no cost column)."""
    search: str | None = field(
        default=None,
        metadata=_option(
            "--search",
            "grid: every trial runs measure.repeats times; adaptive: skip what the estimate says cannot fit, prune "
            "what is slower than the leader beyond the noise, and spend repeats on the contenders (default: the "
            "recipe's sweep.search, else grid)",
            parse=_search_mode,
            metavar="grid|adaptive",
            group="search",
            resume="keep",
        ),
    )
    """``grid`` or ``adaptive`` over the recipe's ``sweep.search``; None: the recipe's."""
    min_samples_per_s: float | None = field(
        default=None,
        metadata=_option(
            "--min-samples-per-s",
            "ask for the trial with the least memory at this throughput or more, instead of the fastest that fits",
            metavar="X",
            positive=True,
            group="search",
            resume="keep",
        ),
    )
    """The least-memory question's throughput floor (over the recipe's ``sweep.min_samples_per_s``)."""
    max_time_s: float | None = field(
        default=None,
        metadata=_option(
            "--max-time",
            "adaptive: start no run once the runs took this long in all (seconds, or 20m, 1.5h)",
            parse=_duration,
            metavar="T",
            positive=True,
            group="search",
        ),
    )
    """Adaptive: the time budget, sum of the runs' wall times (over the recipe's ``sweep.max_time_s``)."""
    max_runs: int | None = field(
        default=None,
        metadata=_option(
            "--max-runs",
            "adaptive: run at most this many",
            metavar="N",
            least=1,
            group="search",
        ),
    )
    """Adaptive: the run budget (over the recipe's ``sweep.max_runs``)."""
    noise_floor: str | None = field(
        default=None,
        metadata=_option(
            "--noise-floor",
            "adaptive: take no trial's mean speed as known better than one run of this noise: a figure (15%%, "
            "0.15) or the run folder of an earlier grid sweep on this machine, whose pooled run-to-run noise it "
            "uses (on a shared or virtual machine, whose speed drifts over minutes)",
            parse=_noise_floor,
            metavar="NOISE|RUN_DIR",
            group="search",
            resume="keep",
        ),
    )
    """Adaptive: the noise floor, a fraction or a run folder's absolute path (over the recipe's
    ``sweep.noise_floor``; :func:`hfscale.sweep.adaptive.noise_floor_of` reads it)."""
    machine_wait_s: float = field(
        default=600.0,
        metadata=_option(
            "--machine-wait-s",
            "on several machines: how long machine 0 waits for another machine's driver before each trial (a "
            "machine that does not come makes a timeout row naming it) and another machine waits for machine 0's "
            "plan, in seconds (default %(default)s)",
            metavar="S",
            positive=True,
        ),
    )
    """How long a driver waits for another machine's driver (:mod:`hfscale.sweep.machines`): machine 0 before each trial
    on several machines, machine k for machine 0's plan; a driver that spoke and then went silent is not waited
    for."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            least, positive = f.metadata.get("least"), f.metadata.get("positive")
            if math.isnan(value) or (math.isinf(value) and f.name not in UNLIMITED):  # both parse as floats
                raise SettingError(f.name, f"must be a finite number, got {value}")
            if least is not None and value < least:
                raise SettingError(f.name, f"must be at least {least:g}, got {value:g}")
            if positive and value <= 0:
                raise SettingError(f.name, f"must be more than 0, got {value:g}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "only": list(self.only)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepSettings:
        """Settings as ``environment.json`` records them; keys of another hfscale version are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["only"] = tuple(kwargs.get("only") or ())
        return cls(**kwargs)

    def given(self) -> dict[str, Any]:
        """The settings that differ from their defaults (what a command line gave)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != SweepSettings.__dataclass_fields__[f.name].default
            and not (f.name == "only" and not self.only)
        }

    def for_resume(self, given: SweepSettings) -> SweepSettings:
        """These (recorded) settings with what ``given`` changes for a resumed run.

        A setting marked ``keep`` (the process and machine counts: they define the trials) must match the recorded
        value; any other given setting (``--timeout-s``, ``--memory-limit-gib``, ``--only``, ...) applies to the
        runs still to do.

        Raises:
            SweepError: when a ``keep`` setting differs from the recorded one, naming its flag and both values.
        """
        changes: dict[str, Any] = {}
        for name, value in given.given().items():
            meta = SweepSettings.__dataclass_fields__[name].metadata
            recorded = getattr(self, name)
            if value == recorded:
                continue
            if meta.get("resume") == "keep":
                shown = "none (the recipe's own, as it started)" if recorded is None else recorded
                raise SweepError(
                    f"{meta['flag']} {value} differs from the recorded {shown}: a resumed run keeps the recorded "
                    f"{meta['flag']} so that its trials stay the same (omit it, or start a new run)"
                )
            logger.info("%s: %r replaces the recorded %r for the runs still to do", meta["flag"], value, recorded)
            changes[name] = value
        return dataclasses.replace(self, **changes)


__all__ = ["SettingError", "SweepError", "SweepSettings"]
