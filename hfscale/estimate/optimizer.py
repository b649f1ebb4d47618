"""Optimizer states and the optimizer step's temporaries, tensor by tensor, as the Trainer's optimizers allocate them.

Counted per tensor rather than as bytes per parameter because the optimizers differ per tensor: bitsandbytes keeps
small tensors and embeddings in 32 bits, Adafactor factors matrices but not vectors (docs/estimate.md, "Model
states").
"""

from __future__ import annotations

import math
import re
from typing import Any

from hfscale.estimate.shape import ModelShape
from hfscale.strategy import EIGHT_BIT_OPTIMIZERS

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes' ``min_8bit_size``: smaller tensors keep fp32 states."""
BNB_BLOCK_SIZE = 256
"""bitsandbytes' blockwise quantisation: one fp32 ``absmax`` per block per state."""
BNB_QMAP_BYTES = 2 * 256 * 4
"""The two shared 256-entry fp32 quantisation maps (``dynamic``, ``udynamic``)."""


def optimizer_state_bytes(shape: ModelShape, optimizer: str, *, device: str = "cuda", momentum: float = 0.0) -> int:
    """Bytes of optimizer state for the whole model, tensor by tensor, as the Trainer's optimizer allocates it.

    Args:
        momentum: SGD momentum (the Trainer's ``optim_args``); 0, the Trainer's default, keeps no state.

    Raises:
        ValueError: for an optimizer this module does not model.
    """
    if optimizer in ("adamw_torch", "adamw_torch_fused"):
        # the step tensor lives on the device only for the fused (and capturable) path; on CPU always
        step_on_device = optimizer == "adamw_torch_fused" or device == "cpu"
        return 8 * shape.num_params + (4 * shape.num_tensors if step_on_device else 0)
    if optimizer == "sgd":
        return 4 * shape.num_params if momentum else 0
    if optimizer == "adafactor":
        total = 0
        for p in shape.params:
            if len(p.shape) >= 2:
                rows = math.prod(p.shape[:-1])
                cols = math.prod(p.shape[:-2]) * p.shape[-1]
                total += 4 * (rows + cols)
            else:
                total += 4 * p.numel
        return total + 4 * shape.num_tensors  # state["RMS"] is a 0-d fp32 tensor per parameter
    if optimizer in EIGHT_BIT_OPTIMIZERS:
        total = 0
        any_8bit = False
        for p in shape.params:
            n = p.numel
            if p.in_embedding or n < BNB_MIN_8BIT_SIZE:
                total += 8 * n
            else:
                blocks = -(-n // BNB_BLOCK_SIZE)
                total += 2 * n + 2 * 4 * blocks
                any_8bit = True
        return total + (BNB_QMAP_BYTES if any_8bit else 0)
    raise ValueError(f"optimizer {optimizer!r}: no memory model; expected one of the Strategy optimizers")


def optimizer_step_temp_bytes(shape: ModelShape, optimizer: str, device: str, local_fraction: float) -> int:
    """Temporaries of one optimizer step (docs/estimate.md, "Overhead"): ``local_fraction`` is the share of the
    parameters this process steps (1/g when the optimizer is sharded)."""
    if optimizer == "adamw_torch":
        if device == "cuda":
            return int(4 * shape.num_params * local_fraction)  # foreach: exp_avg_sq.sqrt() for every tensor
        return 4 * shape.largest_tensor_params  # single-tensor loop
    if optimizer == "adafactor":
        return 3 * 4 * shape.largest_tensor_params
    return 0


def sgd_momentum(training_args: dict[str, Any]) -> float:
    """SGD's momentum from the Trainer's ``optim_args`` (``"momentum=0.9"``); 0, the Trainer's default, when unset."""
    optim_args = training_args.get("optim_args") or ""
    match = re.search(r"(?:^|,)\s*momentum\s*=\s*([0-9.eE+-]+)", str(optim_args))
    return float(match.group(1)) if match else 0.0


__all__ = [
    "BNB_BLOCK_SIZE",
    "BNB_MIN_8BIT_SIZE",
    "BNB_QMAP_BYTES",
    "optimizer_state_bytes",
    "optimizer_step_temp_bytes",
    "sgd_momentum",
]
