"""Predict a strategy's peak memory per device before running it.

The model is built on the meta device (``accelerate.init_empty_weights``: no memory, no download) and everything
the estimate needs is read from it: every parameter's shape, which ones sit in ``nn.Embedding`` and ``nn.Linear``
modules, the largest module (DeepSpeed's "largest layer") and the transformer block (the FSDP unit). The peak is
built from five parts, each in bytes per device, less the part of gradients and activations that is never held at
the same time (*overlap*, see "Gradients and activations" below):

``total = weights + gradients + optimizer + activations + overhead - overlap``

``total`` is what the framework allocates (``torch.cuda.max_memory_allocated``); the CUDA context and allocator
slack are not in it. :func:`predicted_to_fit` adds a reserve for them that is *assumed*, not measured (nothing has
run when the estimate is made): 1343 MB, the V100 reference's "after CUDA initialisation alone"
(``shared/reference/v100-bert-large.md``); the real context differs by GPU, driver and CUDA version, so pass
``reserve_bytes`` where it was measured (a sweep's NVML process use less the allocator's reserved peak).

Model states (N parameters, T parameter tensors, g processes in the sharding group)
-----------------------------------------------------------------------------------
Sources: the HF "model training anatomy" page (weights 4 bytes fp32 / 6 mixed, AdamW 8, 8-bit AdamW 2, SGD with
momentum 4, gradients 4) and DeepSpeed's ``estimate_zero2_model_states_mem_needs`` /
``estimate_zero3_model_states_mem_needs`` (``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py``:
ZeRO-2 ``2N + 18N/g``, with optimizer offload ``2N``; ZeRO-3 ``4·largest_layer + 18N/g``, optimizer offload
``4·largest_layer + 2N/g``, full offload ``4·largest_layer``; 18 = 2 fp16 grads + 4 fp32 grads + 4 fp32 master
weights + 8 Adam states). Where this module differs, it is because it counts what the libraries really allocate:

- Trainer/accelerate mixed precision is ``torch.autocast``: parameters stay fp32 (4 bytes, also on CPU), there is
  no persistent half copy. The anatomy page's extra 2 bytes are autocast's cast cache: a half copy of every weight
  that goes through a matmul (``nn.Linear``/``Conv1D`` parameters, a tied LM head included), saved for backward
  until the backward pass frees it. It is counted in *overhead* (``autocast_weight_copies``), not in *weights*.
- Optimizer states are counted tensor by tensor, as the optimizers create them:
  ``adamw_torch``: ``exp_avg`` + ``exp_avg_sq`` (8N) plus a 4-byte ``step`` tensor per parameter (on the CPU for
  the non-fused CUDA path, so not in the GPU figure); ``adamw_torch_fused``: the same, ``step`` on the device.
  ``sgd``: the Trainer builds ``torch.optim.SGD`` with momentum 0 unless ``optim_args`` sets it, and SGD keeps no
  state then (0 bytes); with momentum, a ``momentum_buffer`` (4N). ``adafactor`` (transformers' Adafactor as the
  Trainer builds it: ``beta1=None``): a factored second moment, ``rows + cols`` floats for every matrix
  (``exp_avg_sq_row``/``_col``), a full ``exp_avg_sq`` for vectors, and a 0-d ``RMS`` tensor each.
  ``adamw_bnb_8bit``/``paged_adamw_8bit``: bitsandbytes keeps two uint8 states (2N) plus one fp32 ``absmax`` per
  256-element block per state, for tensors with at least 4096 elements; smaller tensors, and every ``nn.Embedding``
  weight (the Trainer registers them for 32-bit states: ``GlobalOptimManager.register_module_override``), keep two
  fp32 states (8 bytes/param); plus the two shared 256-entry quantisation maps. That is why 8-bit AdamW saves less
  than 8 -> 2 on BERT, whose word embeddings are a tenth of its parameters.
- DeepSpeed with bf16/fp16 casts the module to 16 bits (weights 2N) and keeps fp32 master weights (4N) and fp32
  gradients (4N) in the optimizer, partitioned from stage 1 (master, states), 2 (+ gradients) and 3 (+ weights).
  The optimizer's own states replace DeepSpeed's "8" (Adam) when the Trainer's optimizer is not Adam. With fp32,
  DeepSpeed's ZeRO optimizer still clones an fp32 partition (master) at stages 1-3.
  ZeRO-3 keeps no 16-bit gradient partition (gradients are reduced into the fp32 partition: 18N/g in all, as
  DeepSpeed's estimator counts) and adds the gathered largest layer, ``2 x 2 bytes x largest_layer`` (16-bit
  parameter and gradient). Offloaded states are on the host and count 0 on the device; with the optimizer
  offloaded the gradient partitions stream to the host too (ZeRO-2 offload: 2N on the device, as DeepSpeed says).
  DeepSpeed's ``stage3_max_live_parameters``/``max_reuse_distance`` can keep more than one layer gathered.
- DDP (several processes, no sharding) keeps its gradient buckets (``gradient_as_bucket_view=False``, accelerate's
  default): 4N more, in *overhead*. FSDP shards weights, gradients and states over its group (all processes;
  processes per machine for ``hybrid_shard``; none for ``no_shard``) and gathers, in *overhead*: the root unit
  (kept unsharded through forward and backward by FSDP2), two transformer blocks (the current one and the
  prefetched one) and one block's unsharded gradients; ``shard_grad_op`` keeps every unit gathered from forward to
  backward. Gathered tensors are in the mixed-precision ``param_dtype`` (accelerate sets bf16/fp16 for both
  parameters and the gradient reduction). ``cpu_offload`` keeps shards on the host.

Activations
-----------
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1) give
``s·b·h·(34 + 5·a·s/h)`` bytes per layer for fully 16-bit activations with 1-byte dropout masks: 34 = QKV input 2,
Q and K 4, V 2, output projection input 2, dropout mask 1 (attention block, 11) + MLP input 2, GeLU input 8, GeLU
output 8, mask 1 (19) + two LayerNorm inputs 4; 5·a·s/h = softmax output 2, its dropout mask 1 and the dropped
probabilities 2, per score. This module keeps that inventory but counts the bytes Hugging Face models really
save, which were checked tensor by tensor against the autograd graph of ``bert`` and ``gpt2`` (see the tests):

- under autocast the residual stream and the LayerNorm inputs stay fp32 (4 bytes; LayerNorm runs in fp32 and
  embeddings are fp32), matmul inputs are half (2). BERT's separate query/key/value ``nn.Linear`` each cast the
  same fp32 input, so the QKV input is saved three times at 2 bytes (6 > 4); GPT-2's fused ``c_attn`` once.
- the MLP saves the first matmul's input and, per activation: exact GeLU 2 intermediate tensors (GeLU input,
  second matmul input), GPT-2's ``gelu_new`` (tanh formula written in Python) 5, ReLU 1.
- dropout masks are ``bool`` (1 byte) on CUDA (``native_dropout``) but a scaled noise tensor of the input's dtype
  on the CPU; a dropout with p = 0 saves nothing.
- attention: transformers 5 uses ``sdpa`` by default. On CUDA the flash / memory-efficient kernels save only Q, K,
  V, the output and a log-sum-exp (``b·a·s`` fp32): no s² term. On the CPU, SDPA takes its flash kernel only
  without attention dropout; with dropout it runs the math path, in fp32 even under bf16 autocast, saving softmax
  output, dropout mask and dropped probabilities: ``3·4·a·s²·b`` bytes. ``attn_implementation="eager"`` saves the
  fp32 softmax, the mask and the half dropped probabilities (``(4 + m + c)·a·s²·b``).
- outside the layers: embedding indices (int64), the embedding LayerNorm/dropout, the pooler (fp32: the pooler's
  ``[:, 0]`` view keeps the whole last hidden state alive), and for causal LM the fp32 log-softmax of the logits
  (``4·b·s·V``) that the cross-entropy saves.
- gradient checkpointing (transformers checkpoints each layer, non-reentrant): each layer keeps its input
  (``4·b·s·h`` under autocast) and one layer's activations are rebuilt at a time in the backward pass.
- other model types use the BERT/GPT-2 inventory of a pre-LN block with a two-tensor MLP; the breakdown says
  ``generic`` then (gated MLPs, rotary embeddings and RMSNorm save more).

Overhead
--------
Autocast weight copies; DDP buckets; FSDP/ZeRO-3 gathered parameters; for causal LM two fp32 logits-sized
buffers at the start of the backward pass (the log-softmax gradient and the logits gradient, ``8·b·s·V``); and the
optimizer step's temporaries when they exceed what the forward pass holds (they live while activations are
freed): ``torch.optim.AdamW`` with ``foreach`` (the CUDA default) allocates one ``exp_avg_sq.sqrt()`` for all
parameters (4N); on the CPU it loops per tensor (4 x the largest tensor); fused AdamW, SGD and 8-bit AdamW none;
Adafactor a few copies of its largest tensor.

On CUDA, torch keeps one cuBLAS workspace per (handle, stream) in its caching allocator, so it counts in the
allocator's peak: one for the main thread's forward pass and one for the autograd thread's backward pass, 32 MiB
each on Hopper (torch's default ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` from sm90; NVIDIA recommends 4 MiB before),
``cublas_workspaces`` = 64 MiB, which errs high by up to ~56 MiB on older GPUs. Measured on an H100 (bert-large,
``runs/bert_large-h100``): the allocator held weights + gradients + 0.064 GiB after the backward pass and weights
+ predicted activations + 0.031 GiB after the forward pass.

Gradients and activations
-------------------------
Without gradient accumulation (one micro-batch per optimizer step) the Trainer's ``zero_grad(set_to_none=True)``
frees ``.grad`` after each step, so the next forward pass runs without gradients; they are created during the
backward pass while the activations are freed, and are not held at once with them. With F the bytes the forward
pass holds at the backward start (activations, autocast weight copies, loss buffers), G the gradients and S the
optimizer step's temporaries (held with G), the varying part of the peak is ``max(F, G + S)`` rather than
``G + max(F, S)``; *overlap* = ``min(G, F - S)`` when ``F > S``, else 0. This applies to plain PyTorch and DDP
(whose buckets stay in *overhead*). It does not apply (overlap 0, the plain sum):

- with gradient accumulation (> 1): the first micro-batch's gradients persist through the next forward passes;
- under DeepSpeed: its gradient buffers and partitions are allocated up front and kept;
- under FSDP: kept as the sum (not checked against FSDP's sources or a measurement).

Why, and how far to trust it: the bert-large sweep on one H100 (``runs/bert_large-h100``, seq 512) predicted
8.11 GiB for bs 4 fp32 AdamW against 6.99 GiB measured (+16 %; fp16/bf16 +17 %, Adafactor +25 %, 8-bit AdamW
+21 %) although its measured activations (3.147 GiB forward minus model load, one 32 MiB cuBLAS workspace included)
matched the predicted 3.115 GiB; the gradient-accumulation and ZeRO rows were within 4 %. This correction (and the
cuBLAS workspace term) was fitted on that same sweep and is checked against it: it is not an independent
validation. What remains unmodelled there: the bs 4 rows still read ~0.07 GiB (1-1.5 %) low, the gradients of the
last layer computed at the backward start while every activation is still held.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hfscale.memory import parse_memory_size
from hfscale.model import build_meta_model
from hfscale.spec import DataSpec, ModelSpec, TrialSpec
from hfscale.strategy import EIGHT_BIT_OPTIMIZERS, DeepSpeedSpec, FsdpSpec, Strategy, StrategyError

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

GIB = 1024**3
CUDA_CONTEXT_BYTES = 1343 * 1024**2
"""Assumed, not measured: the CUDA context outside torch's allocator, from the V100 reference (1343 MB used after CUDA
initialisation alone, ``shared/reference/v100-bert-large.md``). Other GPUs, drivers and CUDA versions differ."""
CUBLAS_WORKSPACES_BYTES = 2 * 32 * 1024**2
"""Two cuBLAS workspaces in torch's allocator (forward thread and autograd thread), 32 MiB each on Hopper."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes' ``min_8bit_size``: smaller tensors keep fp32 states."""
BNB_BLOCK_SIZE = 256
"""bitsandbytes' blockwise quantisation: one fp32 ``absmax`` per block per state."""
BNB_QMAP_BYTES = 2 * 256 * 4
"""The two shared 256-entry fp32 quantisation maps (``dynamic``, ``udynamic``)."""

Family = Literal["bert", "gpt2", "generic"]
_BERT_LIKE = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra"})
_GPT2_LIKE = frozenset({"gpt2"})


# --------------------------------------------------------------------------------------------------------------
# What is read from the meta model
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One distinct parameter tensor of the model (tied parameters appear once)."""

    name: str
    shape: tuple[int, ...]
    in_embedding: bool
    """Owned by an ``nn.Embedding`` (bitsandbytes keeps 32-bit states for these under the Trainer)."""
    in_matmul: bool
    """Used by an ``nn.Linear``/``Conv1D`` (autocast makes a half copy of it for the forward pass)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the estimate needs to know about a model, read from a meta-device build."""

    model_type: str
    task: Literal["classification", "causal_lm"]
    family: Family
    """Which activation inventory applies (see the module docstring)."""
    params: tuple[ParamInfo, ...]
    largest_layer_params: int
    """Largest count of parameters owned directly by one module (DeepSpeed's ``model_to_params``)."""
    block_params: int
    """Parameters of the largest transformer block (the model's ``_no_split_modules``): one FSDP unit."""
    num_blocks: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    activation: str
    """The MLP activation (``gelu``, ``gelu_new``, ``relu``, ...)."""
    hidden_dropout: float
    attention_dropout: float
    embedding_dropout: float
    attn_implementation: str
    """``sdpa`` (transformers 5 default), ``eager``, ``flash_attention_2``, ..."""
    separate_qkv: bool
    """Query, key and value are separate ``nn.Linear`` (BERT) rather than one fused projection (GPT-2)."""

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def num_tensors(self) -> int:
        return len(self.params)

    @property
    def matmul_params(self) -> int:
        return sum(p.numel for p in self.params if p.in_matmul)

    @property
    def largest_tensor_params(self) -> int:
        return max((p.numel for p in self.params), default=0)

    @property
    def root_unit_params(self) -> int:
        """Parameters outside the transformer blocks (embeddings, heads): FSDP's root unit."""
        return self.num_params - self.block_params * self.num_blocks


def model_shape_from_module(
    model: nn.Module, *, model_type: str | None = None, task: Literal["classification", "causal_lm"] | None = None
) -> ModelShape:
    """Read a :class:`ModelShape` from a built model (on the meta device or not; nothing is allocated)."""
    from torch import nn

    config = getattr(model, "config", None)
    model_type = model_type or getattr(config, "model_type", "unknown")
    if task is None:
        task = "causal_lm" if type(model).__name__.endswith(("LMHeadModel", "ForCausalLM")) else "classification"

    matmul_ids: set[int] = set()
    embedding_ids: set[int] = set()
    for module in model.modules():
        kind = type(module).__name__
        direct = list(module.parameters(recurse=False))
        if isinstance(module, nn.Embedding):
            embedding_ids.update(id(p) for p in direct)
        elif isinstance(module, nn.Linear) or kind == "Conv1D":
            matmul_ids.update(id(p) for p in direct)
    params = tuple(
        ParamInfo(
            name=name,
            shape=tuple(int(d) for d in p.shape),
            in_embedding=id(p) in embedding_ids,
            in_matmul=id(p) in matmul_ids,
        )
        for name, p in model.named_parameters()  # deduplicated: a tied parameter appears once
    )
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    block_sizes = [
        sum(p.numel() for p in m.parameters())
        for m in model.modules()
        if type(m).__name__ in block_names and "Embedding" not in type(m).__name__
    ]

    def cfg(*names: str, default: Any = None) -> Any:
        for n in names:
            value = getattr(config, n, None)
            if value is not None:
                return value
        return default

    hidden = int(cfg("hidden_size", "n_embd", "d_model", default=0))
    family: Family = "bert" if model_type in _BERT_LIKE else "gpt2" if model_type in _GPT2_LIKE else "generic"
    return ModelShape(
        model_type=model_type,
        task=task,
        family=family,
        params=params,
        largest_layer_params=int(largest_layer),
        block_params=max(block_sizes, default=0),
        num_blocks=len(block_sizes),
        hidden_size=hidden,
        num_layers=int(cfg("num_hidden_layers", "n_layer", default=len(block_sizes))),
        num_heads=int(cfg("num_attention_heads", "n_head", default=1)),
        intermediate_size=int(cfg("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
        vocab_size=int(cfg("vocab_size", default=0)),
        activation=str(cfg("hidden_act", "activation_function", default="gelu")),
        hidden_dropout=float(cfg("hidden_dropout_prob", "resid_pdrop", "hidden_dropout", default=0.0)),
        attention_dropout=float(cfg("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout", default=0.0)),
        embedding_dropout=float(cfg("embd_pdrop", "hidden_dropout_prob", "hidden_dropout", default=0.0)),
        attn_implementation=str(getattr(config, "_attn_implementation", None) or "sdpa"),
        separate_qkv=family != "gpt2",
    )


def describe_model(model: ModelSpec, data: DataSpec | None = None) -> ModelShape:
    """Build the model of a :class:`ModelSpec` on the meta device and read its :class:`ModelShape`.

    The config is built as the trial builds it (:func:`hfscale.model.build_config`): ``AutoConfig.for_model`` with the
    overrides, ``num_labels`` from the data for classification; a ``pretrained`` name reads only its config.

    Raises:
        ValueError: when transformers does not know the model type or refuses the overrides.
    """
    data = data or DataSpec()
    as_json = functools.partial(json.dumps, sort_keys=True, default=str)
    return _describe_cached(as_json(dataclasses.asdict(model)), as_json(dataclasses.asdict(data)))


@functools.lru_cache(maxsize=32)
def _describe_cached(model_json: str, data_json: str) -> ModelShape:
    model = ModelSpec(**json.loads(model_json))
    meta = build_meta_model(model, DataSpec(**json.loads(data_json)))
    return model_shape_from_module(meta, model_type=meta.config.model_type, task=model.task)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------------------------


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
    freed (see the module docstring). 0 where the total is the plain sum."""
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


def activation_bytes(
    shape: ModelShape,
    *,
    batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    device: str = "cuda",
    gradient_checkpointing: bool = False,
    half_module: bool = False,
) -> ActivationBytes:
    """Bytes saved for backward by one forward pass (see the module docstring for the inventory).

    Args:
        half_module: the whole module is cast to 16 bits (DeepSpeed bf16/fp16): no autocast, half residual stream.

    Raises:
        ValueError: on a non-positive batch size or sequence length.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    b, s = batch_size, seq_len
    h, a, i, v = shape.hidden_size, max(shape.num_heads, 1), shape.intermediate_size, shape.vocab_size
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
        core = 3 * c * tokens * h + scores * (4 + mask(shape.attention_dropout, c) + c)
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
    return ActivationBytes(
        saved=layers_kept + recompute + outside,
        transient=transient,
        per_layer=per_layer,
        layers_kept=layers_kept,
        recompute=recompute,
        outside_layers=outside,
        attention_path=path,
    )


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


def _optimizer_step_temp_bytes(shape: ModelShape, optimizer: str, device: str, local_fraction: float) -> int:
    """Temporaries of one optimizer step (see the module docstring)."""
    if optimizer == "adamw_torch":
        if device == "cuda":
            return int(4 * shape.num_params * local_fraction)  # foreach: exp_avg_sq.sqrt() for every tensor
        return 4 * shape.largest_tensor_params  # single-tensor loop
    if optimizer == "adafactor":
        return 3 * 4 * shape.largest_tensor_params
    return 0


def _sgd_momentum(training_args: dict[str, Any]) -> float:
    optim_args = training_args.get("optim_args") or ""
    match = re.search(r"(?:^|,)\s*momentum\s*=\s*([0-9.eE+-]+)", str(optim_args))
    return float(match.group(1)) if match else 0.0


def _shard_group(strategy: Strategy) -> int:
    if strategy.fsdp is None:
        return strategy.num_processes
    sharding = strategy.fsdp.sharding
    if sharding == "no_shard":
        return 1
    if sharding == "hybrid_shard":
        return strategy.num_processes // strategy.num_machines
    return strategy.num_processes


def estimate_memory(
    spec_or_model: TrialSpec | ModelSpec | ModelShape | nn.Module,
    strategy: Strategy | None = None,
    *,
    seq_len: int | None = None,
    data: DataSpec | None = None,
    training_args: dict[str, Any] | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of one process for a trial, or for a model under a strategy.

    Call it with a :class:`~hfscale.spec.TrialSpec` (everything comes from it), or with a model (a
    :class:`~hfscale.spec.ModelSpec`, a :class:`ModelShape` or a built ``nn.Module``), a strategy and ``seq_len``.

    Raises:
        ValueError: when the strategy or the sequence length is missing, or the optimizer is not modelled.
    """
    if isinstance(spec_or_model, TrialSpec):
        spec = spec_or_model
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
    n = shape.num_params
    device = strategy.device
    mixed = strategy.precision in ("fp16", "bf16")
    optimizer_bytes = optimizer_state_bytes(
        shape, strategy.optimizer, device=device, momentum=_sgd_momentum(training_args)
    )
    notes: list[str] = []
    overhead: dict[str, int] = {}
    ds: DeepSpeedSpec | None = strategy.deepspeed
    fsdp: FsdpSpec | None = strategy.fsdp
    local_fraction = 1.0
    half_module = False

    if ds is not None:
        g = strategy.num_processes
        half_module = mixed
        p = 2 if mixed else 4
        master = 4 * n if (mixed or ds.zero_stage >= 1) else 0
        fp32_grads = 4 * n if mixed else 0
        offload_opt = ds.offload_optimizer != "none"
        if offload_opt:
            optimizer_bytes = 0  # DeepSpeed's CPU Adam: states, master weights and fp32 grads on the host
            master = fp32_grads = 0
            notes.append("optimizer states, fp32 master weights and fp32 gradients offloaded to the host")
        stage = ds.zero_stage
        weights = p * n
        if stage == 0:
            gradients = p * n + fp32_grads
            optim = optimizer_bytes + master
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
        local_fraction = 1 / g if stage >= 1 else 1.0
    elif fsdp is not None and fsdp.sharding != "no_shard":
        g = _shard_group(strategy)
        offload = fsdp.cpu_offload
        weights = 0 if offload else 4 * n / g
        gradients = 0 if offload else 4 * n / g
        optim = 0 if offload else optimizer_bytes / g
        local_fraction = 0.0 if offload else 1 / g
        pg = 2 if mixed else 4  # accelerate's MixedPrecisionPolicy: param_dtype = reduce_dtype = the half type
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
        overhead["gathered_params"] = gathered
        if offload:
            notes.append("FSDP cpu_offload: shards, gradients and optimizer states on the host")
    else:
        weights = 4 * n
        gradients = 4 * n
        optim = optimizer_bytes
        if strategy.num_processes > 1:
            overhead["ddp_buckets"] = 4 * n
        if mixed:
            overhead["autocast_weight_copies"] = 2 * shape.matmul_params

    act = activation_bytes(
        shape,
        batch_size=strategy.per_device_batch_size,
        seq_len=seq_len,
        precision=strategy.precision,
        device=device,
        gradient_checkpointing=strategy.gradient_checkpointing,
        half_module=half_module,
    )
    if act.transient:
        overhead["loss_buffers"] = act.transient
    forward_extra = act.saved + overhead.get("autocast_weight_copies", 0) + act.transient
    if not (ds is not None and ds.offload_optimizer != "none"):
        step_temp = _optimizer_step_temp_bytes(shape, strategy.optimizer, device, local_fraction)
        # the step's temporaries live after the activations are freed: they add only what exceeds them
        if step_temp > forward_extra:
            overhead["optimizer_step"] = step_temp - forward_extra
    else:
        step_temp = 0
    if device == "cuda":
        overhead["cublas_workspaces"] = CUBLAS_WORKSPACES_BYTES
    overlap = 0
    if ds is None and fsdp is None and strategy.gradient_accumulation_steps == 1 and forward_extra > step_temp:
        # zero_grad(set_to_none=True) freed the gradients: peak = max(forward, gradients + step) instead of the sum
        overlap = min(int(gradients), forward_extra - step_temp)
        if overlap:
            notes.append(
                "one micro-batch per step: gradients are created while activations are freed, not held at once "
                "(overlap subtracted from the sum)"
            )
    if shape.family == "generic":
        notes.append(f"activations of {shape.model_type!r} use the generic pre-LN inventory (approximate)")
    if strategy.optimizer == "paged_adamw_8bit" and device == "cuda":
        notes.append("paged optimizer states live in CUDA managed memory: counted, but outside torch's allocator")

    parts = {
        "weights": weights,
        "gradients": gradients,
        "optimizer": optim,
        "activations": act.saved,
        "overhead": sum(overhead.values()),
    }
    total = sum(parts.values()) - overlap
    return MemoryEstimate(
        weights_gib=parts["weights"] / GIB,
        gradients_gib=parts["gradients"] / GIB,
        optimizer_gib=parts["optimizer"] / GIB,
        activations_gib=parts["activations"] / GIB,
        overhead_gib=parts["overhead"] / GIB,
        total_gib=total / GIB,
        overlap_gib=overlap / GIB,
        device=device,
        num_params=n,
        largest_layer_params=shape.largest_layer_params,
        batch_size=strategy.per_device_batch_size,
        seq_len=seq_len,
        overhead_parts_gib={k: v / GIB for k, v in overhead.items()},
        activation_parts={
            "family": shape.family,
            "attention_path": act.attention_path,
            "per_layer_bytes": act.per_layer,
            "layers_kept_bytes": act.layers_kept,
            "recompute_bytes": act.recompute,
            "outside_layers_bytes": act.outside_layers,
        },
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------------------------------------------
# Will it fit?
# --------------------------------------------------------------------------------------------------------------


def default_reserve_bytes(device: str) -> int:
    """Memory outside the allocator's peak that a device needs: on a GPU the assumed CUDA context
    (:data:`CUDA_CONTEXT_BYTES`, the V100 reference's figure, not measured), nothing on the CPU."""
    return CUDA_CONTEXT_BYTES if device == "cuda" else 0


def predicted_to_fit(estimate: MemoryEstimate, budget_bytes: int, *, reserve_bytes: int | None = None) -> bool:
    """Whether the predicted peak plus the reserve (default: :func:`default_reserve_bytes`) fits the budget."""
    reserve = default_reserve_bytes(estimate.device) if reserve_bytes is None else reserve_bytes
    return estimate.total_bytes + reserve <= budget_bytes


@dataclass(frozen=True, kw_only=True)
class FitPrediction:
    """What ``--skip-predicted-oom`` needs for one trial."""

    estimate: MemoryEstimate
    fits: bool
    reason: str | None
    """Why the trial is skipped, with the predicted figure; None when it is predicted to fit."""


def predict_fit(spec: TrialSpec, budget_bytes: int, *, reserve_bytes: int | None = None) -> FitPrediction:
    """Estimate a trial and say whether it fits ``budget_bytes`` per device, with a skip reason when it does not.

    Raises:
        ValueError: as :func:`estimate_memory`.
    """
    estimate = estimate_memory(spec)
    reserve = default_reserve_bytes(estimate.device) if reserve_bytes is None else reserve_bytes
    fits = predicted_to_fit(estimate, budget_bytes, reserve_bytes=reserve)
    reason = None
    if not fits:
        reason = (
            f"predicted out of memory: {estimate.total_gib:.2f} GiB peak per device"
            + (
                f" + {reserve / GIB:.2f} GiB "
                + ("CUDA context (assumed, V100 reference)" if reserve_bytes is None else "reserve")
                if reserve
                else ""
            )
            + f" > budget {budget_bytes / GIB:.2f} GiB (hfscale estimate; run without --skip-predicted-oom to try)"
        )
    return FitPrediction(estimate=estimate, fits=fits, reason=reason)


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------


def default_strategies(
    *, num_gpus: int, num_machines: int = 1, batch_size: int = 8, device: Literal["cuda", "cpu"] = "cuda"
) -> list[Strategy]:
    """The strategies ``hfscale estimate MODEL`` compares when no recipe is given."""
    half = "bf16"
    base = Strategy(
        name="fp32",
        device=device,
        per_device_batch_size=batch_size,
        num_processes=num_gpus,
        num_machines=num_machines,
    )
    out = [
        base,
        base.replace(name=half, precision=half),
        base.replace(name=f"{half}-ckpt", precision=half, gradient_checkpointing=True),
        base.replace(name=f"{half}-adafactor", precision=half, optimizer="adafactor"),
        base.replace(name=f"{half}-adam8bit", precision=half, optimizer="adamw_bnb_8bit"),
        base.replace(name=f"{half}-zero2", precision=half, deepspeed=DeepSpeedSpec(zero_stage=2)),
        base.replace(
            name=f"{half}-zero2-offload",
            precision=half,
            deepspeed=DeepSpeedSpec(zero_stage=2, offload_optimizer="cpu"),
        ),
        base.replace(name=f"{half}-zero3", precision=half, deepspeed=DeepSpeedSpec(zero_stage=3)),
        base.replace(
            name=f"{half}-zero3-offload",
            precision=half,
            deepspeed=DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
        ),
    ]
    if num_gpus > 1:
        out.append(base.replace(name=f"{half}-fsdp", precision=half, fsdp=FsdpSpec()))
    return out


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--config expects key=value, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.strip(), parsed


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfscale estimate",
        description="Predict each strategy's peak memory per device before running (the model is built on the "
        "meta device: nothing is allocated or downloaded).",
    )
    parser.add_argument("target", help="a recipe YAML, or a transformers model type (bert, gpt2, ...)")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        type=_parse_override,
        metavar="KEY=VALUE",
        help="model config override (repeatable), e.g. --config hidden_size=1024",
    )
    parser.add_argument("--task", choices=["classification", "causal_lm"], default=None)
    parser.add_argument(
        "--num-gpus", type=_positive_int, default=None, help="processes in all (default: recipe's or 1)"
    )
    parser.add_argument("--num-machines", type=_positive_int, default=None)
    parser.add_argument("--memory-budget", default=None, help="memory per device, e.g. 80GiB, 16GB")
    parser.add_argument("--seq-len", type=_positive_int, default=None)
    parser.add_argument("--batch-size", type=_positive_int, default=None, help="per-device batch size")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _specs_from_args(args: argparse.Namespace) -> list[TrialSpec]:
    target = args.target
    overrides: dict[str, Any] = dict(args.config)
    if target.endswith((".yaml", ".yml")) or Path(target).is_file():
        from hfscale.recipe import load_recipe

        recipe = load_recipe(target)
        specs = recipe.trial_specs(num_processes=args.num_gpus, num_machines=args.num_machines)
        changed = []
        for spec in specs:
            strategy = spec.strategy
            if args.batch_size is not None:
                strategy = strategy.replace(per_device_batch_size=args.batch_size)
            if args.device is not None:
                strategy = strategy.replace(device=args.device)
            model = spec.model
            if overrides or args.task:
                model = dataclasses.replace(model, config={**model.config, **overrides}, task=args.task or model.task)
            data = spec.data if args.seq_len is None else dataclasses.replace(spec.data, seq_len=args.seq_len)
            changed.append(dataclasses.replace(spec, strategy=strategy, model=model, data=data))
        return changed
    model = ModelSpec(type=target, task=args.task or "classification", config=overrides)
    data = DataSpec(seq_len=args.seq_len or DataSpec().seq_len)
    strategies = default_strategies(
        num_gpus=args.num_gpus or 1,
        num_machines=args.num_machines or 1,
        batch_size=args.batch_size or 8,
        device=args.device or "cuda",
    )
    return [TrialSpec(name=s.name, strategy=s, model=model, data=data) for s in strategies]


def _gib_cell(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3f}" if value < 0.01 else f"{value:.2f}"


def format_table(rows: Sequence[tuple[TrialSpec, MemoryEstimate, bool | None]]) -> str:
    """A plain-text table of estimates (GiB per device), one row per trial."""
    headers = ["trial", "strategy", "weights", "grads", "optim", "activ", "overhead", "-overlap", "total", "fits"]
    lines = []
    for spec, est, fits in rows:
        lines.append(
            [
                spec.name,
                spec.strategy.describe(),
                *(
                    _gib_cell(x)
                    for x in (
                        est.weights_gib,
                        est.gradients_gib,
                        est.optimizer_gib,
                        est.activations_gib,
                        est.overhead_gib,
                        est.overlap_gib,
                        est.total_gib,
                    )
                ),
                "" if fits is None else ("yes" if fits else "NO"),
            ]
        )
    widths = [max(len(h), *(len(r[k]) for r in lines)) for k, h in enumerate(headers)]

    def fmt(cells: Iterable[str]) -> str:
        out = []
        for k, cell in enumerate(cells):
            out.append(cell.ljust(widths[k]) if k < 2 else cell.rjust(widths[k]))
        return "  ".join(out).rstrip()

    return "\n".join([fmt(headers), fmt("-" * w for w in widths), *(fmt(r) for r in lines)])


def _config_error() -> type[Exception]:
    """huggingface_hub's strict-config validation error (a plain ``Exception``), RuntimeError where it is missing."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return RuntimeError
    return StrictDataclassError


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        budget = parse_memory_size(args.memory_budget) if args.memory_budget else None
        specs = _specs_from_args(args)
        rows = []
        for spec in specs:
            est = estimate_memory(spec)
            rows.append((spec, est, None if budget is None else predicted_to_fit(est, budget)))
    except (ValueError, StrategyError, FileNotFoundError, ImportError) as exc:
        print(f"hfscale estimate: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TypeError, _config_error()) as exc:  # transformers/torch rejecting a config value
        print(f"hfscale estimate: cannot build the model from its config (check --config): {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"trial": s.name, "fits": f, "estimate": e.to_dict()} for s, e, f in rows], indent=2))
        return 0
    first_spec, first = rows[0][0], rows[0][1]
    header = (
        f"{first_spec.model.type} ({first.num_params / 1e6:.1f}M parameters, largest layer "
        f"{first.largest_layer_params / 1e6:.1f}M), seq {first.seq_len}, GiB per device"
    )
    if budget is not None:
        reserve = default_reserve_bytes(first.device)
        header += f"; budget {budget / GIB:.2f} GiB, fits = total" + (
            f" + {reserve / GIB:.2f} GiB CUDA context within budget (context assumed, not measured: the V100 "
            "reference's figure after CUDA initialisation, shared/reference/v100-bert-large.md)"
            if reserve
            else " within budget"
        )
    print(header)
    print(format_table(rows))
    notes = sorted({n for _, e, _ in rows for n in e.notes})
    for note in notes:
        print(f"note: {note}")
    return 0


__all__ = [
    "CUBLAS_WORKSPACES_BYTES",
    "CUDA_CONTEXT_BYTES",
    "ActivationBytes",
    "FitPrediction",
    "MemoryEstimate",
    "ModelShape",
    "ParamInfo",
    "activation_bytes",
    "default_reserve_bytes",
    "default_strategies",
    "describe_model",
    "estimate_memory",
    "format_table",
    "main",
    "model_shape_from_module",
    "optimizer_state_bytes",
    "predict_fit",
    "predicted_to_fit",
]
