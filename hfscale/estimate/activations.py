"""Bytes a forward pass saves for the backward pass, tensor by tensor, for the model families we checked.

The inventory follows Korthikanti et al. 2022 but counts what Hugging Face models really save (fp32 residual stream
under autocast, SDPA without s² scores on CUDA, CPU dropout masks as full tensors): docs/estimate.md, "Activations",
lists each term and where it was checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfscale.estimate.shape import ModelShape


@dataclass(frozen=True, kw_only=True)
class ActivationBytes:
    """The activation count of one micro-batch, in bytes."""

    saved: int
    """Saved for backward at the forward/backward boundary (the *activations* part)."""
    transient: int
    """Alive at the same moment but not saved (the loss's logits-sized buffers): part of *overhead*."""
    per_layer: int
    """One layer without checkpointing."""
    layers_kept: int
    """Bytes the layers keep through the forward pass (all layers, or their inputs under checkpointing)."""
    recompute: int
    """One layer rebuilt in the backward pass under checkpointing (0 without)."""
    outside_layers: int
    attention_path: str
    offloaded: int = 0
    """Bytes held in host memory instead under activation offload on CUDA (``saved`` is what stays on the device)."""


def activation_bytes(
    shape: ModelShape,
    *,
    batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    device: str = "cuda",
    gradient_checkpointing: bool = False,
    half_module: bool = False,
    activation_offload: bool = False,
) -> ActivationBytes:
    """Bytes saved for backward by one forward pass (the inventory: docs/estimate.md, "Activations").

    Args:
        half_module: the whole module is cast to 16 bits (DeepSpeed bf16/fp16): no autocast, half residual stream.
        activation_offload: saved tensors go to host memory in forward (hfscale.techniques.activation_offload); on CUDA
        one
            layer's are back on the device at a time in backward. On the CPU it changes nothing.

    Raises:
        ValueError: on a non-positive batch size or sequence length.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    b, s = batch_size, seq_len
    h, a, i, v = (shape.hidden_size, max(shape.num_heads, 1), shape.intermediate_size, shape.vocab_size)
    tokens = b * s
    mixed = precision in ("fp16", "bf16")
    c = 2 if mixed else 4  # matmul inputs/outputs
    autocast = mixed and not half_module
    r = 2 if half_module and mixed else 4  # residual stream and LayerNorm inputs
    on_cuda = device == "cuda"

    def mask(p: float, input_bytes: int) -> int:
        if p <= 0:
            return 0
        return 1 if on_cuda else input_bytes

    ln_stats = 2 * 4 * tokens  # mean and rstd, fp32
    # attention core
    if shape.attn_implementation == "eager":
        scores = a * s * s * b
        # fp32 softmax output, and the probabilities the value matmul reads: the same tensor when they stay fp32
        # and no dropout runs (measured: one fp32 s² tensor per layer, tiny BERT fp32 on CPU, tests/test_kernels.py)
        probs = c if (mixed or shape.attention_dropout > 0) else 0
        core = 3 * c * tokens * h + scores * (4 + mask(shape.attention_dropout, c) + probs)
        path = "eager (s² scores kept)"
    elif not on_cuda and shape.attention_dropout > 0:
        scores = a * s * s * b
        core = 3 * 4 * tokens * h + scores * (4 + 4 + 4)  # math path upcasts to fp32
        path = "sdpa math (CPU with attention dropout: s² scores kept, fp32)"
    else:
        core = 3 * c * tokens * h + 4 * b * a * s  # q, k, v + logsumexp; the output is the projection input
        path = "sdpa fused (flash / memory-efficient: no s² term)"
    qkv_inputs = 3 if (autocast and shape.separate_qkv) else 1
    mlp_tensors = {"gelu_new": 5, "gelu_fast": 5, "relu": 1}.get(shape.activation, 2)
    per_layer = (
        qkv_inputs * c * tokens * h  # QKV projection input
        + core
        + c * tokens * h  # output projection input
        + mask(shape.hidden_dropout, c) * tokens * h  # attention output dropout
        + 2 * (r * tokens * h + ln_stats)  # two LayerNorm inputs
        + c * tokens * h  # first MLP matmul input
        + mlp_tensors * c * tokens * i  # activation input/output, second matmul input
        + mask(shape.hidden_dropout, c) * tokens * h  # MLP output dropout
    )

    # outside the layers
    outside = 8 * tokens + r * tokens * h + ln_stats + mask(shape.embedding_dropout, r) * tokens * h
    transient = 0
    if shape.family == "bert":
        outside += 8 * tokens  # token type ids
    if shape.task == "causal_lm":
        if shape.family != "bert":
            outside += r * tokens * h + ln_stats  # final LayerNorm input
        outside += c * tokens * h + 4 * tokens * v  # LM head input; fp32 log-softmax saved by the loss
        transient = 8 * tokens * v  # the log-softmax gradient and the logits gradient at the backward start
    elif shape.family == "bert":
        # pooler: without autocast its [:, 0] view keeps the last hidden state's storage alive
        outside += (r * tokens * h if not autocast else c * b * h) + 3 * c * b * h
    else:
        outside += r * tokens * h + ln_stats  # final LayerNorm input of a decoder classifier

    layers = shape.num_layers
    if gradient_checkpointing:
        layers_kept = layers * r * tokens * h
        recompute = per_layer
    else:
        layers_kept = layers * per_layer
        recompute = 0
    saved = layers_kept + recompute + outside
    offloaded = 0
    if activation_offload and on_cuda:
        # Everything saved goes through the hooks, the checkpointed layers' inputs too (torch's non-reentrant
        # checkpoint saves them with save_for_backward); the backward pass brings back one layer's at a time.
        offloaded = saved - per_layer
        saved = per_layer
    return ActivationBytes(
        saved=saved,
        offloaded=offloaded,
        transient=transient,
        per_layer=per_layer,
        layers_kept=layers_kept,
        recompute=recompute,
        outside_layers=outside,
        attention_path=path,
    )


__all__ = ["ActivationBytes", "activation_bytes"]
