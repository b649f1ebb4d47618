"""DeepSpeed activation checkpointing for a Hugging Face model: ``deepspeed.checkpointing``, installed as the model's
checkpoint function and configured from the DeepSpeed JSON's ``activation_checkpointing`` section.

The section (``partition_activations``, ``cpu_checkpointing``, ...) configures ``deepspeed.checkpointing``, which a
Hugging Face model never calls: transformers checkpoints its layers with ``torch.utils.checkpoint``, so the section
alone changes nothing. :func:`use_deepspeed_checkpointing` installs ``deepspeed.checkpointing.checkpoint``,
configured from that section by DeepSpeed's own parser, as the model's checkpoint function
(``PreTrainedModel._set_gradient_checkpointing``, the hook ``activation_checkpointing_enable`` itself uses), at train
begin: the Trainer enables its own function inside ``train()``, and a function set before would be replaced.

Part of the activation technique (:mod:`hfscale.techniques.activation_offload` applies, reads back and checks it,
and re-exports what a user's script imports).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger(__name__)

DS_OPTIONS: tuple[str, ...] = ("partition_activations", "cpu_checkpointing")
"""The DeepSpeed activation-checkpointing options a strategy states (``DeepSpeedSpec``), in DeepSpeed's names."""


def deepspeed_checkpoint_function(ds_config: dict[str, Any]) -> Any:
    """``deepspeed.checkpointing.checkpoint``, configured from ``ds_config``'s ``activation_checkpointing`` section.

    The section is read by DeepSpeed's own parser (``DeepSpeedActivationCheckpointingConfig``); DeepSpeed keeps the
    settings process-wide. Needs a started process group (DeepSpeed reads the rank).

    Raises:
        ImportError: without deepspeed (``pip install 'hfscale[deepspeed]'``).
    """
    try:
        import deepspeed
        from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
    except ImportError as exc:  # pragma: no cover - the deepspeed extra is installed in CI
        raise ImportError(
            "DeepSpeed activation checkpointing needs deepspeed: pip install 'hfscale[deepspeed]'"
        ) from exc
    section = DeepSpeedActivationCheckpointingConfig(ds_config)
    if section.cpu_checkpointing and not section.partition_activations and _on_cpu():
        raise ValueError(
            "deepspeed activation_checkpointing.cpu_checkpointing without partition_activations fails on a CPU "
            "device (deepspeed 0.19.8 'copies' the checkpoint input to the CPU, a no-op there, then empties the "
            "input it meant to keep): add partition_activations, which on one model-parallel rank keeps the whole "
            "input, copied into CPU memory"
        )
    deepspeed.checkpointing.configure(
        None,
        partition_activations=section.partition_activations,
        contiguous_checkpointing=section.contiguous_memory_optimization,
        num_checkpoints=section.number_checkpoints,
        checkpoint_in_cpu=section.cpu_checkpointing,
        synchronize=section.synchronize_checkpoint_boundary,
        profile=section.profile,
    )
    return _tensor_arguments_only(deepspeed.checkpointing.checkpoint)


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def _tensor_arguments_only(ds_checkpoint: Any) -> Any:
    """``ds_checkpoint`` called with the tensor positional arguments only, the others bound into the function.

    Hugging Face layers pass ``None`` positionally (BERT's ``encoder_hidden_states``), and DeepSpeed's
    ``partition_activations`` path miscounts non-tensor arguments when it rebuilds them for the backward pass
    ("forward() got multiple values for argument", deepspeed 0.19.8). Only the non-tensor values are kept here,
    never the tensors, so DeepSpeed alone decides where the checkpointed inputs live.

    The returned function counts its calls (``calls``): verification reports DeepSpeed's options only once a
    checkpointed layer really went through it.
    """

    @functools.wraps(ds_checkpoint)
    def checkpoint(function: Any, *args: Any) -> Any:
        import torch

        checkpoint.calls += 1  # type: ignore[attr-defined]
        positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        if len(positions) == len(args):
            return ds_checkpoint(function, *args)
        template = [None if torch.is_tensor(a) else a for a in args]

        def run(*tensors: Any) -> Any:
            full = list(template)
            for i, tensor in zip(positions, tensors, strict=True):
                full[i] = tensor
            return function(*full)

        return ds_checkpoint(run, *(args[i] for i in positions))

    checkpoint.calls = 0  # type: ignore[attr-defined]
    return checkpoint


def install_deepspeed_checkpointing(model: Any, ds_config: dict[str, Any]) -> None:
    """Make ``model``'s checkpointed layers call DeepSpeed's checkpoint function (configured from ``ds_config``).

    Raises:
        ValueError: when the model has no checkpointing enabled (the Trainer's ``gradient_checkpointing``).
    """
    if not getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False)):
        raise ValueError(
            "DeepSpeed activation checkpointing replaces the function of checkpointed layers, and this model "
            "checkpoints none: set TrainingArguments(gradient_checkpointing=True)"
        )
    function = deepspeed_checkpoint_function(ds_config)
    # The hook activation_checkpointing_enable uses; it keeps which layers are checkpointed (every_n_layers).
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = function
    logger.info("checkpointed layers run deepspeed.checkpointing.checkpoint (%s)", deepspeed_options_in_use())


def use_deepspeed_checkpointing(trainer: Trainer) -> None:
    """Make ``trainer``'s model checkpoint with ``deepspeed.checkpointing``, configured from the DeepSpeed JSON.

    Adds a callback that installs the function at train begin (after the Trainer enabled its own). Needs
    ``TrainingArguments(deepspeed=..., gradient_checkpointing=True)``.

    Raises:
        ValueError: when the Trainer's arguments name no DeepSpeed config.
    """
    if getattr(trainer.args, "hf_deepspeed_config", None) is None:
        raise ValueError(
            "use_deepspeed_checkpointing: TrainingArguments has no DeepSpeed config (deepspeed=...); the "
            "activation_checkpointing section is read from it"
        )
    trainer.add_callback(_deepspeed_checkpointing_callback())


def _deepspeed_checkpointing_callback() -> Any:
    from transformers import TrainerCallback

    class DeepSpeedCheckpointingCallback(TrainerCallback):
        """Installs DeepSpeed's checkpoint function at train begin (:func:`use_deepspeed_checkpointing`)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            install_deepspeed_checkpointing(model, args.hf_deepspeed_config.config)

    return DeepSpeedCheckpointingCallback()


def deepspeed_options_in_use() -> list[str]:
    """The :data:`DS_OPTIONS` that ``deepspeed.checkpointing`` has turned on in this process."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    flags = {
        "partition_activations": checkpointing.PARTITION_ACTIVATIONS,
        "cpu_checkpointing": checkpointing.CPU_CHECKPOINT,
    }
    return [name for name in DS_OPTIONS if flags[name]]


def deepspeed_checkpoint_calls(model: Any) -> int | None:
    """How many times the model's checkpointed layers called DeepSpeed's function (through the counting wrapper
    of :func:`_tensor_arguments_only`); None when no layer is checkpointed or one does not call DeepSpeed's."""
    functions = [
        m._gradient_checkpointing_func
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")
    ]
    if not functions:
        return None
    try:
        from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint as ds_checkpoint
    except ImportError:
        return None
    unwrapped = {id(f): f for f in (f.func if isinstance(f, functools.partial) else f for f in functions)}
    if not all(getattr(f, "__wrapped__", f) is ds_checkpoint for f in unwrapped.values()):
        return None
    return sum(int(getattr(f, "calls", 0)) for f in unwrapped.values())


__all__ = [
    "DS_OPTIONS",
    "deepspeed_checkpoint_calls",
    "deepspeed_checkpoint_function",
    "deepspeed_options_in_use",
    "install_deepspeed_checkpointing",
    "use_deepspeed_checkpointing",
]
