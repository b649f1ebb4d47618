"""A recipe's trials as written: the ``trials:`` list and the ``matrix:`` product, type-checked but not yet built.

Everything here is pure: no model config is built and nothing heavy is imported, so reading a finished run's trial
names (:func:`hfscale.recipes.recipe.read_trial_names`) stays cheap. Strategy fields may be written dotted
(``deepspeed.zero_stage: 2``) or nested (``deepspeed: {zero_stage: 2}``); a trial without a name is named from its
fields (``zero2-bf16``).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from dataclasses import dataclass, field
from typing import Any

from hfscale.core.validation import Invalid, convert, field_types, given, join_path, reject_unknown, show_value
from hfscale.recipes.schema import BatchMode
from hfscale.strategy import CompileSpec, DeepSpeedSpec, FsdpSpec, LoraSpec, ParallelismSpec, Strategy

_STRATEGY_FIELDS = [f.name for f in dataclasses.fields(Strategy)]
_NESTED: dict[str, type] = {
    "deepspeed": DeepSpeedSpec,
    "fsdp": FsdpSpec,
    "torch_compile": CompileSpec,
    "lora": LoraSpec,
    "parallelism": ParallelismSpec,
}
# A trial entry is Strategy fields plus these per-trial overrides; `device` is the recipe's.
_TRIAL_EXTRAS = ("measure", "run", "training_args", "batch", "script_args")


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


def check_partial_strategy(data: dict[str, Any], path: str, *, also_valid: tuple[str, ...] = ()) -> None:
    """Type-check Strategy fields given on their own (defaults, a trial before merging); nested sections partially."""
    for key, value in data.items():
        key_path = join_path(path, key)
        if key == "device":
            raise Invalid(key_path, "the device is set once, at the top of the recipe (`device: cuda|cpu`)")
        if key == "name":
            raise Invalid(key_path, "each trial has its own name; set it in the trial")
        if key in _NESTED and isinstance(value, dict):
            _check_nested(key, value, key_path)
            continue
        convert(_strategy_field_type(key, key_path, also_valid=also_valid), value, key_path)


def _check_nested(section: str, value: dict[str, Any], path: str) -> None:
    """Type-check a nested section (``deepspeed: {...}``) given partially: its keys are known, its values typed."""
    nested_hints = field_types(_NESTED[section])
    reject_unknown(value, nested_hints, path)
    for sub, sub_value in value.items():
        convert(nested_hints[sub], sub_value, join_path(path, sub))


def undot(data: dict[str, Any]) -> dict[str, Any]:
    """``{"deepspeed.zero_stage": 2}`` -> ``{"deepspeed": {"zero_stage": 2}}`` (trials and defaults may use either)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        out = _set_dotted(out, key, value)
    return out


def merge_fields(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
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
        return merge_fields(data, {head: value})
    current = data.get(head)
    return merge_fields(data, {head: {**(current if isinstance(current, dict) else {}), tail: value}})


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


@dataclass(frozen=True, kw_only=True)
class TrialEntry:
    """One trial as the recipe writes it (an item of ``trials:``, or one combination of ``matrix:``), unmerged."""

    path: str
    """Its key path in error messages: ``trials[2]``, or ``matrix[NAME]`` for a combination of the matrix."""
    name: str
    """As written, or made from its strategy fields (:func:`_auto_name`)."""
    fields: dict[str, Any]
    """Strategy fields, dotted keys unfolded."""
    measure: dict[str, Any] = field(default_factory=dict)
    """Its ``measure:`` overrides, merged over the recipe's when the trial is built."""
    run: dict[str, Any] = field(default_factory=dict)
    """Its ``run:`` overrides, likewise (``run.env`` merges variable by variable)."""
    training_args: dict[str, Any] = field(default_factory=dict)
    """Its ``training_args:`` overrides, likewise."""
    batch: BatchMode | None = None
    """Its own ``batch:``, else None (the recipe's ``sweep.batch``)."""
    script_args: tuple[str, ...] = ()
    """Arguments added after ``workload.args`` for this trial's run of the user's script."""


def trial_entries(raw_trials: Any) -> list[TrialEntry]:
    """The ``trials:`` list, each item type-checked as partial strategy fields plus its per-trial overrides.

    Pure: no model is built and nothing is imported (:func:`hfscale.recipes.recipe.read_trial_names` relies on it).
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
        if trial_name is not None and not convert(str, trial_name, join_path(path, "name")).strip():
            raise Invalid(
                join_path(path, "name"),
                "expected a name, got an empty one (leave the key out to name the trial by its fields)",
            )
        overrides = {key: given(raw, key, {}) for key in ("measure", "run", "training_args")}
        for key in overrides:
            raw.pop(key, None)
        batch = convert(BatchMode, raw.pop("batch"), join_path(path, "batch")) if "batch" in raw else None
        script_args = tuple(convert(list[str], given(raw, "script_args", []), join_path(path, "script_args")))
        raw.pop("script_args", None)
        for key, over in overrides.items():
            if not isinstance(over, dict):
                raise Invalid(join_path(path, key), f"expected a mapping, got {show_value(over)}")
        check_partial_strategy(raw, path, also_valid=("name", *_TRIAL_EXTRAS))
        entries.append(
            TrialEntry(
                path=path,
                name=trial_name or _auto_name(list(raw.items())),
                fields=undot(raw),
                measure=overrides["measure"],
                run=overrides["run"],
                training_args=overrides["training_args"],
                batch=batch,
                script_args=script_args,
            )
        )
    return entries


def expand_matrix(matrix: Any) -> list[TrialEntry]:
    """One entry per combination of the axes, named from its values (``zero2-bf16``); pure, as
    :func:`trial_entries`."""
    if not isinstance(matrix, dict) or not matrix:
        got = "an empty one" if isinstance(matrix, dict) else show_value(matrix)
        raise Invalid("matrix", f"expected a mapping of strategy field -> list of values, got {got}")
    axes: list[tuple[str, list[Any]]] = []
    for key, values in matrix.items():
        path = join_path("matrix", str(key))
        if not isinstance(key, str):
            raise Invalid(path, "axis names must be strings")
        if not isinstance(values, list) or not values:
            raise Invalid(path, f"expected a non-empty list of values, got {show_value(values)}")
        tp = _strategy_field_type(key, path)
        over = next((other for other, _ in axes if key.startswith(other + ".") or other.startswith(key + ".")), None)
        if over is not None:  # one axis would set what the other varies: a trial named for both, running one
            raise Invalid(path, f"overlaps the axis {over!r}: vary a section or its fields, not both")
        for i, value in enumerate(values):
            value_path = join_path(path, i)
            if key in _NESTED and isinstance(value, dict):
                _check_nested(key, value, value_path)
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
        entries.append(TrialEntry(path=f"matrix[{name}]", name=name, fields=fields_))
    return entries
