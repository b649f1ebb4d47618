"""The estimate's result: one process's predicted peak, split by what holds it.

It sits on its own floor so that a result row (:mod:`hfscale.records.row`) can carry an estimate without importing the
code that makes one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hfscale.core.units import GIB


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted peak memory of one process (one GPU), in GiB, split by what holds it."""

    weights_gib: float
    """Parameters held by this process (fp32 under autocast; 16-bit under DeepSpeed bf16/fp16; shards if sharded)."""
    gradients_gib: float
    """Gradients held by this process (``.grad``, DeepSpeed's 16-bit and fp32 gradient partitions)."""
    optimizer_gib: float
    """Optimizer states on this device (plus DeepSpeed's fp32 master weights); 0 when offloaded."""
    activations_gib: float
    """Tensors saved for the backward pass at its start, for one micro-batch."""
    overhead_gib: float
    """Autocast weight copies, DDP buckets, gathered shards, loss buffers, optimizer-step temporaries, cuBLAS
    workspaces."""
    total_gib: float
    """The predicted allocator peak (``torch.cuda.max_memory_allocated``), CUDA context excluded:
    ``weights + gradients + optimizer + activations + overhead - overlap``. Not the plain sum of the five parts
    when ``overlap_gib`` > 0."""
    overlap_gib: float = 0.0
    """The part of gradients and activations (with the other forward-pass tensors) that is never held at once:
    without gradient accumulation, outside DeepSpeed and FSDP, gradients are created while the activations are
    freed (docs/estimate.md, "Gradients and activations"). 0 where the total is the plain sum."""
    device: str = "cuda"
    """Where the strategy trains: the figures are per process on that device."""
    num_params: int = 0
    largest_layer_params: int = 0
    batch_size: int = 0
    seq_len: int = 0
    overhead_parts_gib: dict[str, float] = field(default_factory=dict)
    """The overhead by source (``autocast_weight_copies``, ``ddp_buckets``, ``gathered_params``, ...)."""
    activation_parts: dict[str, Any] = field(default_factory=dict)
    """How the activations were counted: family, attention path, per-layer and outside-layer bytes."""
    notes: tuple[str, ...] = ()
    """Assumptions a user should know about for this strategy."""

    @property
    def total_bytes(self) -> int:
        return round(self.total_gib * GIB)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as a result row's ``estimate`` stores it."""
        data = dataclasses.asdict(self)
        data["notes"] = list(self.notes)
        return data


__all__ = ["GIB", "MemoryEstimate"]
