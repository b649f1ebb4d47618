"""LoRA and QLoRA: train low-rank adapters through ``peft`` on a frozen base, optionally stored in 4 bits.

What it trades: the base model's weights receive no gradients and no optimizer states, so model states shrink to
the weights plus the adapters' (a few per cent of the parameters) gradients and states; QLoRA (``quantize_base:
4bit``) also stores the frozen base's Linear weights as NF4 (half a byte per element plus one fp32 scale per 64),
dequantising each to the compute dtype when it is used. The backward pass still computes the input gradient of
every frozen matmul, so compute falls by about a third only (:mod:`hfscale.measure.flops`), and the model learns less
per step than full training does.

This module holds every LoRA fact hfscale uses, so the trial, the verification, the memory estimate, the FLOPs
count and the config printer cannot disagree:

- :func:`apply_lora`: the trial's model -> the ``peft`` model that trains (QLoRA reloads the random base in 4 bits).
- :func:`lora_config_kwargs` / :func:`bnb_config_kwargs`: the ``LoraConfig`` and ``BitsAndBytesConfig`` keywords.
- :func:`collect` / :func:`check`: the verification fields (``params_trainable``, ``params_adapter``,
  ``lora_layers``, ``lora_target_modules``, ``quantized_4bit_layers``) and their comparison with the strategy.
- the memory estimate's view of the adapters is :mod:`hfscale.estimate.lora`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.core.params import param_numel
from hfscale.strategy import LoraSpec, Strategy
from hfscale.techniques.base import ScriptLine, Technique, TrainedRun

if TYPE_CHECKING:
    import torch

    from hfscale.records.measurements import VerificationRecord
    from hfscale.workload.spec import TrialSpec

logger = logging.getLogger(__name__)

TASK_TYPES: dict[str, str] = {"classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}
"""``ModelSpec.task`` -> peft's ``TaskType`` (it decides which head peft keeps trainable: ``SEQ_CLS`` trains a copy
of the classifier, ``CAUSAL_LM`` none)."""

NF4_BLOCK_SIZE = 64
"""bitsandbytes' default 4-bit block (``BitsAndBytesConfig`` leaves ``blocksize`` at 64): one fp32 ``absmax`` per
block without double quantisation, which hfscale does not turn on."""

_COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError("strategy.lora needs peft: pip install 'hfscale[lora]'") from exc
    return peft


def default_target_modules(model_type: str) -> tuple[str, ...]:
    """peft's default adapter targets for a model type (``bert``: query, value; ``llama``: q_proj, v_proj).

    Raises:
        ValueError: when peft has no default for the model type (naming ``lora.target_modules``).
        ImportError: when peft is not installed.
    """
    _require_peft()
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    targets = defaults.get(model_type)
    if not targets:
        raise ValueError(
            f"lora.target_modules is unset and peft has no default target modules for model type {model_type!r}: "
            "name the Linear modules to adapt, e.g. lora.target_modules: [q_proj, v_proj]"
        )
    return tuple(targets)


def resolve_target_modules(spec: LoraSpec, model_type: str) -> tuple[str, ...]:
    """``spec.target_modules``, or peft's default for ``model_type`` when unset (:func:`default_target_modules`)."""
    return spec.target_modules if spec.target_modules is not None else default_target_modules(model_type)


def lora_config_kwargs(spec: LoraSpec, *, task: str, model_type: str | None = None) -> dict[str, Any]:
    """The ``peft.LoraConfig`` keywords for a :class:`LoraSpec`.

    Args:
        task: ``ModelSpec.task`` (``classification`` or ``causal_lm``).
        model_type: resolves unset target modules to peft's default; None leaves them None (peft resolves them
            from the model when it is wrapped).

    Raises:
        ValueError: for an unknown task, or unset targets on a model type peft has no default for.
    """
    if task not in TASK_TYPES:
        raise ValueError(f"model.task: expected one of {', '.join(TASK_TYPES)}, got {task!r}")
    targets = resolve_target_modules(spec, model_type) if model_type is not None else spec.target_modules
    return {
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": float(spec.dropout),
        "target_modules": list(targets) if targets is not None else None,
        "task_type": TASK_TYPES[task],
    }


def bnb_config_kwargs(precision: str) -> dict[str, Any]:
    """The ``transformers.BitsAndBytesConfig`` keywords of QLoRA's 4-bit base: NF4 weights, dequantised to the
    strategy's compute dtype (``bf16`` -> bfloat16) for each matmul, no double quantisation."""
    return {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": _COMPUTE_DTYPES[precision],
        "bnb_4bit_use_double_quant": False,
    }


def _load_4bit(model: Any, spec: TrialSpec, scratch_dir: str | os.PathLike[str]) -> Any:
    """The same model with its Linear weights in NF4: saved (random weights) and reloaded through
    ``from_pretrained(quantization_config=...)``, the path transformers quantises on; a pretrained model is reloaded
    from its name. Non-quantised tensors stay fp32, as in every other trial (autocast does the mixed precision)."""
    import torch
    from transformers import BitsAndBytesConfig

    from hfscale.workload.model import auto_model_class

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ImportError("lora.quantize_base='4bit' needs bitsandbytes: pip install 'hfscale[bnb]'") from exc
    source: str
    if spec.model.pretrained:
        source = spec.model.pretrained
    else:
        from hfscale.techniques.mesh import save_for_reload

        path = Path(scratch_dir) / "lora_base"
        save_for_reload(model, path)  # bf16 on disk (one copy per rank), loaded back as float32 below
        source = str(path)
    kwargs = bnb_config_kwargs(spec.strategy.precision)
    kwargs["bnb_4bit_compute_dtype"] = getattr(torch, kwargs["bnb_4bit_compute_dtype"])
    device: Any = "cpu" if spec.strategy.device == "cpu" else {"": int(os.environ.get("LOCAL_RANK", "0"))}
    return auto_model_class(spec.model).from_pretrained(
        source,
        config=model.config,
        quantization_config=BitsAndBytesConfig(**kwargs),
        device_map=device,
        dtype=torch.float32,
    )


def apply_lora(model: Any, spec: TrialSpec, *, scratch_dir: str | os.PathLike[str]) -> Any:
    """The trial's model with LoRA adapters (``peft.get_peft_model``), its base frozen; under QLoRA the base is
    first reloaded with NF4 Linear weights. Returns ``model`` unchanged when the strategy has no ``lora``.

    Raises:
        ImportError: when peft (or, for QLoRA, bitsandbytes) is missing, naming the extra.
        ValueError: when the target modules are unset and peft has no default for the model type, or when peft
            finds none of them in the model.
    """
    lora = spec.strategy.lora
    if lora is None:
        return model
    peft = _require_peft()
    config_kwargs = lora_config_kwargs(lora, task=spec.model.task, model_type=model.config.model_type)
    if lora.quantize_base == "4bit":
        model = _load_4bit(model, spec, scratch_dir)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**config_kwargs))
    if spec.strategy.gradient_checkpointing:
        # With the embeddings frozen no checkpointed block would see an input that requires grad, and reentrant
        # checkpointing would then give the adapters inside it no gradient at all.
        wrapped.enable_input_require_grads()
    trainable, total = wrapped.get_nb_trainable_parameters()
    logger.info(
        "LoRA on %s: %d of %d parameters trainable", ", ".join(config_kwargs["target_modules"]), trainable, total
    )
    return wrapped


# ---------------------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------------------


def _is_adapter_param(name: str) -> bool:
    """A parameter peft added and trains: a LoRA matrix (``lora_A``/``lora_B``/``lora_embedding_*``/
    ``lora_magnitude_vector``) or a trainable copy of a ``modules_to_save`` head."""
    parts = name.split(".")
    return any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts


def collect(model: torch.nn.Module) -> dict[str, Any]:
    """The LoRA fields of a :class:`~hfscale.records.measurements.VerificationRecord`, read from the model that trained.

    ``params_trainable`` counts parameters with ``requires_grad``; ``params_adapter`` those peft added
    (:func:`_is_adapter_param`); ``lora_layers`` the peft ``LoraLayer`` modules and ``lora_target_modules`` the
    last names of their paths; ``quantized_4bit_layers`` the bitsandbytes ``Linear4bit`` modules. A model without
    peft reads 0 layers (no peft import: peft's classes can only be present when peft was imported).
    """
    trainable = adapter = 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            trainable += param_numel(param)
            if _is_adapter_param(name):
                adapter += param_numel(param)
    lora_names: list[str] = []
    layer_cls = getattr(sys.modules.get("peft.tuners.lora.layer"), "LoraLayer", None)
    bnb_nn = sys.modules.get("bitsandbytes.nn")
    linear4bit = getattr(bnb_nn, "Linear4bit", None)
    quantized = 0
    for name, module in model.named_modules():
        if layer_cls is not None and isinstance(module, layer_cls):
            lora_names.append(name)
        if linear4bit is not None and isinstance(module, linear4bit):
            quantized += 1
    return {
        "params_trainable": trainable,
        "params_adapter": adapter,
        "lora_layers": len(lora_names),
        "lora_target_modules": sorted({n.rsplit(".", 1)[-1] for n in lora_names}),
        "quantized_4bit_layers": quantized,
    }


def check(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """The ways the record's LoRA fields differ from ``strategy.lora``, one sentence each; fields read as None
    (an older record) are not compared.

    Under LoRA: at least one adapter, every trainable parameter an adapter's (the base frozen: a fallback to full
    training shows as every parameter trainable), the adapted modules those ``lora.target_modules`` names (when
    named), and 4-bit base layers exactly when ``quantize_base`` is ``4bit``. Without LoRA: no adapters and no
    4-bit layers.
    """
    problems: list[str] = []
    lora = strategy.lora
    if lora is None:
        if rec.lora_layers:
            problems.append(f"{rec.lora_layers} LoRA adapter layer(s) trained, but strategy.lora is unset")
        if rec.quantized_4bit_layers:
            problems.append(f"{rec.quantized_4bit_layers} Linear layer(s) ran in 4 bits, but strategy.lora is unset")
        return problems
    if rec.lora_layers == 0:
        problems.append("no LoRA adapter layer in the model that trained: strategy.lora did not take effect")
    if rec.params_trainable is not None:
        if rec.params_trainable >= rec.params_total:
            problems.append(
                f"every parameter is trainable ({rec.params_trainable:,} of {rec.params_total:,}): full training "
                "ran, not LoRA"
            )
        elif rec.params_adapter is not None and rec.params_trainable != rec.params_adapter:
            problems.append(
                f"{rec.params_trainable:,} parameter elements are trainable but the adapters hold "
                f"{rec.params_adapter:,}: part of the base model is not frozen"
            )
    if lora.target_modules is not None and rec.lora_layers:
        asked = {t.rsplit(".", 1)[-1] for t in lora.target_modules}
        ran = set(rec.lora_target_modules)
        if ran != asked:
            problems.append(
                f"LoRA adapters sit on {', '.join(sorted(ran)) or 'no module'}, lora.target_modules names "
                f"{', '.join(sorted(asked))}"
            )
    if rec.quantized_4bit_layers is not None:
        if lora.quantize_base == "4bit" and rec.quantized_4bit_layers == 0:
            problems.append("no Linear layer is stored in 4 bits: lora.quantize_base='4bit' did not take effect")
        elif lora.quantize_base == "none" and rec.quantized_4bit_layers > 0:
            problems.append(
                f"{rec.quantized_4bit_layers} Linear layer(s) are stored in 4 bits, lora.quantize_base is 'none'"
            )
    return problems


# ---------------------------------------------------------------------------------------------------------------
# A user's own script
# ---------------------------------------------------------------------------------------------------------------


def script_lines(strategy: Strategy) -> list[ScriptLine]:
    """``(why, line)`` for the lines a user's script needs to train ``strategy.lora`` (what ``hfscale config``
    prints): the 4-bit load under QLoRA, then ``get_peft_model`` with the ``LoraConfig`` keywords."""
    lora = strategy.lora
    if lora is None:
        return []
    lines: list[tuple[str, str]] = []
    if lora.quantize_base == "4bit":
        bnb = bnb_config_kwargs(strategy.precision)
        bnb_args = ", ".join(
            f"{k}=torch.{v}" if k == "bnb_4bit_compute_dtype" else f"{k}={v!r}" for k, v in bnb.items()
        )
        lines.append(
            (
                "QLoRA: load the base model with 4-bit NF4 Linear weights (pip install bitsandbytes; "
                "AutoModelForSequenceClassification for a classifier; a model built from a config: save_pretrained "
                "it and load that folder)",
                f"model = AutoModelForCausalLM.from_pretrained(NAME, quantization_config=BitsAndBytesConfig("
                f"{bnb_args}), dtype=torch.float32)",
            )
        )
    kwargs = lora_config_kwargs(lora, task="causal_lm")
    kwargs.pop("task_type")
    lora_args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    lines.append(
        (
            "LoRA: wrap the model before building the Trainer (pip install peft; task_type 'SEQ_CLS' for a "
            "classifier; target_modules=None takes peft's default for the model type)",
            f"from peft import LoraConfig, get_peft_model; model = get_peft_model(model, LoraConfig({lora_args}, "
            "task_type='CAUSAL_LM'))",
        )
    )
    return lines


class Lora(Technique):
    """LoRA and QLoRA (``strategy.lora``): adapters on a frozen (4-bit) base before any wrapping, read back as the
    parameters that train and the layers that hold adapters or 4-bit weights."""

    name = "lora"

    def adapt_model(self, model: Any, spec: TrialSpec, scratch_dir: str | os.PathLike[str]) -> Any:
        return apply_lora(model, spec, scratch_dir=scratch_dir)

    def collect(self, run: TrainedRun) -> dict[str, Any]:
        return collect(run.model)

    check = staticmethod(check)

    script_lines = staticmethod(script_lines)


TECHNIQUE = Lora()
"""This module's :class:`~hfscale.techniques.base.Technique` (registered in ``hfscale.techniques.TECHNIQUES``)."""

__all__ = [
    "NF4_BLOCK_SIZE",
    "TASK_TYPES",
    "TECHNIQUE",
    "Lora",
    "apply_lora",
    "bnb_config_kwargs",
    "check",
    "collect",
    "default_target_modules",
    "lora_config_kwargs",
    "resolve_target_modules",
    "script_lines",
]
