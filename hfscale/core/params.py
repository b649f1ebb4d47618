"""How many elements a parameter has, as the model computes with it: one count for every reader.

The tensor a parameter holds is not always its size: DeepSpeed ZeRO-3 leaves an empty placeholder in each
partitioned parameter (the full size is ``ds_numel``), and bitsandbytes packs two 4-bit weights into each uint8
element (QLoRA: the matmul runs on the dequantised weight, whose shape the quant state keeps; counting the packed
tensor read half the FLOPs, 0.1's closing note). An FSDP2 parameter is a DTensor whose ``numel()`` is already the
global size.
"""

from __future__ import annotations

import math
from typing import Any


def param_numel(param: Any) -> int:
    """Elements of ``param`` as the model computes with it: the dequantised shape of a 4-bit weight, the full size
    of a ZeRO-3 partition, else ``numel()`` (a DTensor's global size)."""
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    if shape is not None:
        return math.prod(int(d) for d in shape)
    return int(getattr(param, "ds_numel", 0) or param.numel())


def fsdp2_param_groups(model: Any) -> list[tuple[Any, Any]]:
    """``(module, parameter group)`` of every FSDP2 unit of ``model`` that holds parameters, outermost first: where
    FSDP2 keeps each unit's settings (mesh, offload, mixed precision, its parameters). Private attributes of torch's:
    a caller reading them catches ``AttributeError`` where torch's internals moved. Empty without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [
        (module, group)
        for module in model.modules()
        if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group) is not None
    ]


__all__ = ["fsdp2_param_groups", "param_numel"]
