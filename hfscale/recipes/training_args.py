"""Which ``TrainingArguments`` keywords a recipe may set (the strategy and the runner own the others), and that each
value has its field's type: a recipe's ``training_args`` and a trial's, checked before anything runs. Every check
raises :class:`hfscale.core.validation.Invalid` at the dotted key it is about.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import operator
import types
import typing
from collections.abc import Collection
from typing import Any, Literal, get_args, get_origin

from hfscale.configs import training_args_kwargs
from hfscale.core.validation import Invalid, convert, float_text, join_path
from hfscale.workload.arguments import trial_training_args

if typing.TYPE_CHECKING:
    from hfscale.workload.spec import TrialSpec

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
    "average_tokens_across_devices": (
        "hfscale for multi-process trials (the loss is neither summed over ranks nor scaled by a device mesh's tp)"
    ),
    "max_steps": "the recipe's measure.max_steps",
    "num_train_epochs": "the recipe's measure.num_epochs",
    "output_dir": "the sweep (each trial writes into its own folder)",
    "torch_compile": "the strategy's torch_compile section",
    "torch_compile_backend": "the strategy's torch_compile.backend",
    "torch_compile_mode": "the strategy's torch_compile.mode",
    "tf32": "the strategy's tf32",
    "use_liger_kernel": "the strategy's use_liger_kernel",
}

# TrainingArguments keywords a recipe may not turn on, and why.
REFUSED_TRAINING_ARGS: dict[str, str] = {
    "auto_find_batch_size": (
        "refused: after an out-of-memory error the Trainer halves the batch and trains again, so the row would be "
        "measured at a batch other than the strategy's (and the callbacks restart, losing the OOM); search for the "
        "largest batch that fits with `hfscale sweep --find-max-batch` instead"
    ),
}


# Values a recipe's `training_args` may not give, and why: the runner's own keywords make them fail.
REFUSED_TRAINING_VALUES: dict[tuple[str, str], str] = {
    ("lr_scheduler_type", name): (
        f"refused: {name} steps on evaluation metrics, and a trial never evaluates (the trial runner sets "
        "eval_strategy 'no' over the recipe's); use a schedule of the step count (linear, cosine, constant, ...)"
    )
    for name in ("reduce_lr_on_plateau", "greedy")
}


def check_training_args(training_args: dict[str, Any], path: str = "training_args") -> dict[str, Any]:
    """The recipe's (or one trial's, at ``path``) ``training_args`` checked against what the strategy owns and what
    ``TrainingArguments`` has; numbers written as ``5e-5`` (a string to PyYAML) become floats where the field is a
    float.

    A value of a field whose type is a plain one (a number, a flag, a string, one of an enum's names) is checked
    against it here: ``TrainingArguments`` itself takes ``learning_rate: abc``, and the trial failed only when the
    optimizer was built, a crashed row instead of this message."""
    for key, value in training_args.items():
        if key == "seed" and (isinstance(value, bool) or not isinstance(value, int)):
            raise Invalid(join_path(path, key), f"expected an integer, got {value!r}")
        if key in REFUSED_TRAINING_ARGS and value:
            raise Invalid(join_path(path, key), REFUSED_TRAINING_ARGS[key])
        if isinstance(value, str) and (key, value) in REFUSED_TRAINING_VALUES:
            raise Invalid(join_path(path, key), REFUSED_TRAINING_VALUES[key, value])
        if key in OWNED_TRAINING_ARGS:
            raise Invalid(
                join_path(path, key),
                f"set by {OWNED_TRAINING_ARGS[key]}, not by training_args (it would be overridden)",
            )
    known = _training_args_fields()
    out = {}
    for key, value in training_args.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise Invalid(join_path(path, key), f"not a transformers.TrainingArguments field{hint}")
        field_type = known[key]  # null passes: the Trainer reads some float fields' None as "off" (max_grad_norm)
        if value is False and _takes_no(field_type):
            value = "no"  # YAML 1.1 reads `save_strategy: no` as false; TrainingArguments wants the name
        checked = value if field_type is None or value is None else convert(field_type, value, join_path(path, key))
        out[key] = checked if float_text(value) is not None else value
    return out


def check_trainer_accepts(spec: TrialSpec, path: str, *, trial_keys: Collection[str] | None = None) -> None:
    """The trial's ``TrainingArguments`` keywords (the recipe's under the strategy's, under the runner's) through
    ``TrainingArguments``' own checks of their values and combinations, before anything runs.

    :func:`check_training_args` passes ``logging_steps: 0`` or ``dataloader_prefetch_factor`` without workers, which
    ``TrainingArguments`` refuses only when it is built: inside the trial, a crashed row per trial instead of this
    message. The arguments are built here up to the point where they would place themselves on a device (on a
    machine that need not have the trial's device, and without setting up accelerate's state in this process):
    every check of the keywords a recipe may set comes before it (what follows reads the strategy's: TF32, FSDP,
    DeepSpeed).

    ``path`` is the section the arguments are written in; where it is a trial's, ``trial_keys`` are those the trial
    writes itself, and a null it does not write is named under the recipe's ``training_args``.
    """
    config_path = "deepspeed.json" if spec.strategy.deepspeed is not None else None  # not read before a device
    kwargs = trial_training_args(spec, training_args_kwargs(spec.strategy, deepspeed_config_path=config_path))
    kwargs["use_cpu"] = True  # bf16 is refused off CPU where this machine has no GPU, whatever the trial's has
    refused = _refusal(kwargs)
    if refused is None:
        return
    null = _null_that_fails(spec.training_args, kwargs, refused) if isinstance(refused, TypeError) else None
    if null is not None:
        section = path if trial_keys is None or null in trial_keys else "training_args"
        raise Invalid(
            join_path(section, null),
            f"null, where transformers.TrainingArguments needs a value ({refused}): give one, or leave the key out "
            "for its default",
        )
    what = str(refused) if isinstance(refused, ValueError) else f"{type(refused).__name__}: {refused}"
    raise Invalid(path, f"transformers.TrainingArguments refuses the trial's arguments: {what}")


def _refusal(kwargs: dict[str, Any]) -> Exception | None:
    """What ``TrainingArguments(**kwargs)`` raises before it would place itself on a device, or None. Any exception
    (a missing accelerator_config file too): the trial would raise it."""
    try:
        _unplaced_arguments()(output_dir="unused", **kwargs)
    except _Placed:
        return None
    except Exception as exc:
        return exc
    return None


def _null_that_fails(training_args: dict[str, Any], kwargs: dict[str, Any], refused: Exception) -> str | None:
    """The first key given null without which ``kwargs`` are no longer ``refused`` as they were (``logging_steps:
    null`` is compared with a number): they pass, or fail otherwise (another null, another refusal). None where no
    null is the cause. Nulls pass the type check on purpose (the Trainer reads ``max_grad_norm: null`` as off), so
    only taking one out tells the null that fails from one the Trainer takes."""
    for key, value in training_args.items():
        if value is None and key in kwargs and kwargs[key] is None:
            after = _refusal({k: v for k, v in kwargs.items() if k != key})
            if after is None or type(after) is not type(refused) or str(after) != str(refused):
                return key
    return None


class _Placed(Exception):
    """Raised where ``TrainingArguments`` would place itself on a device: its own checks have passed."""


@functools.cache
def _unplaced_arguments() -> type:
    """``TrainingArguments`` that raise :class:`_Placed` instead of setting up a device."""
    from transformers import TrainingArguments

    def placed(self: Any) -> Any:
        raise _Placed

    return type(
        "UnplacedTrainingArguments",
        (TrainingArguments,),
        {"device": property(placed), "_setup_devices": property(placed)},
    )


def _training_args_fields() -> dict[str, Any]:
    """``TrainingArguments``' field names, each with the type its value is checked against (None: not checked here,
    as a mapping or a list is)."""
    from transformers import TrainingArguments

    return {f.name: _plain_type(f.type) for f in dataclasses.fields(TrainingArguments) if f.init}


_PLAIN = (int, float, bool, str, type(None))


def _takes_no(field_type: Any) -> bool:
    """Whether the field is one of an enum's names and ``"no"`` is one of them (``IntervalStrategy``)."""
    members = get_args(field_type) if get_origin(field_type) in (typing.Union, types.UnionType) else (field_type,)
    return any(get_origin(m) is Literal and "no" in get_args(m) for m in members)


def _plain_type(tp: Any) -> Any:
    """``tp`` where each member is a plain type (an enum, which ``TrainingArguments`` takes by value, as the
    ``Literal`` of its values; ``SchedulerType | str`` is one of the scheduler names), else None."""
    members = get_args(tp) if get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
    if not all(m in _PLAIN or m in enums for m in members):
        return None
    if enums:
        values = tuple(e.value for m in enums for e in m)
        members = (Literal[values], *(m for m in members if m is type(None)))  # the str beside the enum is its names
    return functools.reduce(operator.or_, members) if len(members) > 1 else members[0]


__all__ = [
    "OWNED_TRAINING_ARGS",
    "REFUSED_TRAINING_ARGS",
    "REFUSED_TRAINING_VALUES",
    "check_trainer_accepts",
    "check_training_args",
]
