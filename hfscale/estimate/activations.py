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


@dataclass(frozen=True, kw_only=True)
class _Sizes:
    """One micro-batch's dimensions and the bytes per element of each kind of saved tensor."""

    batch: int
    seq: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    matmul: int
    """Bytes of a matmul input or output: 2 under 16-bit precision, else 4."""
    residual: int
    """Bytes of the residual stream and LayerNorm inputs: 2 only when the whole module is cast to 16 bits."""
    mixed: bool
    """16-bit precision (fp16 or bf16), by autocast or by casting the module."""
    autocast: bool
    """16-bit precision by autocast (the module stays fp32)."""
    on_cuda: bool

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def ln_stats(self) -> int:
        """A LayerNorm's saved mean and rstd, fp32."""
        return 2 * 4 * self.tokens

    @property
    def scores(self) -> int:
        """Elements of one layer's s² attention scores."""
        return self.heads * self.seq * self.seq * self.batch

    def mask(self, p: float, input_bytes: int) -> int:
        """Bytes per element of a dropout mask: one on CUDA (bool), the input's size on the CPU; none without
        dropout."""
        if p <= 0:
            return 0
        return 1 if self.on_cuda else input_bytes


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
        activation_offload: saved tensors go to host memory in forward (hfscale.techniques.activation_offload); on
            CUDA one layer's are back on the device at a time in backward. On the CPU it changes nothing.

    Raises:
        ValueError: on a non-positive batch size or sequence length.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    mixed = precision in ("fp16", "bf16")
    sz = _Sizes(
        batch=batch_size, seq=seq_len, hidden=shape.hidden_size, heads=max(shape.num_heads, 1),
        intermediate=shape.intermediate_size, vocab=shape.vocab_size, matmul=2 if mixed else 4,
        residual=2 if half_module and mixed else 4, mixed=mixed, autocast=mixed and not half_module,
        on_cuda=device == "cuda",
    )  # fmt: skip
    core, path = _attention_core(shape, sz)
    per_layer = _per_layer(shape, sz, core)
    outside, transient = _outside_layers(shape, sz)
    layers = shape.num_layers
    if gradient_checkpointing:
        layers_kept = layers * sz.residual * sz.tokens * sz.hidden
        recompute = per_layer
    else:
        layers_kept = layers * per_layer
        recompute = 0
    saved = layers_kept + recompute + outside
    offloaded = 0
    if activation_offload and sz.on_cuda:
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


def _attention_core(shape: ModelShape, sz: _Sizes) -> tuple[int, str]:
    """Bytes one layer's attention core saves (q, k, v and what the kernel keeps), and which path it takes."""
    c, th = sz.matmul, sz.tokens * sz.hidden
    if shape.attn_implementation == "eager":
        # fp32 softmax output, and the probabilities the value matmul reads: the same tensor when they stay fp32
        # and no dropout runs (measured: one fp32 s² tensor per layer, tiny BERT fp32 on CPU, tests/test_kernels.py)
        probs = c if (sz.mixed or shape.attention_dropout > 0) else 0
        core = 3 * c * th + sz.scores * (4 + sz.mask(shape.attention_dropout, c) + probs)
        return core, "eager (s² scores kept)"
    if not sz.on_cuda and shape.attention_dropout > 0:
        core = 3 * 4 * th + sz.scores * (4 + 4 + 4)  # math path upcasts to fp32
        return core, "sdpa math (CPU with attention dropout: s² scores kept, fp32)"
    core = 3 * c * th + 4 * sz.batch * sz.heads * sz.seq  # q, k, v + logsumexp; the output is the projection input
    return core, "sdpa fused (flash / memory-efficient: no s² term)"


def _per_layer(shape: ModelShape, sz: _Sizes, core: int) -> int:
    """Bytes one transformer layer saves without checkpointing, its attention core ``core`` included."""
    c, r, th = sz.matmul, sz.residual, sz.tokens * sz.hidden
    qkv_inputs = 3 if (sz.autocast and shape.separate_qkv) else 1
    mlp_tensors = {"gelu_new": 5, "gelu_fast": 5, "relu": 1}.get(shape.activation, 2)
    return (
        qkv_inputs * c * th  # QKV projection input
        + core
        + c * th  # output projection input
        + sz.mask(shape.hidden_dropout, c) * th  # attention output dropout
        + 2 * (r * th + sz.ln_stats)  # two LayerNorm inputs
        + c * th  # first MLP matmul input
        + mlp_tensors * c * sz.tokens * sz.intermediate  # activation input/output, second matmul input
        + sz.mask(shape.hidden_dropout, c) * th  # MLP output dropout
    )


def _outside_layers(shape: ModelShape, sz: _Sizes) -> tuple[int, int]:
    """Bytes saved outside the layers (embeddings, head, loss), and the loss's transient logits-sized buffers."""
    c, r, tokens, th = sz.matmul, sz.residual, sz.tokens, sz.tokens * sz.hidden
    outside = 8 * tokens + r * th + sz.ln_stats + sz.mask(shape.embedding_dropout, r) * th
    transient = 0
    if shape.family == "bert":
        outside += 8 * tokens  # token type ids
    if shape.task == "causal_lm":
        if shape.family != "bert":
            outside += r * th + sz.ln_stats  # final LayerNorm input
        outside += c * th + 4 * tokens * sz.vocab  # LM head input; fp32 log-softmax saved by the loss
        transient = 8 * tokens * sz.vocab  # the log-softmax gradient and the logits gradient at the backward start
    elif shape.family == "bert":
        # pooler: without autocast its [:, 0] view keeps the last hidden state's storage alive
        outside += (r * th if not sz.autocast else c * sz.batch * sz.hidden) + 3 * c * sz.batch * sz.hidden
    else:
        outside += r * th + sz.ln_stats  # final LayerNorm input of a decoder classifier
    return outside, transient


__all__ = ["ActivationBytes", "activation_bytes"]
