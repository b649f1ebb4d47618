"""The estimate itself: model states, activations and overheads added into one process's predicted peak.

This is where the parts meet, so it is also where the two things that are not a plain sum live: the optimizer
step's temporaries (held after the activations are freed) and the overlap of gradients with activations when they
are never held at once (docs/estimate.md, "Gradients and activations").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hfscale.core.units import GIB
from hfscale.estimate.activations import ActivationBytes, activation_bytes
from hfscale.estimate.lora import SHARDED_LORA_NOTE, lora_states, trainable_shape
from hfscale.estimate.optimizer import optimizer_state_bytes, optimizer_step_temp_bytes, sgd_momentum
from hfscale.estimate.shape import ModelShape, describe_model, model_shape_from_module
from hfscale.estimate.states import ModelStates, deepspeed_states, fsdp_states, plain_states
from hfscale.records.estimate import MemoryEstimate
from hfscale.strategy import Strategy
from hfscale.workload.spec import DataSpec, ModelSpec, TrialSpec

if TYPE_CHECKING:
    from torch import nn

CUBLAS_WORKSPACES_BYTES = 2 * 32 * 1024**2
"""Two cuBLAS workspaces in torch's allocator (forward thread and autograd thread), 32 MiB each on Hopper."""


def estimate_memory(
    spec_or_model: TrialSpec | ModelSpec | ModelShape | nn.Module,
    strategy: Strategy | None = None,
    *,
    seq_len: int | None = None,
    data: DataSpec | None = None,
    training_args: dict[str, Any] | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of one process for a trial, or for a model under a strategy.

    Call it with a :class:`~hfscale.workload.spec.TrialSpec` (everything comes from it), or with a model (a
    :class:`~hfscale.workload.spec.ModelSpec`, a :class:`ModelShape` or a built ``nn.Module``), a strategy and
    ``seq_len``.

    Raises:
        ValueError: when the strategy or the sequence length is missing, or the optimizer is not modelled.
    """
    if isinstance(spec_or_model, TrialSpec):
        spec = spec_or_model
        if spec.script is not None:
            raise ValueError(
                f"the trial runs the script {spec.script.command_line()}, which builds its own model: there is "
                "nothing to estimate without running it"
            )
        strategy = strategy or spec.strategy
        data = data or spec.data
        seq_len = seq_len or spec.data.seq_len
        training_args = spec.training_args if training_args is None else training_args
        shape = describe_model(spec.model, data)
    elif isinstance(spec_or_model, ModelSpec):
        shape = describe_model(spec_or_model, data)
    elif isinstance(spec_or_model, ModelShape):
        shape = spec_or_model
    else:
        shape = model_shape_from_module(spec_or_model)
    if strategy is None:
        raise ValueError("estimate_memory: a strategy is needed unless a TrialSpec is given")
    if seq_len is None:
        seq_len = (data or DataSpec()).seq_len
    return _estimate(shape, strategy, seq_len=seq_len, training_args=training_args or {})


def _estimate(shape: ModelShape, strategy: Strategy, *, seq_len: int, training_args: dict[str, Any]) -> MemoryEstimate:
    if strategy.attn_implementation is not None and strategy.attn_implementation != shape.attn_implementation:
        # the trial builds the model with the strategy's kernel (hfscale.workload.model.build_model): eager keeps s²
        # scores
        shape = dataclasses.replace(shape, attn_implementation=strategy.attn_implementation)
    trained = trainable_shape(shape, strategy) or shape  # LoRA: optimizer states for the adapters only
    momentum = sgd_momentum(training_args)
    optimizer_bytes = optimizer_state_bytes(
        trained, strategy.resolved_optimizer, device=strategy.device, momentum=momentum
    )
    states = model_states(shape, strategy, optimizer_bytes=optimizer_bytes)
    act = activation_bytes(
        shape,
        batch_size=strategy.per_device_batch_size,
        seq_len=seq_len,
        precision=strategy.precision,
        device=strategy.device,
        gradient_checkpointing=strategy.gradient_checkpointing,
        half_module=states.half_module,
        activation_offload=strategy.activation_offload,
    )
    peak = _peak(shape, trained, strategy, states, act)
    return _memory_estimate(shape, strategy, seq_len, states, act, peak)


@dataclass(frozen=True, kw_only=True)
class _Peak:
    """What the sum of the parts does not say by itself: the overheads, and what is never held at once."""

    overhead: dict[str, int]
    """Bytes by overhead part (the engine's, the loss's buffers, the optimizer step's excess, cuBLAS)."""
    overlap: int
    """Bytes subtracted from the sum: gradients created while the activations are freed."""
    notes: list[str]


def _peak(
    shape: ModelShape, trained: ModelShape, strategy: Strategy, states: ModelStates, act: ActivationBytes
) -> _Peak:
    """The overheads at the peak, and the overlap of gradients with activations (docs/estimate.md, "Gradients and
    activations")."""
    device, optimizer = strategy.device, strategy.resolved_optimizer
    notes = list(states.notes)
    overhead = dict(states.overhead)
    if act.transient:
        overhead["loss_buffers"] = act.transient
    forward_extra = act.saved + overhead.get("autocast_weight_copies", 0) + act.transient
    if not states.step_on_host:
        step_temp = optimizer_step_temp_bytes(trained, optimizer, device, states.local_fraction)
        # the step's temporaries live after the activations are freed: they add only what exceeds them
        if step_temp > forward_extra:
            overhead["optimizer_step"] = step_temp - forward_extra
    else:
        step_temp = 0
    if device == "cuda":
        overhead["cublas_workspaces"] = CUBLAS_WORKSPACES_BYTES
    overlap = 0
    if not states.gradients_kept and strategy.gradient_accumulation_steps == 1 and forward_extra > step_temp:
        # zero_grad(set_to_none=True) freed the gradients: peak = max(forward, gradients + step) instead of the sum
        overlap = min(int(states.gradients), forward_extra - step_temp)
        if overlap:
            notes.append(
                "one micro-batch per step: gradients are created while activations are freed, not held at once "
                "(overlap subtracted from the sum)"
            )
    if shape.family == "generic":
        notes.append(f"activations of {shape.model_type!r} use the generic pre-LN inventory (approximate)")
    if optimizer == "paged_adamw_8bit" and device == "cuda":
        notes.append("paged optimizer states live in CUDA managed memory: counted, but outside torch's allocator")
    return _Peak(overhead=overhead, overlap=overlap, notes=notes)


def _memory_estimate(
    shape: ModelShape, strategy: Strategy, seq_len: int, states: ModelStates, act: ActivationBytes, peak: _Peak
) -> MemoryEstimate:
    """The parts added into the estimate record, in GiB."""
    overhead_bytes = sum(peak.overhead.values())
    total = states.weights + states.gradients + states.optimizer + act.saved + overhead_bytes - peak.overlap
    return MemoryEstimate(
        weights_gib=states.weights / GIB,
        gradients_gib=states.gradients / GIB,
        optimizer_gib=states.optimizer / GIB,
        activations_gib=act.saved / GIB,
        overhead_gib=overhead_bytes / GIB,
        total_gib=total / GIB,
        overlap_gib=peak.overlap / GIB,
        device=strategy.device,
        num_params=shape.num_params,
        largest_layer_params=shape.largest_layer_params,
        batch_size=strategy.per_device_batch_size,
        seq_len=seq_len,
        overhead_parts_gib={k: v / GIB for k, v in peak.overhead.items()},
        activation_parts={
            "family": shape.family,
            "attention_path": act.attention_path,
            "per_layer_bytes": act.per_layer,
            "layers_kept_bytes": act.layers_kept,
            "recompute_bytes": act.recompute,
            "outside_layers_bytes": act.outside_layers,
        },
        notes=tuple(peak.notes),
    )


def model_states(shape: ModelShape, strategy: Strategy, *, optimizer_bytes: int) -> ModelStates:
    """The model states of one process under the strategy's engine.

    Args:
        optimizer_bytes: the optimizer's states for the whole, unsharded model (:func:`optimizer_state_bytes`).
    """
    if strategy.deepspeed is not None:
        states = deepspeed_states(shape, strategy, strategy.deepspeed, optimizer_bytes=optimizer_bytes)
    elif strategy.fsdp is not None and strategy.fsdp.sharding != "no_shard":
        states = fsdp_states(shape, strategy, strategy.fsdp, optimizer_bytes=optimizer_bytes)
    elif strategy.lora is not None:  # adapters on a frozen (QLoRA: 4-bit) base
        states = lora_states(shape, strategy, optimizer_bytes=optimizer_bytes)
    else:
        states = plain_states(shape, strategy, optimizer_bytes=optimizer_bytes)
    sharded_engine = strategy.deepspeed is not None or (
        strategy.fsdp is not None and strategy.fsdp.sharding != "no_shard"
    )
    if strategy.lora is not None and sharded_engine:  # these engines' LoRA states are not modelled
        states = dataclasses.replace(states, notes=(*states.notes, SHARDED_LORA_NOTE))
    mesh = strategy.parallelism
    if mesh is not None and (mesh.tp > 1 or mesh.cp > 1 or mesh.sp > 1):
        # not modelled: counting the states whole over tp and the sequence whole over cp/sp over-estimates
        states = dataclasses.replace(
            states,
            notes=(
                *states.notes,
                "tensor/context/sequence parallel splits are not modelled: weights of the tensor-parallel plan "
                "and activations are counted whole on each device (an over-estimate)",
            ),
        )
    return states


__all__ = ["CUBLAS_WORKSPACES_BYTES", "estimate_memory", "model_states"]
