"""What a trial is: the model, the data, how it is measured, and the strategy, as plain serialisable dataclasses.

This is the bottom floor of the house. The recipe loader builds these, the sweep writes them to ``trial.json``, the
trial process reads them back, and the estimate reads them without running anything; none of those needs the code
that runs a trial to know what a trial is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hfscale.strategy import Strategy

Task = Literal["classification", "causal_lm"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model to train: a transformers model type plus config overrides, built with random weights."""

    type: str = "bert"
    """A transformers ``model_type`` (``bert``, ``gpt2``, ``llama``, ...), as ``AutoConfig.for_model`` takes it."""
    task: Task = "classification"
    """Sequence classification head, or causal language modelling."""
    config: dict[str, Any] = field(default_factory=dict)
    """Overrides for the model config (``hidden_size``, ``num_hidden_layers``, ...)."""
    pretrained: str | None = None
    """A name or local path to load real weights from instead; weights do not change speed or memory."""
    factory: str | None = None
    """Your own model: ``"package.module:function"`` or ``"file.py:function"``, called with ``config`` as keyword
    arguments (:mod:`hfscale.workload.factory`); ``type`` is then only a label."""


@dataclass(frozen=True, kw_only=True)
class LengthSpec:
    """How long each dummy sequence is, drawn per sample and at most ``data.seq_len``
    (:mod:`hfscale.workload.lengths`)."""

    distribution: Literal["uniform", "normal", "histogram"] = "uniform"
    """``uniform`` over [min, seq_len]; ``normal`` with ``mean`` and ``sd`` (clipped to [min, seq_len]);
    ``histogram``: lengths drawn with the weights of ``histogram``."""
    min: int = 1
    mean: float | None = None
    sd: float | None = None
    histogram: dict[int, float] = field(default_factory=dict)
    """Length -> weight (any positive numbers; normalised)."""


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The dummy data set: random token ids, the seed setup by default (512 sequences of 512 tokens)."""

    num_samples: int = 512
    seq_len: int = 512
    token_low: int = 100
    """Smallest token id (inclusive)."""
    token_high: int = 30000
    """Largest token id (exclusive)."""
    num_labels: int = 2
    """Classes for classification; ignored for causal LM (labels are the inputs)."""
    seed: int = 0
    factory: str | None = None
    """Your own data: ``"package.module:function"`` or ``"file.py:function"`` returning a ``datasets.Dataset`` or a
    ``(dataset, collator)`` pair, called with ``factory_kwargs``; ``seq_len`` then only tells the estimate the
    sequence length to plan for."""
    factory_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the data factory."""
    lengths: LengthSpec | None = None
    """Variable-length sequences (``seq_len`` is then the longest); None: every sequence is ``seq_len`` long."""
    packing: Literal["pad", "pack"] = "pad"
    """With ``lengths``: pad each batch to its longest sequence, or pack the sequences into rows of ``seq_len``
    (causal LM only)."""


DEFAULT_REPEATS = 3
"""Runs of each trial when a recipe does not say: a verdict needs two a side, and at three the sweep's intervals
find a 15% difference at the few-percent run-to-run noise a GPU usually shows (simulated: docs/statistics.md); a
noisier machine needs more (the CPU recipes ask for 5)."""
SEQUENTIAL_MIN_RUNS = 3
"""The fewest runs ``measure.target_precision`` stops at: the trial's own runs must be able to show that it shares
the sweep's noise before its interval is trusted (two runs give that check one degree of freedom;
docs/statistics.md)."""


AUTO_WARMUP_PLAN_STEPS = 5
"""Steps planned for a detected warm-up where a run's length must be fixed beforehand (a batch-search probe): the
default fixed warm-up, so that a probe has room for a slow start and the detection at least a few steps after it."""


@dataclass(frozen=True, kw_only=True)
class MeasureSpec:
    """How a trial is measured."""

    warmup_steps: int | Literal["auto"] = 5
    """Optimizer steps left out of the steady-state figures, or ``"auto"``: each run reads its warm-up from its own
    step times (:mod:`hfscale.measure.warmup`, MSER) and says whether it reached a steady state."""
    max_steps: int | None = None
    """Optimizer steps to train; None trains ``num_epochs`` epochs."""
    num_epochs: float = 1.0
    repeats: int = DEFAULT_REPEATS
    """Times each trial is run (each in a fresh process); with ``target_precision``, the fewest."""
    timeout_s: float = 1800.0
    """Wall-clock limit for one trial's whole process group."""
    target_precision: float | None = None
    """Run the trial again (in later interleaved rounds, up to ``max_repeats``) until the run-level 95% interval of
    its samples/s (its runs, the sweep's pooled run-to-run noise) is within this fraction of the value (0.05: ± 5%).
    At least :data:`SEQUENTIAL_MIN_RUNS` runs are made. None: exactly ``repeats`` runs."""
    max_repeats: int = 5
    """The most runs ``target_precision`` may take."""
    max_time_s: float | None = None
    """With ``target_precision``: no further run once the trial's runs took this many wall-clock seconds."""

    @property
    def planned_warmup_steps(self) -> int:
        """The warm-up to plan a run's length around (a batch-search probe trains this many steps before its
        measured ones): the given count, or :data:`AUTO_WARMUP_PLAN_STEPS` under ``"auto"``."""
        return self.warmup_steps if isinstance(self.warmup_steps, int) else AUTO_WARMUP_PLAN_STEPS

    @property
    def most_runs(self) -> int:
        """How many runs of the trial there can be."""
        return max(self.repeats, self.max_repeats) if self.target_precision is not None else self.repeats


@dataclass(frozen=True, kw_only=True)
class ScriptSpec:
    """The user's own training script, run unmodified in place of hfscale's model and data
    (:mod:`hfscale.trial.script` says how the strategy and the measurement reach it)."""

    path: str
    """The script, an absolute path (a recipe's relative path is resolved against the recipe's folder)."""
    args: tuple[str, ...] = ()
    """Its command-line arguments, as ``python SCRIPT ARGS...`` would get them."""

    def command_line(self) -> str:
        """``hf_example.py --bf16 ...``: how the report names the workload."""
        return " ".join([Path(self.path).name, *self.args])


@dataclass(frozen=True, kw_only=True)
class TrialSpec:
    """Everything one trial process needs, serialisable as JSON."""

    name: str
    strategy: Strategy
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    training_args: dict[str, Any] = field(default_factory=dict)
    """Base ``TrainingArguments`` keywords from the recipe (learning rate, logging, seed, ...); the strategy's
    own keywords (precision, batch, optimizer, ...) are applied over them."""
    measure: MeasureSpec = field(default_factory=MeasureSpec)
    script: ScriptSpec | None = None
    """The user's training script; None: hfscale builds ``model`` and ``data``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialSpec:
        return cls(
            name=data["name"],
            strategy=Strategy.from_dict(data["strategy"]),
            model=ModelSpec(**data.get("model", {})),
            data=_data_from(data.get("data", {})),
            training_args=dict(data.get("training_args", {})),
            measure=MeasureSpec(**data.get("measure", {})),
            script=_script_from(data.get("script")),
        )

    def write(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True), encoding="utf-8")

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> TrialSpec:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _data_from(data: dict[str, Any]) -> DataSpec:
    raw = dict(data)
    lengths = raw.pop("lengths", None)
    if lengths is not None:  # JSON keys are strings: the histogram's lengths are integers again
        histogram = {int(k): float(v) for k, v in (lengths.get("histogram") or {}).items()}
        raw["lengths"] = LengthSpec(**{**lengths, "histogram": histogram})
    return DataSpec(**raw)


def _script_from(data: dict[str, Any] | None) -> ScriptSpec | None:
    return None if data is None else ScriptSpec(path=data["path"], args=tuple(data.get("args", ())))


__all__ = ["DataSpec", "LengthSpec", "MeasureSpec", "ModelSpec", "ScriptSpec", "Task", "TrialSpec"]
