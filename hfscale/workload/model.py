"""The one place a :class:`~hfscale.workload.spec.ModelSpec` becomes a transformers config and a model.

The trial builds the real model from it, the estimate builds the same config on the meta device, and the recipe
loader builds the config alone to refuse an unknown model type or a vocabulary the data does not fit before
anything runs. Keeping one builder means the three can never disagree about which model a recipe names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hfscale.workload.factory import load_callable
from hfscale.workload.spec import DataSpec, ModelSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


class ModelConfigError(ValueError):
    """transformers refused a value of the model's config (one of the wrong type for its typed field)."""


def _typed_config_errors() -> tuple[type[Exception], ...]:
    """What transformers' typed configs raise for a value of the wrong type (huggingface_hub's strict dataclasses,
    which subclass neither TypeError nor ValueError); none where that huggingface_hub has no such check."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def build_config(model: ModelSpec, data: DataSpec, *, attn_implementation: str | None = None) -> PretrainedConfig:
    """The config a :class:`ModelSpec` describes, with ``num_labels`` from the data for classification.

    Cheap (no weights): ``AutoConfig.for_model`` with the overrides, or a ``pretrained`` name's config.
    ``attn_implementation`` (the strategy's) is written to ``config._attn_implementation``, which
    ``from_config``/``from_pretrained`` resolve and the estimate reads; None keeps transformers' default.

    Raises:
        ValueError: when transformers does not know the model type or refuses the overrides
            (:class:`ModelConfigError` for a value of the wrong type).
    """
    from transformers import AutoConfig

    overrides = dict(model.config)
    if model.task == "classification":
        overrides.setdefault("num_labels", data.num_labels)
    try:
        if model.pretrained:
            config = AutoConfig.from_pretrained(model.pretrained, **overrides)
        else:
            config = AutoConfig.for_model(model.type, **overrides)
    except (TypeError, *_typed_config_errors()) as exc:  # a value of the wrong type for the config's typed field
        raise ModelConfigError(" ".join(str(exc).split())) from exc
    if model.task == "classification" and getattr(config, "pad_token_id", None) is None:
        # Decoder classifiers (GPT-2, Llama) pool at the last non-pad token and refuse batches without a pad id.
        # Dummy data is never padded, so any id outside [token_low, token_high) is safe.
        config.pad_token_id = getattr(config, "eos_token_id", None) or 0
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def check_vocabulary(config: PretrainedConfig, data: DataSpec) -> None:
    """Refuse data whose token ids do not fit the model's embedding (an index error deep inside the first forward).

    Raises:
        ValueError: naming ``data.token_high`` and the model's ``vocab_size``.
    """
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None and data.token_high > vocab_size:
        raise ValueError(
            f"data.token_high={data.token_high} exceeds the model's vocab_size={vocab_size}: token ids are drawn "
            f"from [token_low, token_high); lower data.token_high or raise model.config.vocab_size"
        )


def auto_model_class(model: ModelSpec) -> Any:
    """The transformers auto class of the spec's task (sequence classification or causal LM)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if model.task == "classification" else AutoModelForCausalLM


def build_model(model: ModelSpec, data: DataSpec, *, attn_implementation: str | None = None) -> PreTrainedModel:
    """The model a :class:`ModelSpec` describes, with random weights unless ``pretrained`` is set.

    Seed first (:func:`transformers.set_seed`) for the same weights in every trial and on every rank.
    ``attn_implementation`` is passed as transformers 5 takes it (``from_config(config, attn_implementation=...)``,
    ``from_pretrained(..., attn_implementation=...)``): it checks the kernel is available and raises if not.

    Raises:
        ValueError: as :func:`build_config` and :func:`check_vocabulary`.
    """
    if model.factory is not None:
        return load_callable(model.factory)(**model.config)
    config = build_config(model, data, attn_implementation=attn_implementation)
    check_vocabulary(config, data)
    extra = {"attn_implementation": attn_implementation} if attn_implementation is not None else {}
    if model.pretrained:
        return auto_model_class(model).from_pretrained(model.pretrained, config=config, **extra)
    return auto_model_class(model).from_config(config, **extra)


def build_meta_model(model: ModelSpec, data: DataSpec, *, attn_implementation: str | None = None) -> PreTrainedModel:
    """The same model on the meta device: every parameter's shape, no memory (what the estimate reads)."""
    from accelerate import init_empty_weights

    if model.factory is not None:
        import torch

        with torch.device("meta"):  # every tensor the factory makes has a shape and no storage
            return load_callable(model.factory)(**model.config)
    config = build_config(model, data, attn_implementation=attn_implementation)
    with init_empty_weights():
        return auto_model_class(model).from_config(config)


__all__ = [
    "ModelConfigError",
    "auto_model_class",
    "build_config",
    "build_meta_model",
    "build_model",
    "check_vocabulary",
]
