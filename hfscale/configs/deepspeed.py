"""Strategy -> DeepSpeed ZeRO JSON, in the shape the Hugging Face Trainer fills in.

Values the Trainer knows (batch sizes, gradient clipping, precision, learning rate) are written as ``"auto"``:
``transformers.integrations.HfTrainerDeepSpeedConfig`` replaces each with the ``TrainingArguments`` value, so the
JSON and the arguments cannot disagree. Bucket sizes that depend on the model's hidden size are ``"auto"`` too and
are filled once the model is known.

The optimizer is left to the Trainer (its ``optim``), except under ZeRO-Offload: DeepSpeed refuses a client
optimizer there ("You are using ZeRO-Offload with a client provided optimizer ..."), so the JSON names DeepSpeed's
AdamW, which it runs as its CPU Adam. :class:`hfscale.strategy.Strategy` rejects optimizers that would be silently
replaced that way.
"""

from __future__ import annotations

from typing import Any

from hfscale.strategy import DeepSpeedSpec, Strategy

# DeepSpeed prints a line every `steps_per_print` steps; the Trainer logs on its own.
_STEPS_PER_PRINT = 1_000_000


def _offload_section(device: str, spec: DeepSpeedSpec, *, pin_memory: bool) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        section["nvme_path"] = spec.nvme_path
    return section


def zero_optimization(strategy: Strategy) -> dict[str, Any]:
    """The ``zero_optimization`` section alone (also what accelerate's YAML would embed)."""
    spec = strategy.deepspeed
    if spec is None:
        raise ValueError("zero_optimization: the strategy has no DeepSpeed section")
    # Pinned host memory needs a CUDA runtime; on a CPU-only run torch refuses to pin.
    pin_memory = strategy.device == "cuda"
    zero: dict[str, Any] = {"stage": spec.zero_stage}
    if spec.zero_stage >= 1:
        zero |= {
            "overlap_comm": strategy.device == "cuda",
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
        }
    if spec.zero_stage in (1, 2):
        zero |= {"allgather_partitions": True, "allgather_bucket_size": 200_000_000, "reduce_scatter": True}
    if spec.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_section(spec.offload_optimizer, spec, pin_memory=pin_memory)
    if spec.offload_param != "none":
        zero["offload_param"] = _offload_section(spec.offload_param, spec, pin_memory=pin_memory)
    if spec.zero_stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "sub_group_size": 1_000_000_000,
            # Save a consolidated 16-bit state dict, as `Trainer.save_model` expects.
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    return zero


def activation_checkpointing(strategy: Strategy) -> dict[str, Any]:
    """The ``activation_checkpointing`` section: how ``deepspeed.checkpointing.checkpoint`` keeps checkpoints.

    DeepSpeed reads it only through ``deepspeed.checkpointing.configure``, and a Hugging Face model checkpoints
    with ``torch.utils.checkpoint``: the section takes effect only where the model's checkpoint function is
    replaced (``hfscale.techniques.activation_offload.use_deepspeed_checkpointing``, which reads it from this JSON).
    ``contiguous_memory_optimization`` stays off: it needs the number of checkpoints in advance and partitioned
    activations.
    """
    spec = strategy.deepspeed
    if spec is None:
        raise ValueError("activation_checkpointing: the strategy has no DeepSpeed section")
    return {
        "partition_activations": spec.partition_activations,
        "cpu_checkpointing": spec.cpu_checkpointing,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


def deepspeed_config(strategy: Strategy) -> dict[str, Any] | None:
    """The DeepSpeed JSON for ``TrainingArguments(deepspeed=...)``, or None when the strategy uses no DeepSpeed.

    Every value the Trainer owns is ``"auto"``; load it with ``HfTrainerDeepSpeedConfig`` to see the filled-in
    values.
    """
    spec = strategy.deepspeed
    if spec is None:
        return None
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {
            "enabled": "auto",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero_optimization(strategy),
        "steps_per_print": _STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if strategy.device == "cpu" and spec.zero_stage == 3:
        # A script that builds its model after TrainingArguments (the transformers examples do) builds it under
        # zero.Init, which reads this JSON before DeepSpeed's communicator is up on a CPU machine (accelerate only
        # starts it for GPUs), so it sees a world of one and fails DeepSpeed's batch check ("train_batch_size is not
        # equal to micro_batch_per_gpu * gradient_acc_step * world_size 8 != 4 * 1 * 1", measured with deepspeed
        # 0.19.8). Left out, DeepSpeed derives it from the micro batch, the accumulation and the real world size.
        del config["train_batch_size"]
    if spec.offload_optimizer != "none":
        # ZeRO-Offload runs the step on the CPU with DeepSpeed's own Adam; a client optimizer is refused.
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    if spec.partition_activations or spec.cpu_checkpointing:
        config["activation_checkpointing"] = activation_checkpointing(strategy)
    if "nvme" in (spec.offload_optimizer, spec.offload_param):
        # Asynchronous I/O settings for ZeRO-Infinity, DeepSpeed's documented defaults.
        config["aio"] = {
            "block_size": 1_048_576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        }
    return config


__all__ = ["activation_checkpointing", "deepspeed_config", "zero_optimization"]
