"""Recipes: one YAML file -> a validated list of trials for a sweep.

A recipe names what is trained (the model and the dummy data), how it is measured, and the strategies to compare.
It is loaded with ``yaml.safe_load`` and walked against the dataclass fields it fills; an unknown key, a value of
the wrong type or a choice out of range fails before any process starts, with the file and the dotted key path::

    recipes/x.yaml: trials[2].deepspeed.zero_stage: expected one of 0, 1, 2, 3, got 4

Format (every section but ``trials``/``matrix`` is optional)::

    name: cpu_small                  # defaults to the file's stem
    description: what this compares
    device: cpu                      # cuda | cpu, for every trial
    model: {type: bert, task: classification, config: {hidden_size: 64, num_hidden_layers: 2}}
    data: {num_samples: 128, seq_len: 128}
    training_args: {learning_rate: 5.0e-5, logging_steps: 1}   # passed to TrainingArguments
    measure: {warmup_steps: 2, num_epochs: 1, timeout_s: 600}
    run: {memory_limit_gib: 8, env: {OMP_NUM_THREADS: "1"}}     # how each trial's processes are started
    sweep: {batch: both}             # fixed | max | both: also compare each trial at the largest batch it fits
    baseline: fp32                   # the trial others are compared with (default: the first)
    defaults: {per_device_batch_size: 8}                      # Strategy fields applied to every trial
    trials:                          # Strategy fields, plus optional per-trial `measure:` / `run:` /
      - name: fp32                   # `training_args:` overrides (merged over the recipe's, key by key)
      - {name: lr-too-high, training_args: {learning_rate: 10}}
      - {name: bf16, precision: bf16, batch: max}                 # this trial at its largest batch only
      - {name: zero2-x2, deepspeed: {zero_stage: 2}, num_processes: 2}
    matrix:                          # the product of the axes, each trial named from its values (zero2-bf16)
      deepspeed.zero_stage: [1, 2]
      precision: [fp32, bf16]

A trial that does not set ``num_processes`` (nor ``num_machines``) takes the count of the sweep's launch (the outer
``accelerate launch``, or ``--num-processes``); see :meth:`Recipe.resolve`.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hfscale.core.validation import Invalid, build, convert, field_types, join_path, reject_unknown, show_value
from hfscale.recipes.catalog import recipe_names, resolve_recipe, shipped_recipe
from hfscale.recipes.checks import (
    OWNED_TRAINING_ARGS,
    REFUSED_TRAINING_ARGS,
    check_batch_fits_data,
    check_folder_name,
    check_liger,
    check_lora,
    check_measure,
    check_model,
    check_tensor_parallel,
    check_training_args,
)
from hfscale.records.batch import MAX_BATCH_SUFFIX
from hfscale.strategy import (
    CompileSpec,
    DeepSpeedSpec,
    Device,
    FsdpSpec,
    LoraSpec,
    ParallelismSpec,
    Strategy,
    StrategyError,
)
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec


class RecipeError(ValueError):
    """A recipe that cannot be run as written; the message starts with the file and the dotted key path."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """How a trial's processes are started (not part of what is measured)."""

    memory_limit_gib: float | None = None
    """Address-space limit (``RLIMIT_AS``) of every process of the trial, in GiB; None for no limit. It caps host
    memory only, so a CPU trial over it really runs out of memory. Note that CUDA maps far more address space than
    it uses: leave it unset for GPU trials."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the trial's processes (``OMP_NUM_THREADS``, ``NCCL_DEBUG``, ...)."""

    def __post_init__(self) -> None:
        if self.memory_limit_gib is not None and self.memory_limit_gib <= 0:
            raise ValueError(f"memory_limit_gib: expected a positive number, got {self.memory_limit_gib!r}")


BatchMode = Literal["fixed", "max", "both"]


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """How the sweep compares the trials (a recipe's ``sweep:`` section)."""

    batch: BatchMode = "fixed"
    """Which per-device batch the strategies are compared at. ``fixed``: each trial's own (the recipe's); the
    command line's ``--find-max-batch`` still records each trial's largest. ``both``: each trial at its own
    batch, and again as ``<trial>-maxbatch`` at the largest batch it fits (found by short probe runs), so a
    strategy that saves memory shows what the memory buys. ``max``: compare at the largest batch only: each trial
    runs once at its own batch (the search's first probe) and its ``-maxbatch`` row, with the recipe's repeats,
    is compared; the baseline is the baseline's ``-maxbatch`` row."""
    max_batch_limit: int | None = None
    """Largest per-device batch the search tries (``--max-batch-limit`` overrides it). Set it on CPU: without a
    ``run.memory_limit_gib`` nothing runs out of memory there, and the search would double up to 1024."""

    def __post_init__(self) -> None:
        if self.batch not in ("fixed", "max", "both"):
            raise ValueError(f"batch: expected one of 'fixed', 'max', 'both', got {self.batch!r}")
        limit = self.max_batch_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_batch_limit: expected a positive integer, got {limit!r}")


@dataclass(frozen=True, kw_only=True)
class RecipeTrial:
    """One trial of a recipe: what the trial process gets, plus how the sweep starts it."""

    spec: TrialSpec
    """The trial as the trial process reads it (name, strategy, model, data, training_args, measure)."""
    run: RunSpec
    """The recipe's ``run`` section with this trial's overrides applied."""
    pinned: frozenset[str] = frozenset()
    """Strategy fields among ``num_processes``/``num_machines`` that the recipe sets for this trial; the others
    follow the sweep's launch."""
    source: str = ""
    """Where the trial comes from in the recipe (``trials[2]``, ``matrix[zero2-bf16]``), for error messages."""
    batch: BatchMode = "fixed"
    """Which per-device batch this trial is compared at (see :attr:`SweepOptions.batch`): the recipe's
    ``sweep.batch`` unless the trial sets its own ``batch:``."""

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A validated recipe; :func:`load_recipe` builds one from a file."""

    name: str
    """Short name (the file's stem unless set); run folders are named after it."""
    description: str = ""
    """What the recipe compares, in a sentence or two."""
    device: Device = "cuda"
    """Where every trial trains."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The model, built from its config with random weights."""
    data: DataSpec = field(default_factory=DataSpec)
    """The dummy data set."""
    training_args: dict[str, Any] = field(default_factory=dict)
    """Base ``TrainingArguments`` keywords (learning rate, logging, seed, ...) shared by every trial."""
    measure: MeasureSpec = field(default_factory=MeasureSpec)
    """Warm-up, length, repeats and per-trial timeout."""
    run: RunSpec = field(default_factory=RunSpec)
    """Memory limit and environment of the trial processes."""
    sweep: SweepOptions = field(default_factory=SweepOptions)
    """How the trials are compared (the batch size axis)."""
    baseline: str
    """Name of the trial the others are compared with."""
    trials: tuple[RecipeTrial, ...]
    """Every trial, explicit ones first, then the matrix's, in the order written."""
    path: str | None = None
    """The file it was loaded from, if any."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.trials]
        if not names:
            raise RecipeError(f"{self.path or '<recipe>'}: no trials: give `trials:` or `matrix:`")
        if self.baseline not in names:
            raise RecipeError(
                f"{self.path or '<recipe>'}: baseline: {self.baseline!r} is not a trial; trials are {', '.join(names)}"
            )

    @property
    def trial_names(self) -> list[str]:
        return [t.name for t in self.trials]

    def resolve(self, *, num_processes: int | None = None, num_machines: int | None = None) -> list[RecipeTrial]:
        """The trials with the launch's process and machine counts applied to those that do not pin them.

        Args:
            num_processes: processes in all (every machine) for trials that do not set ``num_processes``.
            num_machines: machines for trials that do not set ``num_machines``.

        Raises:
            RecipeError: when a trial's strategy is invalid with these counts (e.g. not a multiple), or one step of
                it would take more samples than ``data.num_samples`` holds.
        """
        out = []
        for trial in self.trials:
            changes: dict[str, int] = {}
            if num_processes is not None and "num_processes" not in trial.pinned:
                changes["num_processes"] = num_processes
            if num_machines is not None and "num_machines" not in trial.pinned:
                changes["num_machines"] = num_machines
            if not changes:
                out.append(trial)
                continue
            launch = ", ".join(f"{k}={v}" for k, v in changes.items())
            where = f"{self.path or '<recipe>'}: {trial.source} (with the launch's {launch})"
            try:
                strategy = trial.spec.strategy.replace(**changes)
                check_batch_fits_data(strategy, trial.spec.data, "")
            except StrategyError as exc:
                raise RecipeError(f"{where}: {exc}") from exc
            except Invalid as exc:
                raise RecipeError(f"{where}: {exc.path}: {exc.message}") from None
            spec = dataclasses.replace(trial.spec, strategy=strategy)
            out.append(dataclasses.replace(trial, spec=spec))
        return out

    def trial_specs(self, *, num_processes: int | None = None, num_machines: int | None = None) -> list[TrialSpec]:
        """The :class:`TrialSpec` of every trial (see :meth:`resolve` for the counts)."""
        return [t.spec for t in self.resolve(num_processes=num_processes, num_machines=num_machines)]


# -- trials, defaults and the matrix --------------------------------------------------------------------------

_STRATEGY_FIELDS = [f.name for f in dataclasses.fields(Strategy)]
_NESTED: dict[str, type] = {
    "deepspeed": DeepSpeedSpec,
    "fsdp": FsdpSpec,
    "torch_compile": CompileSpec,
    "lora": LoraSpec,
    "parallelism": ParallelismSpec,
}
# A trial entry is Strategy fields plus these per-trial overrides; `device` is the recipe's.
_TRIAL_EXTRAS = ("measure", "run", "training_args", "batch")
_TOP_KEYS = (
    "name",
    "description",
    "device",
    "model",
    "data",
    "training_args",
    "measure",
    "run",
    "sweep",
    "baseline",
    "defaults",
    "trials",
    "matrix",
)


def _strategy_field_type(dotted: str, path: str, *, also_valid: tuple[str, ...] = ()) -> Any:
    """The type of a Strategy field, or of a nested ``deepspeed.X`` / ``fsdp.X`` field."""
    head, _, tail = dotted.partition(".")
    if head not in _STRATEGY_FIELDS or head in ("name", "device"):
        valid = [f for f in _STRATEGY_FIELDS if f not in ("name", "device")] + list(also_valid)
        valid += [f"{n}.{f.name}" for n, c in _NESTED.items() for f in dataclasses.fields(c)]
        close = difflib.get_close_matches(dotted, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise Invalid(path, f"unknown key{hint}; valid keys here are {', '.join(sorted(valid))}")
    if not tail:
        return field_types(Strategy)[head]
    if head not in _NESTED:
        raise Invalid(path, f"{head!r} has no fields; use `{head}: [...]`")
    nested = field_types(_NESTED[head])
    if tail not in nested:
        close = difflib.get_close_matches(tail, list(nested), n=1)
        hint = f" (did you mean {head}.{close[0]}?)" if close else ""
        raise Invalid(path, f"unknown key{hint}; valid keys of {head} are {', '.join(sorted(nested))}")
    return nested[tail]


def _check_partial_strategy(data: dict[str, Any], path: str, *, also_valid: tuple[str, ...] = ()) -> None:
    """Type-check Strategy fields given on their own (defaults, a trial before merging); nested sections partially."""
    for key, value in data.items():
        key_path = join_path(path, key)
        if key == "device":
            raise Invalid(key_path, "the device is set once, at the top of the recipe (`device: cuda|cpu`)")
        if key == "name":
            raise Invalid(key_path, "each trial has its own name; set it in the trial")
        if key in _NESTED and isinstance(value, dict):
            nested_hints = field_types(_NESTED[key])
            reject_unknown(value, nested_hints, key_path)
            for sub, sub_value in value.items():
                convert(nested_hints[sub], sub_value, join_path(key_path, sub))
            continue
        convert(_strategy_field_type(key, key_path, also_valid=also_valid), value, key_path)


def _undot(data: dict[str, Any]) -> dict[str, Any]:
    """``{"deepspeed.zero_stage": 2}`` -> ``{"deepspeed": {"zero_stage": 2}}`` (trials and defaults may use either)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        out = _set_dotted(out, key, value)
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; nested ``deepspeed``/``fsdp`` mappings merge key by key, ``null`` removes."""
    out = dict(base)
    for key, value in over.items():
        if key in _NESTED and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    head, _, tail = dotted.partition(".")
    if not tail:
        return _merge(data, {head: value})
    current = data.get(head)
    return _merge(data, {head: {**(current if isinstance(current, dict) else {}), tail: value}})


def _label(key: str, value: Any) -> str:
    """The part of an automatic trial name that one axis value contributes ('' for nothing)."""
    if value is None or value is False:
        return ""
    if key == "gradient_checkpointing":
        return "ckpt"
    if key == "per_device_batch_size":
        return f"bs{value}"
    if key == "gradient_accumulation_steps":
        return f"acc{value}"
    if key == "num_processes":
        return f"x{value}"
    if key == "num_machines":
        return f"{value}node"
    if key in ("precision", "optimizer", "fsdp.sharding"):
        return str(value)
    if key == "deepspeed":
        stage = value.get("zero_stage", 2)
        offloads = [v for k, v in value.items() if k.startswith("offload_") and v not in (None, "none")]
        return f"zero{stage}" + ("-offload" if offloads else "")
    if key == "deepspeed.zero_stage":
        return f"zero{value}"
    if key in ("deepspeed.offload_optimizer", "deepspeed.offload_param"):
        return "" if value == "none" else f"{key.split('_')[-1]}-{value}"
    if key == "fsdp":
        return f"fsdp{value.get('version', 2)}" + ("-offload" if value.get("cpu_offload") else "")
    if key == "fsdp.version":
        return f"fsdp{value}"
    if key == "fsdp.cpu_offload":
        return "fsdp-offload" if value else ""
    if key == "torch_compile":
        return "compile" + ("" if value.get("backend", "inductor") == "inductor" else f"-{value['backend']}")
    if key == "torch_compile.backend":
        return f"compile-{value}"
    if key == "attn_implementation":
        return f"attn-{value}"
    if key == "lora":
        return ("qlora" if value.get("quantize_base") == "4bit" else "lora") + f"-r{value.get('rank', 8)}"
    if key == "lora.rank":
        return f"lora-r{value}"
    if key == "lora.quantize_base":
        return "qlora" if value == "4bit" else ""
    if key == "parallelism":
        return "-".join(f"{k}{v}" for k, v in value.items() if v != 1) or "mesh1"
    if key == "data_parallel":
        return str(value)
    if value is True:
        return key.rsplit(".", 1)[-1]
    return f"{key.rsplit('.', 1)[-1]}{value}"


def _auto_name(items: list[tuple[str, Any]]) -> str:
    name = "-".join(label for key, value in items if (label := _label(key, value)))
    return name or "default"


# -- the recipe ------------------------------------------------------------------------------------------------


def parse_recipe(data: Any, *, source: str = "<recipe>", default_name: str = "recipe") -> Recipe:
    """A :class:`Recipe` from already-parsed YAML data.

    Args:
        data: the YAML document (a mapping).
        source: shown at the start of every error message (the file name).
        default_name: the recipe's name when the document sets none.

    Raises:
        RecipeError: naming the source and the dotted key path of the first problem.
    """
    try:
        return _parse(data, default_name=default_name, source=source)
    except Invalid as exc:
        where = f"{source}: {exc.path}: " if exc.path else f"{source}: "
        raise RecipeError(where + exc.message) from None


def _read_yaml(path: str | os.PathLike[str]) -> tuple[str, Any]:
    """A recipe file's path (a shipped recipe's name resolved) and its YAML document.

    Raises:
        FileNotFoundError: when it is neither a file nor a shipped recipe's name; the message lists the names.
        RecipeError: when it is a folder, not UTF-8 text, or not valid YAML.
    """
    resolved = resolve_recipe(path)
    if resolved.is_dir():
        raise RecipeError(f"{resolved}: is a folder, not a recipe file")
    try:
        text = resolved.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{resolved}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        return str(resolved), yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{resolved}: not valid YAML: {exc}") from None


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Load and validate a recipe file, or a shipped recipe by name (``cpu_small``; ``hfscale recipes`` lists them).

    Raises:
        FileNotFoundError: when it is neither a file nor a shipped recipe's name; the message lists the names.
        RecipeError: when it is not valid YAML or not a valid recipe; the message names the file and key path.
    """
    source, data = _read_yaml(path)
    return parse_recipe(data, source=source, default_name=Path(source).stem)


def read_trial_names(path: str | os.PathLike[str]) -> list[str]:
    """The names of a recipe's trials, in recipe order, as :func:`load_recipe` names them, without validating it.

    For reading a finished run (the report's coverage line reads the run folder's recipe copy): validating builds
    each model's config, which imports transformers and torch, about 10 s of a report on 2 cores, and a run
    folder's copy was validated when its sweep started. Only what decides the names is checked.

    Raises:
        FileNotFoundError: as :func:`load_recipe`.
        RecipeError: when the file is not YAML, or its trials or matrix cannot be read; names the file and key path.
    """
    source, data = _read_yaml(path)
    try:
        if not isinstance(data, dict):
            raise Invalid("", f"expected a mapping at the top level, got {show_value(data)}")
        entries = _trial_entries(data.get("trials") or [])
        if data.get("matrix") is not None:
            entries += _expand_matrix(data["matrix"])
    except Invalid as exc:
        raise RecipeError(f"{source}: {exc.path}: {exc.message}" if exc.path else f"{source}: {exc.message}") from None
    return [entry.name for entry in entries]


@dataclass(frozen=True, kw_only=True)
class _Entry:
    """One trial as the recipe writes it (an item of ``trials:``, or one combination of ``matrix:``), unmerged."""

    path: str
    """Its key path in error messages: ``trials[2]``, or ``matrix[NAME]`` for a combination of the matrix."""
    name: str
    """As written, or made from its strategy fields (:func:`_auto_name`)."""
    fields: dict[str, Any]
    """Strategy fields, dotted keys unfolded."""
    measure: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    training_args: dict[str, Any] = field(default_factory=dict)
    batch: BatchMode | None = None
    """Its own ``batch:``, else None (the recipe's ``sweep.batch``)."""


def _trial_entries(raw_trials: Any) -> list[_Entry]:
    """The ``trials:`` list, each item type-checked as partial strategy fields plus its per-trial overrides.

    Pure: no model is built and nothing is imported (:func:`read_trial_names` relies on it).
    """
    if not isinstance(raw_trials, list):
        raise Invalid("trials", f"expected a list of trials, got {show_value(raw_trials)}")
    entries = []
    for i, raw in enumerate(raw_trials):
        path = join_path("trials", i)
        if not isinstance(raw, dict):
            raise Invalid(path, f"expected a mapping of strategy fields, got {show_value(raw)}")
        raw = dict(raw)
        trial_name = raw.pop("name", None)
        if trial_name is not None:
            convert(str, trial_name, join_path(path, "name"))
        overrides = {key: raw.pop(key, None) or {} for key in ("measure", "run", "training_args")}
        batch = convert(BatchMode, raw.pop("batch"), join_path(path, "batch")) if "batch" in raw else None
        for key, over in overrides.items():
            if not isinstance(over, dict):
                raise Invalid(join_path(path, key), f"expected a mapping, got {show_value(over)}")
        _check_partial_strategy(raw, path, also_valid=("name", *_TRIAL_EXTRAS))
        entries.append(
            _Entry(
                path=path,
                name=trial_name or _auto_name(list(raw.items())),
                fields=_undot(raw),
                measure=overrides["measure"],
                run=overrides["run"],
                training_args=overrides["training_args"],
                batch=batch,
            )
        )
    return entries


@dataclass(frozen=True, kw_only=True)
class _Shared:
    """What every trial of a recipe shares (its top-level sections), for building each trial."""

    device: Device
    model: ModelSpec
    data: DataSpec
    training_args: dict[str, Any]
    measure_raw: dict[str, Any]
    run_raw: dict[str, Any]
    defaults: dict[str, Any]
    batch: BatchMode


def _parse(data: Any, *, default_name: str, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise Invalid("", f"expected a mapping at the top level, got {show_value(data)}")
    reject_unknown(data, _TOP_KEYS, "")
    name = convert(str, data.get("name", default_name), "name")
    check_folder_name(name, "name")
    description = convert(str, data.get("description", ""), "description")
    device = convert(field_types(Recipe)["device"], data.get("device", "cuda"), "device")
    model = build(ModelSpec, data.get("model") or {}, "model")
    data_spec = build(DataSpec, data.get("data") or {}, "data")
    check_model(model, data_spec)
    measure_raw = data.get("measure") or {}
    measure = build(MeasureSpec, measure_raw, "measure")
    check_measure(measure, "measure")
    run_raw = data.get("run") or {}
    run = build(RunSpec, run_raw, "run")
    training_args = convert(dict[str, Any], data.get("training_args") or {}, "training_args")
    training_args = check_training_args(training_args)
    sweep = build(SweepOptions, data.get("sweep") or {}, "sweep")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise Invalid("defaults", f"expected a mapping of strategy fields, got {show_value(defaults)}")
    _check_partial_strategy(defaults, "defaults")

    entries = _trial_entries(data.get("trials") or [])
    if data.get("matrix") is not None:
        entries += _expand_matrix(data["matrix"])
    if not entries:
        raise Invalid("", "no trials: give a `trials:` list and/or a `matrix:` of strategy axes")
    shared = _Shared(
        device=device, model=model, data=data_spec, training_args=training_args, measure_raw=measure_raw,
        run_raw=run_raw, defaults=_undot(defaults), batch=sweep.batch,
    )  # fmt: skip
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.name in seen:
            raise Invalid(
                entry.path,
                f"duplicate trial name {entry.name!r} (also {seen[entry.name]}); give each trial a unique name",
            )
        seen[entry.name] = entry.path
    trials = [_build_trial(entry, shared) for entry in entries]
    baseline = data.get("baseline", trials[0].name)
    convert(str, baseline, "baseline")
    _check_names(trials, baseline)
    return Recipe(
        name=name,
        description=description,
        device=device,
        model=model,
        data=data_spec,
        training_args=training_args,
        measure=measure,
        run=run,
        sweep=sweep,
        baseline=baseline,
        trials=tuple(trials),
        path=source,
    )


def _build_trial(entry: _Entry, shared: _Shared) -> RecipeTrial:
    """One trial: its strategy fields over the recipe's ``defaults``, its overrides over the recipe's sections, and
    the checks that need the model or the data beside the strategy."""
    path = entry.path
    merged = _merge(shared.defaults, entry.fields)
    pinned = frozenset(k for k in ("num_processes", "num_machines") if k in merged)
    strategy = build(Strategy, {**merged, "name": entry.name}, path, device=shared.device)
    check_tensor_parallel(shared.model, shared.data, strategy, path)  # needs the model: a tp plan
    check_liger(strategy, shared.model, path)
    check_lora(strategy, shared.model, path)
    check_batch_fits_data(strategy, shared.data, path)
    args_over = (
        check_training_args(entry.training_args, join_path(path, "training_args")) if entry.training_args else {}
    )
    trial_measure = build(MeasureSpec, {**shared.measure_raw, **entry.measure}, join_path(path, "measure"))
    check_measure(trial_measure, join_path(path, "measure"))
    run_merged = {**shared.run_raw, **entry.run}
    if isinstance(shared.run_raw.get("env"), dict) and isinstance(entry.run.get("env"), dict):
        run_merged["env"] = {**shared.run_raw["env"], **entry.run["env"]}
    trial_run = build(RunSpec, run_merged, join_path(path, "run"))
    spec = TrialSpec(
        name=entry.name,
        strategy=strategy,
        model=shared.model,
        data=shared.data,
        training_args={**shared.training_args, **args_over},
        measure=trial_measure,
    )
    batch = entry.batch or shared.batch
    return RecipeTrial(spec=spec, run=trial_run, pinned=pinned, source=path, batch=batch)


def _check_names(trials: list[RecipeTrial], baseline: str) -> None:
    """The baseline is a trial, and no trial has the name of another's max-batch row (``sweep.batch``)."""
    seen = {t.name: t.source for t in trials}
    if baseline not in seen:
        raise Invalid("baseline", f"{baseline!r} is not a trial; trials are {', '.join(seen)}")
    # A trial's max-batch row is named after it: a trial of that name would be two rows of one name.
    searched = {t.name: t.batch for t in trials if t.batch != "fixed"}
    for name in seen:
        if name.endswith(MAX_BATCH_SUFFIX) and name.removesuffix(MAX_BATCH_SUFFIX) in searched:
            of = name.removesuffix(MAX_BATCH_SUFFIX)
            raise Invalid(
                seen[name],
                f"trial name {name!r} is the name of {of!r}'s max-batch row (batch: {searched[of]}); rename it",
            )


def _expand_matrix(matrix: Any) -> list[_Entry]:
    """One entry per combination of the axes, named from its values (``zero2-bf16``); pure, as
    :func:`_trial_entries`."""
    if not isinstance(matrix, dict) or not matrix:
        raise Invalid("matrix", f"expected a mapping of strategy field -> list of values, got {show_value(matrix)}")
    axes: list[tuple[str, list[Any]]] = []
    for key, values in matrix.items():
        path = join_path("matrix", str(key))
        if not isinstance(key, str):
            raise Invalid(path, "axis names must be strings")
        if not isinstance(values, list) or not values:
            raise Invalid(path, f"expected a non-empty list of values, got {show_value(values)}")
        tp = _strategy_field_type(key, path)
        for i, value in enumerate(values):
            value_path = join_path(path, i)
            if key in _NESTED and isinstance(value, dict):
                nested_hints = field_types(_NESTED[key])
                reject_unknown(value, nested_hints, value_path)
                for sub, sub_value in value.items():
                    convert(nested_hints[sub], sub_value, join_path(value_path, sub))
            else:
                convert(tp, value, value_path)
        axes.append((key, values))
    entries = []
    for combo in itertools.product(*(values for _, values in axes)):
        fields_: dict[str, Any] = {}
        items = []
        for (key, _), value in zip(axes, combo, strict=True):
            fields_ = _set_dotted(fields_, key, value)
            items.append((key, value))
        name = _auto_name(items)
        entries.append(_Entry(path=f"matrix[{name}]", name=name, fields=fields_))
    return entries


__all__ = [
    "OWNED_TRAINING_ARGS",
    "REFUSED_TRAINING_ARGS",
    "Recipe",
    "RecipeError",
    "RecipeTrial",
    "RunSpec",
    "SweepOptions",
    "load_recipe",
    "parse_recipe",
    "read_trial_names",
]


@dataclass(frozen=True, kw_only=True)
class ShippedRecipe:
    """One shipped recipe as ``hfscale recipes`` lists it."""

    name: str
    """What to pass to ``hfscale sweep`` (the file's stem)."""
    path: Path
    """The file in the installed package."""
    description: str
    """The recipe's ``description:``."""
    device: str
    """Where its trials train (``cpu`` or ``cuda``)."""
    trial_count: int
    """Trials after the matrix is expanded (each runs ``measure.repeats`` times)."""


def shipped_recipes() -> list[ShippedRecipe]:
    """Every shipped recipe, loaded and validated, sorted by name.

    Raises:
        RecipeError: when a shipped recipe is invalid (a bug in hfscale; the test suite loads them all).
    """
    from hfscale.recipes.recipe import load_recipe

    out = []
    for name in recipe_names():
        path = shipped_recipe(name)
        recipe = load_recipe(path)
        out.append(
            ShippedRecipe(
                name=name,
                path=path,
                description=" ".join(recipe.description.split()),
                device=recipe.device,
                trial_count=len(recipe.trials),
            )
        )
    return out
