"""LoRA and QLoRA in the memory estimate: the parameters the adapters train, and the model states of one process.

Applying LoRA in a trial is :mod:`hfscale.techniques.lora`'s; this module only counts what it will hold.
"""

from __future__ import annotations

import dataclasses
import math

from hfscale.estimate.shape import ModelShape, ParamInfo
from hfscale.estimate.states import ModelStates
from hfscale.strategy import Strategy
from hfscale.techniques.lora import NF4_BLOCK_SIZE, resolve_target_modules


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _targets_param(info: ParamInfo, targets: tuple[str, ...]) -> bool:
    """peft's rule: a module is targeted when its path is a target or ends with ``"." + target``."""
    module = _module_of(info.name)
    return info.in_matmul and len(info.shape) == 2 and any(module == t or module.endswith("." + t) for t in targets)


def _head_modules(shape: ModelShape) -> set[str]:
    """Modules peft trains a copy of (``SEQ_CLS``: the classifier) and transformers keeps out of 4 bits (the last
    module and the output head: ``transformers.quantizers.base.get_keys_to_not_convert``)."""
    heads = {_module_of(shape.params[-1].name)} if shape.params else set()
    heads |= {m for p in shape.params if (m := _module_of(p.name)).rsplit(".", 1)[-1] == "lm_head"}
    return heads


def trainable_shape(shape: ModelShape, strategy: Strategy) -> ModelShape | None:
    """The parameters LoRA trains, as a :class:`ModelShape` the optimizer model can count: two matrices per
    targeted Linear (``A``: rank x in, ``B``: out x rank), plus the classifier head peft trains a copy of for
    classification. None without ``strategy.lora``.

    Raises:
        ValueError: when no parameter matches the target modules (peft would refuse the model too).
    """
    lora = strategy.lora
    if lora is None:
        return None
    targets = resolve_target_modules(lora, shape.model_type)
    params: list[ParamInfo] = []
    for info in shape.params:
        if _targets_param(info, targets):
            # (out, in) for nn.Linear; GPT-2's Conv1D stores (in, out): r * (in + out) elements either way.
            out_features, in_features = info.shape
            module = _module_of(info.name)
            params.append(
                ParamInfo(name=f"{module}.lora_A", shape=(lora.rank, in_features), in_embedding=False, in_matmul=True)
            )
            params.append(
                ParamInfo(name=f"{module}.lora_B", shape=(out_features, lora.rank), in_embedding=False, in_matmul=True)
            )
    if not params:
        raise ValueError(
            f"lora.target_modules {list(targets)}: no Linear of the {shape.model_type!r} model matches; name modules "
            "the model has (the last part of a Linear's path, e.g. query or q_proj)"
        )
    if shape.task == "classification":
        heads = _head_modules(shape)
        params += [p for p in shape.params if _module_of(p.name) in heads and not p.in_embedding]
    return dataclasses.replace(shape, params=tuple(params))


def quantized_base_bytes(shape: ModelShape) -> tuple[int, int]:
    """``(elements stored in 4 bits, bytes of the base weights)`` under QLoRA: every Linear weight but the heads
    transformers keeps (:func:`_head_modules`) at half a byte plus a 4-byte ``absmax`` per :data:`NF4_BLOCK_SIZE`
    elements; everything else (embeddings, norms, biases, heads) fp32."""
    heads = _head_modules(shape)
    quantized = 0
    total = 0.0
    for p in shape.params:
        if p.in_matmul and not p.in_embedding and len(p.shape) == 2 and _module_of(p.name) not in heads:
            quantized += p.numel
            total += p.numel / 2 + 4 * math.ceil(p.numel / NF4_BLOCK_SIZE)
        else:
            total += 4 * p.numel
    return quantized, int(total)


SHARDED_LORA_NOTE = (
    "LoRA under DeepSpeed/FSDP: optimizer states counted for the adapters only, but gradients (and DeepSpeed's "
    "fp32 master weights) for the whole model: an over-estimate"
)
"""The estimate's note where LoRA's model states are not modelled (the sharding engines count every parameter)."""


def lora_states(shape: ModelShape, strategy: Strategy, *, optimizer_bytes: int) -> ModelStates:
    """Model states of one process (one process or DDP) under LoRA: the whole base (fp32, or NF4 under QLoRA) plus
    the adapters as weights; gradients, optimizer states (``optimizer_bytes``, counted over
    :func:`trainable_shape`), DDP buckets and autocast copies for the adapters only (autocast caches its half copy
    of a weight only for leaves that require grad: a frozen weight is cast at each use and freed)."""
    adapters = trainable_shape(shape, strategy)
    lora = strategy.lora
    if adapters is None or lora is None:
        raise ValueError("strategy.lora: lora_states needs a LoRA strategy")
    # Under SEQ_CLS the classifier's trainable copy sits beside the frozen original (counted in the base).
    n_train = adapters.num_params
    notes = [f"LoRA r{lora.rank}: gradients and optimizer states for {n_train:,} trainable parameters only"]
    if lora.quantize_base == "4bit":
        quantized, base = quantized_base_bytes(shape)
        notes.append(f"QLoRA: {quantized:,} base weights in NF4 (0.5 byte + fp32 absmax per {NF4_BLOCK_SIZE})")
    else:
        base = 4 * shape.num_params
    overhead: dict[str, float] = {}
    if strategy.world_size > 1:  # DDP buckets the parameters that require grad only
        overhead["ddp_buckets"] = 4 * n_train
    if strategy.precision in ("fp16", "bf16"):
        overhead["autocast_weight_copies"] = 2 * adapters.matmul_params
    return ModelStates(
        weights=base + 4 * n_train,
        gradients=4 * n_train,
        optimizer=optimizer_bytes,
        overhead=overhead,
        notes=tuple(notes),
    )
