"""How results are stored: one run folder per sweep, one JSON line per trial.

Measuring (the callbacks, ``hfscale.trial``), storing (this module) and rendering (``hfscale.report``) stay apart:
the report reads only what is written here, so a run folder copied from another machine renders the same.

Run folder layout::

    RUN/
      recipe.yaml          the recipe as given
      environment.json     GPU model/count, driver, CUDA, library versions, host, git commit, time
      results.jsonl        one TrialResult per line, appended (and fsynced) as each trial ends
      trials/NAME/         generated configs (accelerate.yaml, deepspeed.json, training_args.json),
                           the trial's spec, its stdout/stderr logs
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

TrialStatus = Literal["ok", "oom", "crashed", "timeout", "not_applied", "skipped"]
"""ok: trained and verified; oom: ran out of device or host memory; crashed: any other non-zero exit or signal;
timeout: killed after the per-trial limit; not_applied: ran, but the strategy asked for is not what ran;
skipped: not run (missing optional dependency, predicted out of memory), with the reason."""

TRIAL_STATUSES: tuple[str, ...] = ("ok", "oom", "crashed", "timeout", "not_applied", "skipped")

RESULTS_FILE = "results.jsonl"
ENVIRONMENT_FILE = "environment.json"
RECIPE_FILE = "recipe.yaml"
TRIALS_DIR = "trials"


@dataclass(kw_only=True)
class TrialResult:
    """One row of a sweep: what was asked, what ran, and what was measured.

    ``memory`` and ``throughput`` hold the callbacks' summaries as dicts (``MemorySummary.to_dict()``,
    ``ThroughputSummary.to_dict()``); ``verification`` the record of what really ran (``hfscale.verify``);
    ``estimate`` the predicted memory (``hfscale.estimate``). Every one is None when it was not measured.
    """

    trial: str
    """The trial's name (unique within a run)."""
    strategy: dict[str, Any]
    """``Strategy.to_dict()`` of what was asked for."""
    status: TrialStatus
    reason: str | None = None
    """Why a trial is not ``ok``, in a sentence a user can act on."""
    description: str = ""
    """``Strategy.describe()``: the strategy in words."""
    is_baseline: bool = False
    exit_code: int | None = None
    """The launcher's exit code; negative for a signal (as ``subprocess`` reports it)."""
    stderr_tail: str | None = None
    """Last lines of the trial's stderr, kept for failed trials."""
    wall_time_s: float | None = None
    """Whole process group, launch to exit: includes start-up, model build and DeepSpeed init."""
    train_runtime_s: float | None = None
    """The Trainer's own ``train_runtime`` (warm-up included, set-up excluded)."""
    train_samples_per_second: float | None = None
    """The Trainer's own figure, beside our steady-state one."""
    final_loss: float | None = None
    loss_curve: list[float] = field(default_factory=list)
    """Training loss per optimizer step over the run (same seed and data in every trial)."""
    memory: dict[str, Any] | None = None
    throughput: dict[str, Any] | None = None
    verification: dict[str, Any] | None = None
    estimate: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything a later feature adds (batch search probes, parity flags); the report ignores unknown keys."""
    started_at: str | None = None
    finished_at: str | None = None

    def __post_init__(self) -> None:
        if self.status not in TRIAL_STATUSES:
            raise ValueError(f"TrialResult.status: expected one of {', '.join(TRIAL_STATUSES)}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        known = {f.name for f in dataclasses.fields(cls)}
        extra = dict(data.get("extra") or {})
        # Rows written by a newer hfscale keep their unknown keys instead of failing the report.
        extra.update({k: v for k, v in data.items() if k not in known})
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["extra"] = extra
        return cls(**kwargs)


def append_result(path: str | os.PathLike[str], result: TrialResult) -> None:
    """Append one row and make it durable before returning, so a crash or Ctrl-C never loses a finished trial."""
    line = json.dumps(result.to_dict(), sort_keys=True) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def read_results(run_dir: str | os.PathLike[str]) -> list[TrialResult]:
    """Every complete row of a run folder, in the order written; a torn last line (killed mid-write) is skipped.

    Raises:
        FileNotFoundError: when the folder has no results file.
    """
    path = Path(run_dir) / RESULTS_FILE
    rows: list[TrialResult] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            if line.strip():
                rows.append(TrialResult.from_dict(json.loads(line)))
    return rows


def read_environment(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The run's environment record, or an empty dict when the folder has none."""
    path = Path(run_dir) / ENVIRONMENT_FILE
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


__all__ = [
    "ENVIRONMENT_FILE",
    "RECIPE_FILE",
    "RESULTS_FILE",
    "TRIALS_DIR",
    "TRIAL_STATUSES",
    "TrialResult",
    "TrialStatus",
    "append_result",
    "read_environment",
    "read_results",
]
