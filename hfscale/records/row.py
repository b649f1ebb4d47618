"""The result row: one typed record per trial run, from the process that measured it to the report that renders it.

A trial process writes a :class:`TrialOutcome` (what it measured); the sweep wraps it, unchanged, in a
:class:`TrialResult` together with what only the sweep knows (how the process group was launched and ended, the
estimate made before it ran, the loss-parity check, the batch search) and appends it to the run folder; the report
and ``hfscale.load_run`` read the same objects back. Nothing re-parses dicts: every member is a dataclass of its own
(:class:`~hfscale.records.measurements.MemorySummary`, :class:`~hfscale.records.measurements.ThroughputSummary`,
:class:`~hfscale.records.measurements.VerificationRecord`, :class:`~hfscale.estimate.MemoryEstimate`,
:class:`~hfscale.results.parity.ParityResult`, :class:`~hfscale.sweep.batch.BatchSearchRecord`), and one serializer
(:func:`row_to_json` / :func:`row_from_json`, pydantic's validation of these dataclasses) reads and writes them all.

Every stored row carries ``schema_version``. Rows of schema 1 (hfscale 0.1: the measurements flat on the row,
launch details and repeat numbers in a catch-all ``extra``) are migrated when read (:func:`migrate_row`), so the
committed run folders stay readable without rewriting them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from hfscale.records.activity import MachineActivity
from hfscale.records.batch import BatchSearchRecord
from hfscale.records.estimate import MemoryEstimate
from hfscale.records.measurements import MemorySummary, ThroughputSummary, VerificationRecord
from hfscale.records.parity import ParityResult
from hfscale.records.search import SearchDecision
from hfscale.strategy import Strategy

SCHEMA_VERSION = 2
"""Bumped when a field changes meaning or moves (adding an optional field does not); :func:`migrate_row` reads
every earlier version."""

TrialStatus = Literal["ok", "oom", "crashed", "timeout", "not_applied", "skipped", "pruned"]
"""ok: trained and verified; oom: ran out of device or host memory; crashed: any other non-zero exit or signal;
timeout: killed after the per-trial limit; not_applied: ran, but the strategy asked for is not what ran;
skipped: not run (missing optional dependency, predicted out of memory), with the reason; pruned: not run again
because an adaptive search found the trial slower than the leader (or than its throughput floor) beyond the noise:
no run, a marker whose ``search`` holds the evidence (the trial's runs are its ok rows)."""

TRIAL_STATUSES: tuple[str, ...] = get_args(TrialStatus)
"""Every :data:`TrialStatus`, in the order written there (read from the Literal, so they are listed once)."""
RAN_STATUSES = ("ok", "not_applied")
"""A run that trained to the end and wrote its result (whether or not its strategy took effect); a grid repeats
only these, and only these have measured figures."""

OutcomeStatus = Literal["ok", "not_applied"]


@dataclass(kw_only=True)
class TrialOutcome:
    """What one trial process group measured: the JSON ``python -m hfscale.trial`` writes to ``--result``.

    Failures to train are not written here (the process raises and the sweep classifies its exit): a trial that
    wrote an outcome trained to the end.
    """

    schema_version: int = SCHEMA_VERSION
    trial: str
    """The trial's name (:attr:`hfscale.workload.spec.TrialSpec.name`)."""
    status: OutcomeStatus
    """``ok``: trained, and the verification record matches the strategy; ``not_applied``: trained, but what ran
    is not what the strategy asked for (see ``reason``)."""
    reason: str | None = None
    """For ``not_applied``: the mismatches, joined into one sentence."""
    mismatches: list[str] = field(default_factory=list)
    """:func:`hfscale.measure.verify.check`'s list, one entry per way what ran differs from what was asked."""
    train_runtime_s: float | None = None
    """The Trainer's ``train_runtime`` (from the first step's set-up end to the last step; set-up excluded)."""
    train_samples_per_second: float | None = None
    """The Trainer's own figure (global samples over ``train_runtime``, warm-up steps included)."""
    loss_curve: list[float] = field(default_factory=list)
    """Training loss of each optimizer step, in step order (mean over ranks)."""
    memory: MemorySummary | None = None
    """The memory callback's summary (max over ranks and per rank)."""
    throughput: ThroughputSummary | None = None
    """The throughput callback's summary (steady state, after the warm-up steps)."""
    verification: VerificationRecord | None = None
    """What really ran, read from inside the run."""
    timings_s: dict[str, float] = field(default_factory=dict)
    """Main process, in seconds: ``startup`` (process creation to the runner's ``main``), ``imports``,
    ``model_build``, ``data_build``, ``training_args``, ``trainer_init``, ``train_setup`` (``train()`` call to the
    first step: wrapping, sharding, DeepSpeed initialisation), ``train_loop`` (first step to the end of training),
    ``train_call`` (the whole ``train()`` call), ``verify``, and ``total`` (process creation to the result)."""
    world_size: int = 1
    """Processes that trained."""
    training_args: dict[str, Any] = field(default_factory=dict)
    """The merged ``TrainingArguments`` keywords the Trainer got (``output_dir`` left out: a temporary folder)."""
    started_at: str | None = None
    """ISO 8601 UTC time the process started."""
    finished_at: str | None = None
    """ISO 8601 UTC time the result was written."""

    def __post_init__(self) -> None:
        if self.status not in RAN_STATUSES:
            raise ValueError(f"TrialOutcome.status: expected 'ok' or 'not_applied', got {self.status!r}")

    @property
    def final_loss(self) -> float | None:
        return self.loss_curve[-1] if self.loss_curve else None

    def to_json(self) -> dict[str, Any]:
        return _adapter(TrialOutcome).dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialOutcome:
        """Validate a JSON object into an outcome; keys written by a newer hfscale are ignored.

        Raises:
            ValueError: naming the field that does not validate.
        """
        return _validate(TrialOutcome, data)


@dataclass(frozen=True, kw_only=True)
class LaunchRecord:
    """How the sweep launched one trial's process group and how the group ended."""

    command: list[str] = field(default_factory=list)
    main_process_port: int | None = None
    memory_limit_gib: float | None = None
    """Address-space limit of every process of the group; None: unlimited."""
    timeout_s: float | None = None
    """Wall-clock limit of the whole group."""
    trial_dir: str | None = None
    """The folder of this run's logs and result, relative to the run folder."""
    after_result: str | None = None
    """Set when the group wrote its result and then failed to exit cleanly (the measurement stands)."""
    device_lock_waited_s: float | None = None
    """Seconds the trial waited for its devices' locks (:mod:`hfscale.launch.device_lock`) while another sweep's trial
    held them; None when no lock was taken (rows of hfscale 0.2 and earlier, or the lock folder was unusable)."""
    device_shared_with: list[str] | None = None
    """Another sweep's trials that held this trial's devices while it ran (``HFSCALE_DEVICE_LOCK=share``), or why
    its devices could not be locked; None when it had them to itself."""
    failed_machine: int | None = None
    """A trial on several machines that failed: the machine (rank) where it failed first, as
    :func:`hfscale.sweep.machines.merge_machine_reports` decides; None on one machine or when every machine ended
    well."""
    failed_ranks: list[int] | None = None
    """The global ranks of ``failed_machine`` that failed (its failing rank where stderr names it, else all its
    ranks)."""
    machine_dirs: list[str] | None = None
    """A trial on several machines: every other machine's log folder of this run (relative to the run folder when
    that machine writes into it, else the path on that machine)."""


@dataclass(kw_only=True)
class TrialResult:
    """One row of a sweep: what was asked, how it was launched, what it measured, and what was derived from it."""

    schema_version: int = SCHEMA_VERSION
    trial: str
    """The trial's name (unique within a run)."""
    repeat: int = 0
    """Which run of the trial this is, 0-based."""
    repeats: int = 1
    """How many runs of the trial the recipe asks for."""
    strategy: Strategy
    """What was asked for."""
    description: str = ""
    """``Strategy.describe()``: the strategy in words."""
    is_baseline: bool = False
    status: TrialStatus
    reason: str | None = None
    """Why a trial is not ``ok``, in a sentence a user can act on."""
    exit_code: int | None = None
    """The launcher's exit code; negative for a signal (as ``subprocess`` reports it)."""
    stderr_tail: str | None = None
    """Last lines of the trial's stderr, kept for failed trials."""
    wall_time_s: float | None = None
    """Whole process group, launch to exit: includes start-up, model build and DeepSpeed init."""
    started_at: str | None = None
    finished_at: str | None = None
    launch: LaunchRecord | None = None
    """None for a trial that was not launched (``skipped``)."""
    measured: TrialOutcome | None = None
    """What the trial process wrote; None when it wrote nothing (it failed, or was not launched)."""
    estimate: MemoryEstimate | None = None
    """The peak memory predicted before the trial ran."""
    estimate_error: str | None = None
    """Why there is no estimate (a model type or optimizer the estimator does not model)."""
    parity: ParityResult | None = None
    """The loss curve against the baseline's (``hfscale.results.parity``)."""
    batch_search: BatchSearchRecord | None = None
    """The largest batch that fits (``--find-max-batch``)."""
    activity: MachineActivity | None = None
    """What else the machine was doing while the trial ran (``hfscale.launch.activity``); None when not sampled."""
    stopping: str | None = None
    """How the trial's number of runs is decided when the recipe does not fix it (``measure.target_precision``):
    the sequential rule, so a reader knows the run count followed the results (None: a fixed count)."""
    search: SearchDecision | None = None
    """Why an adaptive search did not run the trial (``skipped`` by the estimate) or stopped running it
    (``pruned``), with the evidence (:mod:`hfscale.sweep.search`); None on every other row."""

    def __post_init__(self) -> None:
        if self.status not in TRIAL_STATUSES:
            raise ValueError(f"TrialResult.status: expected one of {', '.join(TRIAL_STATUSES)}, got {self.status!r}")

    # -- what the trial measured, read through the outcome (None when it measured nothing) --------------------

    @property
    def memory(self) -> MemorySummary | None:
        return self.measured.memory if self.measured else None

    @property
    def throughput(self) -> ThroughputSummary | None:
        return self.measured.throughput if self.measured else None

    @property
    def verification(self) -> VerificationRecord | None:
        return self.measured.verification if self.measured else None

    @property
    def loss_curve(self) -> list[float]:
        return self.measured.loss_curve if self.measured else []

    @property
    def final_loss(self) -> float | None:
        return self.measured.final_loss if self.measured else None

    @property
    def train_runtime_s(self) -> float | None:
        return self.measured.train_runtime_s if self.measured else None

    @property
    def train_samples_per_second(self) -> float | None:
        return self.measured.train_samples_per_second if self.measured else None

    @property
    def peak_gib(self) -> float | None:
        """The training peak, max over ranks (CUDA peak allocated / CPU peak RSS)."""
        return self.memory.peak_gib if self.memory else None

    @property
    def samples_per_s(self) -> float | None:
        """Steady-state samples/s (all ranks, warm-up steps left out); None when it was not measured."""
        return self.throughput.samples_per_s if self.throughput else None

    @property
    def predicted_gib(self) -> float | None:
        return self.estimate.total_gib if self.estimate else None

    @property
    def key(self) -> tuple[str, int]:
        """What identifies the row within its run: (trial, repeat)."""
        return (self.trial, self.repeat)

    def progress_line(self) -> str:
        """One line for a finished trial: status, samples/s, peak memory (and the predicted peak), wall time (or the
        reason it failed)."""
        parts: list[str] = [self.status]
        if self.status in RAN_STATUSES:
            sps = self.samples_per_s if self.samples_per_s is not None else self.train_samples_per_second
            peak, predicted = self.peak_gib, self.predicted_gib
            parts.append(f"{sps:.2f} samples/s" if sps is not None else "samples/s n/a")
            parts.append(
                (f"peak {peak:.2f} GiB" if peak is not None else "peak n/a")
                + (f" (predicted {predicted:.2f})" if predicted is not None else "")
            )
        if self.wall_time_s is not None:
            parts.append(f"{self.wall_time_s:.1f} s")
        line = "  ".join(parts)
        if self.status != "ok" and self.reason:
            line += f"  ({self.reason})"
        return line

    def to_json(self) -> dict[str, Any]:
        return row_to_json(self)


@functools.cache
def _adapter(cls: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def _validate(cls: type, data: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    try:
        return _adapter(cls).validate_python(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<row>'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise ValueError(f"not a valid {cls.__name__}: {problems}") from None


def to_json_text(record: TrialResult | TrialOutcome, *, indent: int | None = None) -> str:
    """A row or an outcome as standard JSON text: a NaN or infinite loss is written as the string ``"NaN"`` or
    ``"Infinity"`` (bare ``NaN`` tokens are not JSON: jq and browsers refuse them), which reads back as the float."""
    import pydantic_core

    data = _adapter(type(record)).dump_python(record, mode="json")
    return pydantic_core.to_json(data, indent=indent, inf_nan_mode="strings").decode("utf-8")


def row_to_json(row: TrialResult) -> dict[str, Any]:
    """The row as a JSON-ready dict (what one line of ``results.jsonl`` holds; floats may be NaN or inf)."""
    return _adapter(TrialResult).dump_python(row, mode="json")


def row_from_json(data: dict[str, Any]) -> TrialResult:
    """A stored row, of any schema version, as a :class:`TrialResult`.

    Raises:
        ValueError: naming the field that does not validate, or an unknown (newer) schema version.
    """
    return _validate(TrialResult, migrate_row(data))


def migrate_row(data: dict[str, Any]) -> dict[str, Any]:
    """A stored row's dict in the current schema; rows already current are returned as they are.

    Schema 1 (hfscale 0.1) kept the measurements flat on the row and launch details, repeat numbers, parity and
    batch search in ``extra``; schema 2 nests what the trial process wrote under ``measured`` and gives each of
    the others a typed field.

    Raises:
        ValueError: for a schema version newer than this hfscale reads.
    """
    version = data.get("schema_version", 1)
    if version == SCHEMA_VERSION:
        return data
    if version != 1:
        raise ValueError(f"schema_version {version!r}: this hfscale reads rows of schema 1 to {SCHEMA_VERSION}")
    return _migrate_v1(data)


_V1_MEASURED = ("train_runtime_s", "train_samples_per_second", "loss_curve", "memory", "throughput", "verification")
_V1_LAUNCH = ("command", "main_process_port", "memory_limit_gib", "timeout_s", "trial_dir", "after_result")


def _migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    extra = dict(data.get("extra") or {})
    row: dict[str, Any] = {
        key: data.get(key)
        for key in (
            "trial",
            "strategy",
            "description",
            "is_baseline",
            "status",
            "reason",
            "exit_code",
            "stderr_tail",
            "wall_time_s",
            "started_at",
            "finished_at",
            "estimate",
        )
        if key in data
    }
    row["schema_version"] = SCHEMA_VERSION
    row["repeat"] = int(extra.get("repeat", 0))
    row["repeats"] = int(extra.get("repeats", 1))
    row["estimate_error"] = extra.get("estimate_error")
    if "command" in extra:
        row["launch"] = {key: extra[key] for key in _V1_LAUNCH if key in extra}
    if data.get("status") in RAN_STATUSES and any(data.get(k) is not None for k in _V1_MEASURED):
        row["measured"] = {
            "trial": data["trial"],
            "status": data["status"],
            "reason": data.get("reason"),
            "mismatches": extra.get("mismatches", []),
            "timings_s": extra.get("timings_s", {}),
            "world_size": extra.get("world_size", 1),
            "training_args": extra.get("training_args", {}),
            "started_at": data.get("started_at"),
            "finished_at": data.get("finished_at"),
            **{key: data[key] for key in _V1_MEASURED if key in data},
        }
    if isinstance(extra.get("parity"), dict):
        row["parity"] = extra["parity"]
    if isinstance(extra.get("batch_search"), dict):
        row["batch_search"] = BatchSearchRecord.migrate_v1(extra["batch_search"])
    return row


__all__ = [
    "RAN_STATUSES",
    "SCHEMA_VERSION",
    "TRIAL_STATUSES",
    "LaunchRecord",
    "OutcomeStatus",
    "TrialOutcome",
    "TrialResult",
    "TrialStatus",
    "migrate_row",
    "row_from_json",
    "row_to_json",
    "to_json_text",
]
