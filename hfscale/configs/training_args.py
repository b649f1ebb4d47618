"""Strategy -> keyword arguments for ``transformers.TrainingArguments``.

Only what the strategy decides is here (precision, checkpointing, optimizer, batch, DeepSpeed/FSDP, device);
learning rate, logging and the rest come from the recipe and are merged under these by the caller.
"""

from __future__ import annotations

import functools
from typing import Any

from hfscale.configs.fsdp import fsdp_by_accelerate, fsdp_training_args
from hfscale.strategy import Strategy
from hfscale.workload.arguments import average_tokens_across_devices


@functools.cache
def _checkpointing_names() -> tuple[str, str]:
    """``activation_checkpointing`` since transformers 5 renamed it; ``gradient_checkpointing`` before (the old
    name is a deprecated alias that warns on every construction)."""
    try:
        from transformers import TrainingArguments
    except ImportError:  # generating configs does not need transformers; the trial does.
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def training_args_kwargs(
    strategy: Strategy,
    *,
    deepspeed_config_path: str | None = None,
    transformer_layer_cls: str | None = None,
) -> dict[str, Any]:
    """The strategy's share of ``TrainingArguments(output_dir=..., **kwargs)``.

    Args:
        strategy: the strategy.
        deepspeed_config_path: where :func:`hfscale.configs.deepspeed.deepspeed_config` was written; required when
            the strategy uses DeepSpeed (a dict would do for the Trainer, but a file is what a user reruns).
        transformer_layer_cls: FSDP block class to wrap, overriding ``strategy.fsdp.transformer_layer_cls``.

    Raises:
        ValueError: when the strategy uses DeepSpeed and no config path is given, or the reverse.
    """
    if strategy.deepspeed is not None and deepspeed_config_path is None:
        raise ValueError("training_args_kwargs: the strategy uses DeepSpeed, pass deepspeed_config_path")
    if strategy.deepspeed is None and deepspeed_config_path is not None:
        raise ValueError("training_args_kwargs: deepspeed_config_path given, but the strategy uses no DeepSpeed")
    ckpt, ckpt_kwargs = _checkpointing_names()
    kwargs: dict[str, Any] = {
        "bf16": strategy.precision == "bf16",
        "fp16": strategy.precision == "fp16",
        "per_device_train_batch_size": strategy.per_device_batch_size,
        "gradient_accumulation_steps": strategy.gradient_accumulation_steps,
        # On CPU this also makes multi-process runs use gloo DDP (accelerate's MULTI_GPU launcher on CPU).
        "use_cpu": strategy.device == "cpu",
    }
    if strategy.optimizer is not None:
        # Unset, the Trainer's own default runs (what a user who names none gets); the verification records it.
        kwargs["optim"] = strategy.optimizer
    # With accelerate's FSDP, checkpointing is FSDP's own (fsdp_config.activation_checkpointing); the Trainer refuses
    # both. Where transformers shards the model itself, the Trainer's is the one there is.
    model_ckpt = strategy.gradient_checkpointing and not fsdp_by_accelerate(strategy)
    kwargs[ckpt] = model_ckpt
    if model_ckpt:
        # Non-reentrant checkpointing works with frozen inputs, DDP and ZeRO-3; reentrant is the legacy default.
        kwargs[ckpt_kwargs] = {"use_reentrant": False}
    if strategy.deepspeed is not None:
        kwargs["deepspeed"] = str(deepspeed_config_path)
    kwargs |= fsdp_training_args(strategy, transformer_layer_cls=transformer_layer_cls)
    kwargs |= _kernel_training_args(strategy)
    if strategy.distributed:
        # Off, else a classifier's logged loss is the sum over ranks (measured: x world size); on under tp for a causal
        # LM, else its loss is tp times too large (hfscale.workload.arguments.average_tokens_across_devices). The
        # model is not known here: a causal LM is assumed, and `hfscale config` says so under tp.
        kwargs["average_tokens_across_devices"] = average_tokens_across_devices(strategy, task="causal_lm")
    return kwargs


def _kernel_training_args(strategy: Strategy) -> dict[str, Any]:
    """``torch_compile*``, ``tf32`` and ``use_liger_kernel``; the attention implementation goes to the model
    (:func:`hfscale.workload.model.build_model`), not to ``TrainingArguments``."""
    kwargs: dict[str, Any] = {}
    if strategy.torch_compile is not None:
        kwargs |= {
            "torch_compile": True,
            "torch_compile_backend": strategy.torch_compile.backend,
            "torch_compile_mode": strategy.torch_compile.mode,
        }
    if strategy.tf32 or (strategy.torch_compile is not None and strategy.device == "cuda"):
        # Unset, transformers turns TF32 on by itself whenever torch_compile runs on an Ampere or newer GPU
        # (training_args.py, "TF32"), so a compiled fp32 row would silently use TF32: say it either way.
        kwargs["tf32"] = strategy.tf32
    if strategy.use_liger_kernel:
        kwargs["use_liger_kernel"] = True
    return kwargs


__all__ = ["training_args_kwargs"]
