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
    baseline: fp32                   # the trial others are compared with (default: the first)
    defaults: {per_device_batch_size: 8}                      # Strategy fields applied to every trial
    trials:                          # Strategy fields, plus optional per-trial `measure:` / `run:` /
      - name: fp32                   # `training_args:` overrides (merged over the recipe's, key by key)
      - {name: lr-too-high, training_args: {learning_rate: 10}}
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
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from hfscale.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec
from hfscale.strategy import DeepSpeedSpec, Device, FsdpSpec, Strategy, StrategyError


class RecipeError(ValueError):
    """A recipe that cannot be run as written; the message starts with the file and the dotted key path."""


# TrainingArguments keywords that a trial's strategy or measurement sets; a recipe's `training_args` may not set
# them (they would be silently overridden), and the message says where they belong instead.
OWNED_TRAINING_ARGS: dict[str, str] = {
    "per_device_train_batch_size": "the strategy's per_device_batch_size",
    "gradient_accumulation_steps": "the strategy's gradient_accumulation_steps",
    "fp16": "the strategy's precision (fp32, fp16 or bf16)",
    "bf16": "the strategy's precision (fp32, fp16 or bf16)",
    "half_precision_backend": "the strategy's precision",
    "optim": "the strategy's optimizer",
    "gradient_checkpointing": "the strategy's gradient_checkpointing",
    "gradient_checkpointing_kwargs": "the strategy's gradient_checkpointing",
    "activation_checkpointing": "the strategy's gradient_checkpointing",
    "activation_checkpointing_kwargs": "the strategy's gradient_checkpointing",
    "deepspeed": "the strategy's deepspeed section",
    "fsdp": "the strategy's fsdp section",
    "fsdp_config": "the strategy's fsdp section",
    "use_cpu": "the recipe's device",
    "no_cuda": "the recipe's device",
    "local_rank": "the launcher",
    "average_tokens_across_devices": "hfscale for multi-process trials (so the logged loss is not summed over ranks)",
    "max_steps": "the recipe's measure.max_steps",
    "num_train_epochs": "the recipe's measure.num_epochs",
    "output_dir": "the sweep (each trial writes into its own folder)",
}


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
            RecipeError: when a trial's strategy is invalid with these counts (e.g. not a multiple).
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
            try:
                strategy = trial.spec.strategy.replace(**changes)
            except StrategyError as exc:
                launch = ", ".join(f"{k}={v}" for k, v in changes.items())
                raise RecipeError(
                    f"{self.path or '<recipe>'}: {trial.source} (with the launch's {launch}): {exc}"
                ) from exc
            spec = dataclasses.replace(trial.spec, strategy=strategy)
            out.append(dataclasses.replace(trial, spec=spec))
        return out

    def trial_specs(self, *, num_processes: int | None = None, num_machines: int | None = None) -> list[TrialSpec]:
        """The :class:`TrialSpec` of every trial (see :meth:`resolve` for the counts)."""
        return [t.spec for t in self.resolve(num_processes=num_processes, num_machines=num_machines)]


# -- YAML --------------------------------------------------------------------------------------------------------


_FLOAT_TEXT = re.compile(r"^[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _float_text(value: Any) -> float | None:
    """``5e-5`` written in YAML: PyYAML (YAML 1.1) reads it as a string, so float fields take it as a number."""
    if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
        return float(value.replace("_", ""))
    return None


# -- the loader: walk data against dataclass fields -----------------------------------------------------------


class _Invalid(Exception):
    """A value that does not fit its field; carries the dotted path relative to where the walk started."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is Any:
        return "anything"
    if origin is Literal:
        return "one of " + ", ".join(_show(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin is dict or tp is dict:
        return "a mapping"
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, value: Any, path: str) -> Any:
    """``value`` checked (and, for nested dataclasses, built) as type ``tp``; raises :class:`_Invalid`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        # `True == 1` in Python: compare types too, so `zero_stage: true` is not stage 1.
        if not any(value == c and type(value) is type(c) for c in choices):
            raise _Invalid(path, f"expected {_describe(tp)}, got {_show(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        members = get_args(tp)
        if value is None:
            if type(None) in members:
                return None
            raise _Invalid(path, f"expected {_describe(tp)}, got null")
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return _convert(member, value, path)
            except _Invalid as exc:
                errors.append(exc)
        # One non-null member (the usual `X | None`): its own message is the most precise.
        if len(errors) == 1:
            raise errors[0]
        raise _Invalid(path, f"expected {_describe(tp)}, got {_show(value)}")
    if tp is type(None):
        if value is not None:
            raise _Invalid(path, f"expected null, got {_show(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise _Invalid(path, f"expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(path, f"expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if (number := _float_text(value)) is not None:
            return number
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Invalid(path, f"expected a number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _Invalid(path, f"expected a string, got {_show(value)}")
        return value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _Invalid(path, f"expected a mapping, got {_show(value)}")
        key_tp, val_tp = get_args(tp) or (str, Any)
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise _Invalid(_join(path, str(k)), f"keys must be strings, got {_show(k)}")
            out[k] = _convert(val_tp, v, _join(path, str(k)))
        return out
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list):
            raise _Invalid(path, f"expected a list, got {_show(value)}")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_convert(item_tp, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    raise TypeError(f"recipe loader: unsupported field type {tp!r} at {path}")  # a bug in hfscale, not the recipe


def _reject_unknown(data: dict[str, Any], known: typing.Iterable[str], path: str) -> None:
    known = list(known)
    for key in data:
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _Invalid(
                _join(path, str(key)),
                f"unknown key{hint}; valid keys here are {', '.join(sorted(known))}",
            )


def _build(cls: type, data: Any, path: str, **extra: Any) -> Any:
    """An instance of dataclass ``cls`` from a mapping: unknown keys rejected, each field converted by its type,
    and the class's own validation (``__post_init__``) reported at ``path``."""
    if not isinstance(data, dict):
        raise _Invalid(path, f"expected a mapping, got {_show(data)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _reject_unknown(data, [n for n in fields if n not in extra], path)
    kwargs = dict(extra)
    for key, value in data.items():
        kwargs[key] = _convert(hints[key], value, _join(path, key))
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise _Invalid(path, f"missing required key(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # StrategyError included: the dataclass's own cross-field checks
        raise _Invalid(path, str(exc)) from exc


# -- trials, defaults and the matrix --------------------------------------------------------------------------

_STRATEGY_FIELDS = [f.name for f in dataclasses.fields(Strategy)]
_NESTED = {"deepspeed": DeepSpeedSpec, "fsdp": FsdpSpec}
# A trial entry is Strategy fields plus these per-trial overrides; `device` is the recipe's.
_TRIAL_EXTRAS = ("measure", "run", "training_args")
_TOP_KEYS = (
    "name",
    "description",
    "device",
    "model",
    "data",
    "training_args",
    "measure",
    "run",
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
        raise _Invalid(path, f"unknown key{hint}; valid keys here are {', '.join(sorted(valid))}")
    if not tail:
        return _hints(Strategy)[head]
    if head not in _NESTED:
        raise _Invalid(path, f"{head!r} has no fields; use `{head}: [...]`")
    nested = _hints(_NESTED[head])
    if tail not in nested:
        close = difflib.get_close_matches(tail, list(nested), n=1)
        hint = f" (did you mean {head}.{close[0]}?)" if close else ""
        raise _Invalid(path, f"unknown key{hint}; valid keys of {head} are {', '.join(sorted(nested))}")
    return nested[tail]


def _check_partial_strategy(data: dict[str, Any], path: str, *, also_valid: tuple[str, ...] = ()) -> None:
    """Type-check Strategy fields given on their own (defaults, a trial before merging); nested sections partially."""
    for key, value in data.items():
        key_path = _join(path, key)
        if key == "device":
            raise _Invalid(key_path, "the device is set once, at the top of the recipe (`device: cuda|cpu`)")
        if key == "name":
            raise _Invalid(key_path, "each trial has its own name; set it in the trial")
        if key in _NESTED and isinstance(value, dict):
            nested_hints = _hints(_NESTED[key])
            _reject_unknown(value, nested_hints, key_path)
            for sub, sub_value in value.items():
                _convert(nested_hints[sub], sub_value, _join(key_path, sub))
            continue
        _convert(_strategy_field_type(key, key_path, also_valid=also_valid), value, key_path)


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
    except _Invalid as exc:
        where = f"{source}: {exc.path}: " if exc.path else f"{source}: "
        raise RecipeError(where + exc.message) from None


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Load and validate a recipe file.

    Raises:
        FileNotFoundError: when the file does not exist.
        RecipeError: when it is not valid YAML or not a valid recipe; the message names the file and key path.
    """
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{path}: is a folder, not a recipe file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    return parse_recipe(data, source=str(path), default_name=path.stem)


def _parse(data: Any, *, default_name: str, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise _Invalid("", f"expected a mapping at the top level, got {_show(data)}")
    _reject_unknown(data, _TOP_KEYS, "")
    name = _convert(str, data.get("name", default_name), "name")
    description = _convert(str, data.get("description", ""), "description")
    device = _convert(_hints(Recipe)["device"], data.get("device", "cuda"), "device")
    model = _build(ModelSpec, data.get("model") or {}, "model")
    data_spec = _build(DataSpec, data.get("data") or {}, "data")
    measure_raw = data.get("measure") or {}
    measure = _build(MeasureSpec, measure_raw, "measure")
    _check_measure(measure, "measure")
    run_raw = data.get("run") or {}
    run = _build(RunSpec, run_raw, "run")
    training_args = _convert(dict[str, Any], data.get("training_args") or {}, "training_args")
    training_args = _check_training_args(training_args)

    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise _Invalid("defaults", f"expected a mapping of strategy fields, got {_show(defaults)}")
    _check_partial_strategy(defaults, "defaults")
    defaults = _undot(defaults)

    # (source path, name or None, strategy fields, measure overrides, run overrides, ordered items for naming)
    entries: list[tuple[str, str | None, dict[str, Any], dict[str, Any], dict[str, Any], list[tuple[str, Any]]]] = []
    trial_training_args: dict[str, dict[str, Any]] = {}  # per-trial `training_args:` overrides, by source path
    raw_trials = data.get("trials") or []
    if not isinstance(raw_trials, list):
        raise _Invalid("trials", f"expected a list of trials, got {_show(raw_trials)}")
    for i, raw in enumerate(raw_trials):
        path = _join("trials", i)
        if not isinstance(raw, dict):
            raise _Invalid(path, f"expected a mapping of strategy fields, got {_show(raw)}")
        raw = dict(raw)
        trial_name = raw.pop("name", None)
        if trial_name is not None:
            _convert(str, trial_name, _join(path, "name"))
        measure_over = raw.pop("measure", None) or {}
        run_over = raw.pop("run", None) or {}
        args_over = raw.pop("training_args", None) or {}
        for key, over in (("measure", measure_over), ("run", run_over), ("training_args", args_over)):
            if not isinstance(over, dict):
                raise _Invalid(_join(path, key), f"expected a mapping, got {_show(over)}")
        if args_over:
            trial_training_args[path] = _check_training_args(args_over, _join(path, "training_args"))
        _check_partial_strategy(raw, path, also_valid=("name", *_TRIAL_EXTRAS))
        entries.append((path, trial_name, _undot(raw), measure_over, run_over, list(raw.items())))

    matrix = data.get("matrix")
    if matrix is not None:
        entries += _expand_matrix(matrix)
    if not entries:
        raise _Invalid("", "no trials: give a `trials:` list and/or a `matrix:` of strategy axes")

    trials: list[RecipeTrial] = []
    seen: dict[str, str] = {}
    for path, trial_name, fields_, measure_over, run_over, items in entries:
        name_ = trial_name or _auto_name(items)
        args_over = trial_training_args.get(path, {})
        if path.startswith("matrix"):
            path = f"matrix[{name_}]"
        if name_ in seen:
            raise _Invalid(path, f"duplicate trial name {name_!r} (also {seen[name_]}); give each trial a unique name")
        seen[name_] = path
        merged = _merge(defaults, fields_)
        pinned = frozenset(k for k in ("num_processes", "num_machines") if k in merged)
        strategy = _build(Strategy, {**merged, "name": name_}, path, device=device)
        trial_measure = _build(MeasureSpec, {**measure_raw, **measure_over}, _join(path, "measure"))
        run_merged = {**run_raw, **run_over}
        if isinstance(run_raw.get("env"), dict) and isinstance(run_over.get("env"), dict):
            run_merged["env"] = {**run_raw["env"], **run_over["env"]}
        trial_run = _build(RunSpec, run_merged, _join(path, "run"))
        _check_measure(trial_measure, _join(path, "measure"))
        spec = TrialSpec(
            name=name_,
            strategy=strategy,
            model=model,
            data=data_spec,
            training_args={**training_args, **args_over},
            measure=trial_measure,
        )
        trials.append(RecipeTrial(spec=spec, run=trial_run, pinned=pinned, source=path))

    baseline = data.get("baseline", trials[0].name)
    _convert(str, baseline, "baseline")
    if baseline not in seen:
        raise _Invalid("baseline", f"{baseline!r} is not a trial; trials are {', '.join(seen)}")
    return Recipe(
        name=name,
        description=description,
        device=device,
        model=model,
        data=data_spec,
        training_args=training_args,
        measure=measure,
        run=run,
        baseline=baseline,
        trials=tuple(trials),
        path=source,
    )


def _expand_matrix(matrix: Any) -> list[tuple[str, None, dict[str, Any], dict[str, Any], dict[str, Any], list]]:
    if not isinstance(matrix, dict) or not matrix:
        raise _Invalid("matrix", f"expected a mapping of strategy field -> list of values, got {_show(matrix)}")
    axes: list[tuple[str, list[Any]]] = []
    for key, values in matrix.items():
        path = _join("matrix", str(key))
        if not isinstance(key, str):
            raise _Invalid(path, "axis names must be strings")
        if not isinstance(values, list) or not values:
            raise _Invalid(path, f"expected a non-empty list of values, got {_show(values)}")
        tp = _strategy_field_type(key, path)
        for i, value in enumerate(values):
            value_path = _join(path, i)
            if key in _NESTED and isinstance(value, dict):
                nested_hints = _hints(_NESTED[key])
                _reject_unknown(value, nested_hints, value_path)
                for sub, sub_value in value.items():
                    _convert(nested_hints[sub], sub_value, _join(value_path, sub))
            else:
                _convert(tp, value, value_path)
        axes.append((key, values))
    entries = []
    for combo in itertools.product(*(values for _, values in axes)):
        fields_: dict[str, Any] = {}
        items = []
        for (key, _), value in zip(axes, combo, strict=True):
            fields_ = _set_dotted(fields_, key, value)
            items.append((key, value))
        entries.append(("matrix", None, fields_, {}, {}, items))
    return entries


def _check_measure(measure: MeasureSpec, path: str) -> None:
    """Range checks for :class:`~hfscale.spec.MeasureSpec` (the dataclass itself only holds the values)."""
    if measure.warmup_steps < 0:
        raise _Invalid(_join(path, "warmup_steps"), f"expected 0 or more, got {measure.warmup_steps}")
    if measure.max_steps is not None and measure.max_steps < 1:
        raise _Invalid(_join(path, "max_steps"), f"expected a positive integer or null, got {measure.max_steps}")
    if measure.num_epochs <= 0:
        raise _Invalid(_join(path, "num_epochs"), f"expected a positive number, got {measure.num_epochs}")
    if measure.repeats < 1:
        raise _Invalid(_join(path, "repeats"), f"expected a positive integer, got {measure.repeats}")
    if measure.timeout_s <= 0:
        raise _Invalid(_join(path, "timeout_s"), f"expected a positive number of seconds, got {measure.timeout_s}")


def _check_training_args(training_args: dict[str, Any], path: str = "training_args") -> dict[str, Any]:
    """The recipe's (or one trial's, at ``path``) ``training_args`` checked against what the strategy owns and what
    ``TrainingArguments`` has; numbers written as ``5e-5`` (a string to PyYAML) become floats where the field is a
    float."""
    for key in training_args:
        if key in OWNED_TRAINING_ARGS:
            raise _Invalid(
                _join(path, key),
                f"set by {OWNED_TRAINING_ARGS[key]}, not by training_args (it would be overridden)",
            )
    known = _training_args_fields()
    if known is None:
        return dict(training_args)
    out = {}
    for key, value in training_args.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _Invalid(_join(path, key), f"not a transformers.TrainingArguments field{hint}")
        number = _float_text(value)
        out[key] = number if number is not None and known[key] else value
    return out


def _training_args_fields() -> dict[str, bool] | None:
    """``TrainingArguments``' field names (-> whether the field takes a float), or None when transformers is not
    installed (the trial then checks them)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return None
    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.init:
            tp = f.type
            out[f.name] = tp is float or (get_origin(tp) in (typing.Union, types.UnionType) and float in get_args(tp))
    return out


__all__ = [
    "OWNED_TRAINING_ARGS",
    "Recipe",
    "RecipeError",
    "RecipeTrial",
    "RunSpec",
    "load_recipe",
    "parse_recipe",
]
