"""Model FLOPs per token, device peak FLOP/s, and model FLOPs utilisation (MFU).

FLOPs per trained token, for a decoder or encoder transformer (PaLM, Chowdhery et al. 2022, appendix B; the same
count as the Chinchilla paper's appendix F without the embedding terms, and torchtitan's ``get_num_flop_per_token``)::

    flops_per_token = 6 * N + 12 * L * H * T

- ``N``: parameters that do a matrix multiplication per token: all but the embedding tables (token, position and
  token-type ``nn.Embedding`` lookups do no arithmetic), plus the output head, tied to the token embedding or not
  (a tied head is the same tensor as a table, but its matmul with the hidden states is real work: left out, a tied
  GPT-2's count reads 0.62x of torch's FLOP counter). Each such parameter does one multiply-add per token in the
  forward pass (2 FLOPs) and two in the backward pass (gradient with respect to the input and to the weight: 4
  FLOPs), hence 6.
- ``12 * L * H * T``: attention scores and the weighted sum of values, which have no parameters: per layer ``L``
  and token, ``2 * 2 * H * T`` FLOPs forward (``QK^T`` and ``AV`` over a context of ``T`` tokens), times 3 for
  forward + backward. ``H`` is the attention width, query heads x head dimension (``config.head_dim`` where the
  config has one): PaLM writes the hidden size, which is the same number only when ``head_dim = hidden / heads``.
  Qwen3-0.6B has 16 heads x 128 = 2048 against a hidden size of 1024, and the hidden size read its attention at
  half (formula / counted 0.73 on a Qwen3-shaped model at 256 tokens, ``tests/measure/test_flops.py``). Grouped-query
  attention shares keys and values between query heads, but every query head still forms its own scores, so the
  query heads count. Causal masking is not subtracted (as in PaLM).
- LoRA: the adapters' two matrices per layer are in ``N`` like any Linear; a frozen parameter still needs the
  gradient with respect to its input but none for itself, so it counts 4 instead of 6 (``6 * N - 2 * N_frozen``).
  Upstream of the first adapter no input needs a gradient either (the embeddings are frozen): a
  :class:`GradientFlowProbe` reads, in the first training forward, the parameters whose input needs none (2 FLOPs
  each fewer) and the attention backward matmuls skipped (``2 H T`` each fewer). Without it the formula read 1.061x
  torch's FLOP counter on a 2-layer Llama with q/v adapters (1.244x with the MLP's gate only); with it, 1.003x.
  QLoRA's 4-bit weights are dequantised to the compute dtype for each matmul, so they count at their unquantised
  shape (bitsandbytes packs two per stored byte).

This is *model* FLOPs, the useful work: activation recomputation (gradient checkpointing runs the forward pass a
second time, 8N instead of 6N) is deliberately not counted, so checkpointing shows up as a lower MFU, which is
what it costs. Peaks are dense (no 2:4 sparsity) tensor-core figures from NVIDIA's datasheets.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from hfscale.core.params import param_numel

logger = logging.getLogger(__name__)

ComputeDtype = Literal["fp32", "tf32", "fp16", "bf16"]

_H_SXM = {"fp32": 66.9e12, "tf32": 494.7e12, "fp16": 989.5e12, "bf16": 989.5e12}

# Sources (NVIDIA product datasheets, dense figures; where a datasheet quotes "with sparsity" the figure is halved):
#   H100 SXM / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet, https://www.nvidia.com/en-us/data-center/h100/
#     (SXM: TF32 989 TFLOPS sparse -> 494.7 dense, BF16/FP16 1,979 sparse -> 989.5, FP32 67)
#   H200 / H200 NVL: "NVIDIA H200 Tensor Core GPU" datasheet, https://www.nvidia.com/en-us/data-center/h200/
#   GH200: "NVIDIA GH200 Grace Hopper Superchip" datasheet (the same Hopper SXM tensor figures)
#   A100: "NVIDIA A100 Tensor Core GPU" datasheet, https://www.nvidia.com/en-us/data-center/a100/
#     (TF32 156, BF16/FP16 312, FP32 19.5 TFLOPS, dense)
#   A10, A30, A40, L4, L40S, V100, T4: the product datasheets at https://www.nvidia.com/en-us/data-center/
#   A10G: AWS EC2 G5 instance documentation (the A10G's tensor throughput is below the A10's)
# TF32 is the fp32-input tensor-core rate: MFU divides by it when an fp32 run has TF32 matmuls on.

DEVICE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    # Hopper: H100 / H200 datasheets (tensor-core figures are quoted with sparsity; halved here).
    "H100 SXM": _H_SXM,
    "H100 PCIe": {"fp32": 51e12, "tf32": 378e12, "fp16": 756e12, "bf16": 756e12},
    "H100 NVL": {"fp32": 60e12, "tf32": 417.5e12, "fp16": 835e12, "bf16": 835e12},
    "H200": _H_SXM,
    "H200 NVL": {"fp32": 60e12, "tf32": 417.5e12, "fp16": 835e12, "bf16": 835e12},
    "GH200": _H_SXM,
    # Ampere: A100 datasheet (SXM and PCIe share the tensor figures), A10 and A10G (the AWS variant, lower
    # tensor throughput), A30, A40.
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12},
    "A10G": {"tf32": 35e12, "fp16": 70e12, "bf16": 70e12},
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "fp16": 125e12, "bf16": 125e12},
    "A30": {"fp32": 10.3e12, "tf32": 82e12, "fp16": 165e12, "bf16": 165e12},
    "A40": {"fp32": 37.4e12, "tf32": 74.8e12, "fp16": 149.7e12, "bf16": 149.7e12},
    # Ada: L4, L40S.
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "fp16": 121e12, "bf16": 121e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "fp16": 362e12, "bf16": 362e12},
    # Volta and Turing have no bf16 (and no tf32).
    "V100 SXM": {"fp32": 15.7e12, "fp16": 125e12},
    "V100 PCIe": {"fp32": 14e12, "fp16": 112e12},
    "T4": {"fp32": 8.1e12, "fp16": 65e12},
}
"""Dense peak FLOP/s per device and compute dtype. Override with ``ThroughputCallback(peak_flops=...)``."""

# Checked in order: the first pattern found in the lower-cased CUDA device name wins, so the more specific
# names come first (gh200 / h200 nvl before h200, h100 nvl / pcie before h100, a10g before a10, l40s before l4).
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"gh200", "GH200"),
    (r"h200.*nvl", "H200 NVL"),
    (r"h200", "H200"),
    (r"h100.*nvl", "H100 NVL"),
    (r"h100.*(pcie|hbm2e)", "H100 PCIe"),
    (r"h100", "H100 SXM"),
    (r"a100", "A100"),
    (r"\ba10g\b", "A10G"),
    (r"\ba10\b", "A10"),
    (r"\ba30\b", "A30"),
    (r"\ba40\b", "A40"),
    (r"\bl40s\b", "L40S"),
    (r"\bl4\b", "L4"),
    (r"v100.*pcie", "V100 PCIe"),
    (r"v100", "V100 SXM"),
    (r"\bt4\b", "T4"),
)


def canonical_device(device_name: str) -> str | None:
    """The :data:`DEVICE_PEAK_FLOPS` key for a CUDA device name (``torch.cuda.get_device_name()``), or None.

    ``"NVIDIA H100 80GB HBM3"`` -> ``"H100 SXM"``, ``"NVIDIA H100 PCIe"`` -> ``"H100 PCIe"``,
    ``"Tesla V100-SXM2-16GB"`` -> ``"V100 SXM"``, ``"NVIDIA A10G"`` -> ``"A10G"``.
    """
    name = device_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def peak_flops_per_s(device_name: str, dtype: ComputeDtype) -> float | None:
    """Dense peak FLOP/s of one device for a compute dtype, or None when the device or dtype is not in the table."""
    key = canonical_device(device_name)
    if key is None:
        return None
    return DEVICE_PEAK_FLOPS[key].get(dtype)


_OBSERVED_DTYPES: dict[str, ComputeDtype] = {"bfloat16": "bf16", "float16": "fp16"}


def compute_dtype(args: Any, observed: str | None = None) -> ComputeDtype:
    """The dtype matrix multiplications run in: bf16, fp16, tf32 or fp32.

    Args:
        args: ``TrainingArguments`` (``bf16``/``fp16``/``tf32``).
        observed: the dtype a ``nn.Linear`` really produced in the first training forward (``bfloat16``,
            ``float16``, ``float32``; :class:`hfscale.measure.verify.LinearDtypeProbe`). It wins over the arguments: a
            model loaded in bf16 without ``args.bf16`` computes in bf16.

    fp32 counts as tf32 when torch is allowed to use TF32 for matmuls: ``args.tf32``, or the flag as torch holds it
    inside the run (:func:`hfscale.techniques.kernels.tf32_matmul_enabled`: transformers also turns it on by itself for
    ``torch_compile`` on an Ampere or newer GPU, and sets it through the torch >= 2.9 API, after which reading the
    legacy ``allow_tf32`` raises).
    """
    if observed in _OBSERVED_DTYPES:
        return _OBSERVED_DTYPES[observed]
    if observed is None and getattr(args, "bf16", False):
        return "bf16"
    if observed is None and getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "tf32", None):
        return "tf32"
    from hfscale.techniques.kernels import tf32_matmul_enabled

    try:
        return "tf32" if tf32_matmul_enabled() else "fp32"
    except ImportError:  # no torch: nothing enabled TF32
        return "fp32"


def count_parameters_for_flops(model: Any, *, exclude_embeddings: bool = True, frozen_only: bool = False) -> int:
    """Parameters of ``model`` as the FLOPs count needs them: each shared tensor once, each at the size it computes
    with (:func:`hfscale.core.params.param_numel`: QLoRA's dequantised shape, ZeRO-3's full size), without
    ``nn.Embedding`` tables when asked. (What each rank holds is
    :func:`hfscale.measure.readback.count_parameters_held`.)

    An output projection tied to the token embedding is the same tensor, so it is excluded with it. peft's
    ``original_module`` (the head a ``modules_to_save`` copy replaces in forward) computes nothing and is left out.
    ``frozen_only`` counts only parameters without ``requires_grad`` (LoRA's base).
    """
    import torch

    embedding_ids: set[int] = set()
    if exclude_embeddings:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                embedding_ids.update(id(p) for p in module.parameters(recurse=False))
    return sum(
        param_numel(p)
        for name, p in model.named_parameters()
        if id(p) not in embedding_ids
        and "original_module" not in name.split(".")
        and not (frozen_only and p.requires_grad)
    )


def matmul_parameters(model: Any, *, frozen_only: bool = False) -> int:
    """``N`` of the FLOPs formula: :func:`count_parameters_for_flops` without embeddings, plus an output head tied to an
    embedding table (the same tensor, but a real matmul per token). ``frozen_only``: the part of ``N`` that gets
    no weight gradient (LoRA's frozen base), the ``frozen_params`` of :func:`transformer_flops_per_token`."""
    import torch

    count = count_parameters_for_flops(model, frozen_only=frozen_only)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        embedding_ids = {
            id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)
        }
        if id(weight) in embedding_ids and not (frozen_only and weight.requires_grad):
            count += param_numel(weight)
    return count


@dataclass(frozen=True)
class GradientFlow:
    """Where the first training forward of a partly frozen model (LoRA) needed no gradient, per token.

    ``6 N - 2 N_frozen`` assumes every matmul's input needs a gradient. Upstream of the first trainable parameter it
    does not: with the embeddings frozen, layer 0's frozen projections do no backward at all, an adapter's first
    matrix computes only its weight gradient, and the attention of that layer skips the gradients of whichever of
    Q, K and V no adapter feeds. These two counts remove exactly that work (:class:`GradientFlowProbe` reads them).
    """

    no_input_grad_params: int = 0
    """Matmul parameters (weights and biases of Linear layers) whose input needed no gradient: each does 2 FLOPs
    per token fewer than the formula counts."""
    skipped_attention_matmuls: int = 0
    """Backward matmuls of the attention core (``dO V^T``, ``P^T dO``, ``dS K``, ``dS^T Q``: four per layer)
    skipped, summed over the layers: each is ``2 H T`` FLOPs per token fewer."""


def _is_matmul_leaf(module: Any) -> bool:
    import torch

    # transformers' Conv1D (GPT-2) is a Linear with its weight transposed.
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _is_projection(module: Any) -> bool:
    """A Linear, or a wrapper around one (peft's LoRA layer keeps the frozen Linear as ``base_layer``)."""
    return _is_matmul_leaf(module) or _is_matmul_leaf(getattr(module, "base_layer", None))


class GradientFlowProbe:
    """Reads :class:`GradientFlow` from the first training forward, then unhooks.

    Hooks every Linear (its input's and weight's ``requires_grad``) and each attention module (a class whose name
    ends in ``Attention`` with Linear children): the projections called on the module's own input are Q, K and V in
    that order (one fused projection: all three), and whether their outputs need a gradient says which backward
    matmuls of the attention core run. Worth installing only on a model with frozen parameters (every input needs
    a gradient otherwise), and not under ``torch.compile`` (hooks would be traced into the graph). A forward run with
    gradients off inside (reentrant checkpointing) leaves :attr:`flow` None: the formula alone is used then. A
    module called several times per forward counts once, as ``N`` counts its parameters once.
    """

    def __init__(self, model: Any) -> None:
        self.flow: GradientFlow | None = None
        self._handles: list[Any] = []
        self._no_input_grad = 0
        self._skipped = 0
        self._valid = True
        self._seen: set[int] = set()
        for module in model.modules():
            if _is_matmul_leaf(module):
                self._handles.append(module.register_forward_hook(self._linear_hook))
            elif type(module).__name__.endswith("Attention"):
                self._hook_attention(module)
        self._handles.append(model.register_forward_hook(self._finish))

    def _linear_hook(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        import torch

        if not module.training or not args or not isinstance(args[0], torch.Tensor):
            return
        self._valid = self._valid and torch.is_grad_enabled()
        if not args[0].requires_grad and id(module) not in self._seen:
            self._seen.add(id(module))  # once per module, as N counts it
            bias = getattr(module, "bias", None)
            self._no_input_grad += param_numel(module.weight) + (bias.numel() if isinstance(bias, torch.Tensor) else 0)

    def _hook_attention(self, attention: Any) -> None:
        projections = [child for child in attention.children() if _is_projection(child)]
        if not projections:
            return
        state: dict[str, Any] = {}

        def begin(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            state["input"] = args[0] if args else kwargs.get("hidden_states")
            state["outputs"] = []

        def projected(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            if "outputs" in state and x is state.get("input"):
                state["outputs"].append(bool(getattr(output, "requires_grad", False)))

        def end(module: Any, args: tuple[Any, ...], output: Any) -> None:
            flags = state.pop("outputs", [])
            state.pop("input", None)
            if module.training and flags:
                self._skipped += 4 - _attention_backward_matmuls(flags)

        self._handles.append(attention.register_forward_pre_hook(begin, with_kwargs=True))
        self._handles.extend(p.register_forward_hook(projected, with_kwargs=True) for p in projections)
        self._handles.append(attention.register_forward_hook(end))

    def _finish(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if not module.training:
            return
        if self._valid:
            self.flow = GradientFlow(no_input_grad_params=self._no_input_grad, skipped_attention_matmuls=self._skipped)
        self.remove()

    def remove(self) -> None:
        """Unhook (also done at the end of the first training forward)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _attention_backward_matmuls(needs_grad: list[bool]) -> int:
    """Backward matmuls of ``softmax(Q K^T) V`` given whether the Q, K, V projections' outputs need a gradient (in
    that order; one fused projection stands for all three, two for Q and a fused K/V)."""
    q, k, v = (needs_grad * 3)[:3] if len(needs_grad) == 1 else (needs_grad + needs_grad[-1:])[:3]
    return int(q or k) + int(v) + int(q) + int(k)


def meta_copy(model: Any) -> Any:
    """The same transformers model on the meta device, built from its config (shapes only, no memory): what to count
    when the model's own parameters are local shards (FSDP1 keeps views of this rank's shard only).

    Raises:
        ValueError: when ``model`` (or what it wraps) is not a transformers model with a config.
    """
    from accelerate import init_empty_weights

    inner = model
    for _ in range(8):  # FSDP1 / DDP / compile wrappers keep the model as .module or ._orig_mod
        if getattr(inner, "config", None) is not None and hasattr(type(inner), "_from_config"):
            break
        inner = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
    if inner is None or getattr(inner, "config", None) is None:
        raise ValueError(f"{type(model).__name__}: not a transformers model, so it cannot be rebuilt from a config")
    with init_empty_weights():
        return type(inner)._from_config(inner.config)


def transformer_flops_per_token(
    *,
    non_embedding_params: int,
    num_layers: int,
    attention_width: int,
    seq_len: float,
    frozen_params: int = 0,
    flow: GradientFlow | None = None,
) -> float:
    """``6 * N + 12 * L * H * T``: model FLOPs to train on one token (see the module docstring).

    ``attention_width`` is ``H``: query heads x head dimension (:func:`attention_width`), not the hidden size.
    ``frozen_params`` of the ``N`` get no weight gradient (LoRA's base): their backward computes the input
    gradient only, 2 FLOPs per parameter and token instead of 4, so each counts 4 instead of 6. LoRA's adapter
    matrices are ordinary trainable matmuls inside ``N``. ``flow`` (:class:`GradientFlowProbe`) removes the work a
    partly frozen model skips upstream of its first trainable parameter: 2 FLOPs per token for each parameter whose
    input needs no gradient, ``2 H T`` for each skipped backward matmul of attention.

    Raises:
        ValueError: for a negative or zero size, or more frozen (or gradient-free) parameters than ``N``.
    """
    flow = flow or GradientFlow()
    for name, value in (("frozen_params", frozen_params), ("flow.no_input_grad_params", flow.no_input_grad_params)):
        if not 0 <= value <= non_embedding_params:
            raise ValueError(f"{name}: expected 0 to non_embedding_params={non_embedding_params!r}, got {value!r}")
    if not 0 <= flow.skipped_attention_matmuls <= 4 * num_layers:
        raise ValueError(
            f"flow.skipped_attention_matmuls: expected 0 to 4 x num_layers={4 * num_layers}, got "
            f"{flow.skipped_attention_matmuls!r}"
        )
    for name, value in (
        ("non_embedding_params", non_embedding_params),
        ("num_layers", num_layers),
        ("attention_width", attention_width),
        ("seq_len", seq_len),
    ):
        if value <= 0:
            raise ValueError(f"{name}: expected a positive number, got {value!r}")
    matmuls = 6.0 * non_embedding_params - 2.0 * frozen_params - 2.0 * flow.no_input_grad_params
    attention = (12.0 * num_layers - 2.0 * flow.skipped_attention_matmuls) * attention_width * seq_len
    return matmuls + attention


def attention_width(config: Any) -> int | None:
    """Query heads x head dimension of a transformers config: the width of ``QK^T`` and ``AV`` per token.

    ``config.head_dim`` wins where the config sets it (Qwen3, Gemma: not ``hidden_size / heads``); else the head
    dimension is ``hidden_size // num_attention_heads``, so the width is the hidden size. None when the config has
    no hidden size. Grouped-query attention changes nothing here: the key/value heads are repeated for every query
    head, whose scores are all computed.
    """
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(heads, int) and heads > 0 and isinstance(head_dim, int) and head_dim > 0:
        return heads * head_dim
    return hidden if isinstance(hidden, int) else None


def model_shape(model: Any, *, from_config: bool = False) -> tuple[int, int, int]:
    """(matmul parameters N, layers L, attention width H) of a transformers model, for the FLOPs formula.

    Args:
        model: the model.
        from_config: count a :func:`meta_copy` of it instead of its own parameters (under FSDP1, whose parameters
            are this rank's shard only: counting them reads low by about the world size).

    Raises:
        ValueError: when the config has no layer count or hidden size (pass ``flops_per_token`` yourself then).
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None)
    width = attention_width(config)
    if not isinstance(layers, int) or width is None:
        raise ValueError(
            f"model.config: expected num_hidden_layers and hidden_size to count FLOPs, got "
            f"num_hidden_layers={layers!r}, hidden_size={getattr(config, 'hidden_size', None)!r}; pass "
            "flops_per_token explicitly"
        )
    return matmul_parameters(meta_copy(model) if from_config else model), layers, width


def model_flops_per_token(model: Any, seq_len: float, flow: GradientFlow | None = None) -> float:
    """:func:`transformer_flops_per_token` for a transformers model, with N, L and H from :func:`model_shape`
    (and ``flow`` as a :class:`GradientFlowProbe` read it in a training forward, for a partly frozen model).

    Raises:
        ValueError: when the config has no layer count or hidden size.
    """
    params, layers, width = model_shape(model)
    return transformer_flops_per_token(
        non_embedding_params=params,
        num_layers=layers,
        attention_width=width,
        seq_len=seq_len,
        frozen_params=matmul_parameters(model, frozen_only=True),
        flow=flow,
    )


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all ``num_devices`` devices together.

    Raises:
        ValueError: for a peak or device count that is not positive.
    """
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s: expected a positive number, got {peak_flops_per_s!r}")
    if num_devices < 1:
        raise ValueError(f"num_devices: expected a positive integer, got {num_devices!r}")
    return tokens_per_s * flops_per_token / (peak_flops_per_s * num_devices)


__all__ = [
    "DEVICE_PEAK_FLOPS",
    "ComputeDtype",
    "GradientFlow",
    "GradientFlowProbe",
    "attention_width",
    "canonical_device",
    "compute_dtype",
    "count_parameters_for_flops",
    "matmul_parameters",
    "meta_copy",
    "mfu",
    "model_flops_per_token",
    "model_shape",
    "peak_flops_per_s",
    "transformer_flops_per_token",
]
