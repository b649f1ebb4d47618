"""What the estimate knows about a model, read from a build on the meta device.

Reading the shapes from the model itself (rather than from formulas over the config) means tied weights, biases,
the pooler and every model type's own layout are counted as the model really has them, at no memory cost.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from hfscale.workload.model import build_meta_model
from hfscale.workload.spec import DataSpec, ModelSpec

if TYPE_CHECKING:
    from torch import nn

Family = Literal["bert", "gpt2", "generic"]
_BERT_LIKE = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra"})
_GPT2_LIKE = frozenset({"gpt2"})


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
    """Which activation inventory applies (docs/estimate.md, "Activations")."""
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

    The config is built as the trial builds it (:func:`hfscale.workload.model.build_config`): ``AutoConfig.for_model``
    with the overrides, ``num_labels`` from the data for classification; a ``pretrained`` name reads only its config.

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
    model_type = getattr(getattr(meta, "config", None), "model_type", None) or model.type
    return model_shape_from_module(meta, model_type=model_type, task=model.task)  # type: ignore[arg-type]


__all__ = ["Family", "ModelShape", "ParamInfo", "describe_model", "model_shape_from_module"]
