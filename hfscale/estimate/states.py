"""Model states per engine: the weights, gradients and optimizer states one process holds, and the engine's own
buffers (DDP buckets, gathered shards, autocast copies).

One function per engine (plain PyTorch and DDP, DeepSpeed ZeRO 0-3 with offload, FSDP) because each engine decides
its own dtypes, what it partitions over which group and what it gathers; docs/estimate.md, "Model states", gives the
sources (DeepSpeed's own estimators, the transformers "model training anatomy" page) and where this differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfscale.estimate.shape import ModelShape
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Bytes of model states on one process under one engine, and what the rest of the estimate needs to know about
    that engine."""

    weights: float
    gradients: float
    optimizer: float
    """Optimizer states (and DeepSpeed's fp32 master weights) on this device."""
    overhead: dict[str, float]
    """The engine's buffers by source, in the order the estimate lists them."""
    notes: tuple[str, ...] = ()
    local_fraction: float = 1.0
    """Share of the parameters whose optimizer step runs on this device: 1/g when sharded, 0 when offloaded."""
    half_module: bool = False
    """The module itself is cast to 16 bits (DeepSpeed bf16/fp16) instead of running under autocast."""
    step_on_host: bool = False
    """The optimizer step runs on the host (DeepSpeed's optimizer offload): no step temporaries on the device."""
    gradients_kept: bool = False
    """Gradient buffers live through the forward pass (DeepSpeed, FSDP), so they never overlap the activations."""


def shard_group(strategy: Strategy) -> int:
    """Processes that share one copy of the model states (:attr:`~hfscale.strategy.Strategy.shard_group_size`): all
    of them (ZeRO and FSDP ``full_shard`` across every machine), one machine's for ``hybrid_shard`` (sharded within a
    machine, replicated across machines), one for FSDP's ``no_shard``; under an explicit device mesh
    (``strategy.parallelism``) FSDP2 shards over ``dp_shard x cp`` and replicates over ``dp_replicate``."""
    return strategy.shard_group_size


def plain_states(shape: ModelShape, strategy: Strategy, *, optimizer_bytes: int) -> ModelStates:
    """One process, DDP, or FSDP without sharding: every process holds everything, fp32 weights under autocast."""
    n = shape.num_params
    overhead: dict[str, float] = {}
    if strategy.world_size > 1:  # DDP; nn.DataParallel (one process, world size 1) keeps no buckets
        overhead["ddp_buckets"] = 4 * n  # gradient_as_bucket_view=False, accelerate's default
    if strategy.precision in ("fp16", "bf16"):
        overhead["autocast_weight_copies"] = 2 * shape.matmul_params
    return ModelStates(
        weights=4 * n,
        gradients=4 * n,
        optimizer=optimizer_bytes,
        overhead=overhead,
        gradients_kept=strategy.fsdp is not None,  # FSDP no_shard: kept as the sum (not checked)
    )


def deepspeed_states(shape: ModelShape, strategy: Strategy, ds: DeepSpeedSpec, *, optimizer_bytes: int) -> ModelStates:
    """DeepSpeed ZeRO stages 0-3, with optimizer and parameter offload, as DeepSpeed's estimators count them."""
    n = shape.num_params
    mixed = strategy.precision in ("fp16", "bf16")
    notes: list[str] = []
    overhead: dict[str, float] = {}
    g = strategy.num_processes
    p = 2 if mixed else 4
    master = 4 * n if (mixed or ds.zero_stage >= 1) else 0
    fp32_grads = 4 * n if mixed else 0
    offload_opt = ds.offload_optimizer != "none"
    if offload_opt:
        optimizer_bytes = 0  # DeepSpeed's CPU Adam: states, master weights and fp32 grads on the host
        master = fp32_grads = 0
        notes.append("optimizer states, fp32 master weights and fp32 gradients offloaded to the host")
    stage = ds.zero_stage
    weights: float = p * n
    gradients: float
    if stage == 0:
        gradients = p * n + fp32_grads
        optim: float = optimizer_bytes + master
    elif stage == 1:
        gradients = p * n + fp32_grads / g  # 16-bit gradients are all-reduced whole, then partitioned
        optim = (optimizer_bytes + master) / g
    else:
        # DeepSpeed's estimator: with the optimizer offloaded, gradient partitions stream to the host
        gradients = 0 if offload_opt else (p * n + fp32_grads) / g
        optim = (optimizer_bytes + master) / g
    if stage == 3:
        weights = 0 if ds.offload_param != "none" else p * n / g
        if not offload_opt and mixed:
            # DeepSpeed's ZeRO-3 estimator counts 18N/g: the 16-bit gradients are reduced straight into
            # the fp32 partition, so no 16-bit gradient partition is kept
            gradients = fp32_grads / g
        overhead["gathered_params"] = 2 * p * shape.largest_layer_params
        notes.append(
            "ZeRO-3 gathers the largest layer (DeepSpeed's estimator); stage3_max_live_parameters / "
            "max_reuse_distance can keep more gathered"
        )
    return ModelStates(
        weights=weights,
        gradients=gradients,
        optimizer=optim,
        overhead=overhead,
        notes=tuple(notes),
        local_fraction=1 / g if stage >= 1 else 1.0,
        half_module=mixed,
        step_on_host=offload_opt,
        gradients_kept=True,  # DeepSpeed allocates its gradient buffers and partitions up front
    )


def fsdp_states(shape: ModelShape, strategy: Strategy, fsdp: FsdpSpec, *, optimizer_bytes: int) -> ModelStates:
    """FSDP sharding over its group, with the units it gathers (root, two blocks, one block's gradients)."""
    n = shape.num_params
    g = shard_group(strategy)
    offload = fsdp.cpu_offload
    # accelerate: param_dtype = reduce_dtype = the half type; transformers' own FSDP2 (beside tp) reduces in fp32,
    # which is not modelled (docs/estimate.md)
    pg = 2 if strategy.precision in ("fp16", "bf16") else 4
    if fsdp.auto_wrap == "none":
        gathered = n * pg + n * pg
    elif fsdp.sharding == "shard_grad_op":
        gathered = n * pg + max(shape.block_params, shape.root_unit_params) * pg
    else:
        gathered = (
            shape.root_unit_params * pg
            + 2 * shape.block_params * pg
            + max(shape.block_params, shape.root_unit_params) * pg
        )
    notes = ("FSDP cpu_offload: shards, gradients and optimizer states on the host",) if offload else ()
    return ModelStates(
        weights=0 if offload else 4 * n / g,
        gradients=0 if offload else 4 * n / g,
        optimizer=0 if offload else optimizer_bytes / g,
        overhead={"gathered_params": gathered},
        notes=notes,
        local_fraction=0.0 if offload else 1 / g,
        gradients_kept=True,  # kept as the sum: not checked against FSDP's sources or a measurement
    )


__all__ = ["ModelStates", "deepspeed_states", "fsdp_states", "plain_states", "shard_group"]
