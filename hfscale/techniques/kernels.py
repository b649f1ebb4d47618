"""Compilation and kernels: whether ``torch.compile``, the attention implementation, TF32 matmuls and Liger's kernels
really took effect inside a run, read from the objects that trained.

Each of them can be asked for and silently not happen: the Trainer compiles only when ``torch_compile`` reaches its
arguments, and dynamo falls back to running Python eagerly for every frame it cannot trace; transformers dispatches
attention by the name in ``config._attn_implementation`` and uses eager attention when the name is None; TF32 is a
global torch flag that transformers also turns on by itself (``torch_compile`` on an Ampere or newer GPU with
``tf32`` unset); Liger patches only the model types it knows and logs (at info level) that it did nothing for the
others. So a trial reads what ran:

=============================  =====================================================================================
field                          read from
=============================  =====================================================================================
``compiled``                   the stepped model (``trainer.model_wrapped``, or what it wraps) is a dynamo
                               ``OptimizedModule`` (a DeepSpeed engine: its ``is_compiled``) AND dynamo's cache holds
                               compiled code for the model's own ``forward`` made by that wrapper's backend (the
                               cache entries of the forward's code object; a process-wide count of compiled graphs
                               passed for any compiled function)
``compile_backend``            the backend of that ``OptimizedModule`` (``inductor``, ``aot_eager``, ``eager``)
``compile_mode``               inductor's mode, read back from the options its compiler holds (``reduce-overhead``
                               is ``triton.cudagraphs``, ...: ``torch._inductor.list_mode_options``)
``compile_graph_breaks``       graph breaks dynamo counted (``counters["graph_break"]``, process-wide): the compiled
                               model ran in that many more pieces, with Python between them
``attn_implementation``        ``model.config._attn_implementation`` (what transformers resolved and dispatches on)
``attention_scores_kept``      :class:`AttentionProbe`: whether the first attention module's forward returned the
                               ``seq x seq`` probabilities (only eager attention computes them), so a config that
                               says ``sdpa`` while eager attention runs is caught
``tf32_matmul``                torch's CUDA matmul precision (``torch.backends.cuda.matmul.fp32_precision`` in torch
                               >= 2.9, ``allow_tf32`` before)
``liger_patched``              the model's modules whose forward (bound on the instance, as Liger's
                               ``_apply_liger_kernel_to_instance`` does, or on the class) or class comes from
                               ``liger_kernel``
=============================  =====================================================================================

:func:`check` compares them with a :class:`~hfscale.strategy.Strategy`; any mismatch makes the trial's row
``not_applied``.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from hfscale.strategy import Strategy, StrategyError
from hfscale.techniques.base import ScriptLine, Technique, TrainedRun

if TYPE_CHECKING:
    import torch

    from hfscale.records.measurements import VerificationRecord

logger = logging.getLogger(__name__)

LIGER_MODEL_TYPES: frozenset[str] = frozenset(
    {
        "deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3",
        "gemma3_text", "gemma4", "gemma4_text", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite",
        "hunyuan_v1_dense", "hunyuan_v1_moe", "internvl", "llama", "llama4", "llama4_text", "llava", "ministral",
        "mistral", "mixtral", "mllama", "mllama_text_model", "muse_glimmer", "nemotron", "olmo2", "olmo3",
        "paligemma", "phi3", "pixtral", "qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text",
        "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl",
        "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_vl_text", "smollm3", "smolvlm",
    }
)  # fmt: skip
"""Model types Liger patches: the keys of ``MODEL_TYPE_TO_APPLY_LIGER_FN`` in liger-kernel 0.8.5
(``liger_kernel/transformers/monkey_patch.py``), used where the package is not installed (a CPU machine planning a
GPU sweep); :func:`liger_model_types` reads the installed package's table instead when it can."""


@functools.cache
def liger_model_types() -> frozenset[str]:
    """The model types the installed liger-kernel patches, or :data:`LIGER_MODEL_TYPES` without it."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # not installed, or it needs triton/CUDA to import: the pinned table stands in
        return LIGER_MODEL_TYPES
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def check_liger_model_type(strategy: Strategy, model_type: str | None) -> None:
    """Refuse ``use_liger_kernel`` for a model type Liger does not patch (it would log and train unpatched).

    Raises:
        StrategyError: naming the model type and the types Liger supports.
    """
    if not strategy.use_liger_kernel or not model_type:
        return
    supported = liger_model_types()
    if model_type not in supported:
        raise StrategyError(
            f"strategy.use_liger_kernel=True with model type {model_type!r}: Liger has no kernels for it and would "
            f"train the model unpatched; supported types: {', '.join(sorted(supported))}"
        )


# -- TF32 ------------------------------------------------------------------------------------------------------


def tf32_matmul_enabled() -> bool | None:
    """Whether fp32 CUDA matmuls may run on TF32 tensor cores now; None where torch does not say.

    torch >= 2.9 keeps the setting as ``fp32_precision`` (``"tf32"``, ``"ieee"``, or ``"none"``: inherit from
    ``torch.backends.fp32_precision``); reading the legacy ``allow_tf32`` after the new API was used raises (measured,
    torch 2.13: transformers' ``enable_tf32`` sets the new one), so the new one is read first.
    """
    import torch

    matmul = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
    try:
        precision = getattr(matmul, "fp32_precision", None)
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", None)
        if precision in ("tf32", "ieee", "none"):
            return precision == "tf32"
        return bool(matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except (AttributeError, RuntimeError):
        return None


# -- torch.compile ---------------------------------------------------------------------------------------------


def _compiled_module(model_wrapped: Any) -> Any:
    """The ``OptimizedModule`` among the stepped model and what it wraps (accelerate compiles after DDP wraps)."""
    from torch._dynamo.eval_frame import OptimizedModule

    obj = model_wrapped
    for _ in range(4):
        if obj is None:
            return None
        if isinstance(obj, OptimizedModule):
            return obj
        obj = getattr(obj, "module", None)
    return None


def uncompiled(model: Any) -> Any:
    """What a ``torch.compile`` wrapper wraps (accelerate compiles after DDP, so the engine is inside), else the
    model itself."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def _backend(compiled: Any) -> Any:
    """The dynamo backend object of an ``OptimizedModule`` (torch internals, read defensively; None when they
    moved): ``_TorchCompileInductorWrapper`` for inductor, ``_TorchCompileWrapper`` for a named backend, the
    function for a callable one."""
    obj = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(8):  # CatchErrorsWrapper -> ConvertFrame -> ConvertFrameAssert -> WrapBackendDebug -> the backend
        inner = getattr(obj, "_torchdynamo_orig_backend", None) or getattr(obj, "_inner_convert", None)
        if inner is None:
            return obj
        obj = inner
    return None


def _backend_name(backend: Any) -> str | None:
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return name if isinstance(name, str) else None


def _inductor_mode(backend: Any) -> str | None:
    """The ``torch.compile`` mode whose options inductor's compiler holds (the mode is not kept by name)."""
    config = getattr(backend, "config", None)
    if _backend_name(backend) != "inductor" or not isinstance(config, dict):
        return None
    try:
        from torch._inductor import list_mode_options
    except ImportError:
        return None
    modes: dict[str, dict[str, Any]] = list_mode_options()  # type: ignore[assignment]
    keys = {key for options in modes.values() for key in options}
    held = {key: config[key] for key in keys if key in config}
    return next((name for name, options in modes.items() if options == held), None)


def _forward_compiled(model_wrapped: Any, backend: Any) -> bool:
    """Whether dynamo's cache holds compiled code for the model's own ``forward`` (the model and what it wraps,
    DDP's inner module included: dynamo starts tracing at the first frame past torch.nn's), made by ``backend``
    (any backend when None: a DeepSpeed engine compiles through ``nn.Module.compile``, which keeps none to compare).

    The cache lives on the forward's code object, so another model of the same class compiled with an equal backend
    in the same process shares it: that model's code is then what runs.
    """
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return False
    obj = model_wrapped
    for _ in range(4):  # DDP / DeepSpeed .module, compile ._orig_mod
        obj = uncompiled(obj)
        code = getattr(getattr(type(obj), "forward", None), "__code__", None)
        for entry in _debug_get_cache_entry_list(code) if code is not None else []:
            if backend is None or entry.backend is backend or entry.backend == backend:
                return True
        obj = getattr(obj, "module", None)
        if obj is None:
            break
    return False


def compile_facts(model_wrapped: Any) -> dict[str, Any]:
    """``compiled``, ``compile_backend``, ``compile_mode`` and ``compile_graph_breaks`` of the model a Trainer
    stepped (see the module docstring), as record keywords."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {"compiled": False}
    compiled = _compiled_module(model_wrapped)
    engine_compiled = bool(getattr(model_wrapped, "is_compiled", False))  # DeepSpeedEngine.compile()
    if compiled is None and not engine_compiled:
        return {"compiled": False}
    backend = _backend(compiled) if compiled is not None else None
    # A backend whose name cannot be read (torch internals moved) is not compared: any compiled forward counts.
    ran = _forward_compiled(model_wrapped, backend if _backend_name(backend) is not None else None)
    if not ran:
        logger.warning("the model is wrapped by torch.compile but its forward was never compiled: it runs eagerly")
    return {
        "compiled": ran,
        "compile_backend": _backend_name(backend),
        "compile_mode": _inductor_mode(backend),
        "compile_graph_breaks": int(sum(counters["graph_break"].values())),
    }


# -- attention -------------------------------------------------------------------------------------------------


class AttentionProbe:
    """Observes, in the first training forward, whether attention kept the ``seq x seq`` probabilities.

    transformers' attention modules return ``(output, weights)``: eager attention computes and returns the softmax
    probabilities (``batch x heads x query x key``); SDPA, FlashAttention and flex attention never form them and
    return None (flex: a log-sum-exp without the key dimension). A forward hook on the first module whose class name
    ends in ``Attention`` and that returns such a pair reads it once. Under ``torch.compile`` dynamo traces the hook
    and replays its attribute writes; removing a hook inside a traced region would break the graph (measured: 8
    graphs and the encoder loop skipped to eager, against 1 graph without), so the hook then stays until
    :meth:`remove` is called from outside.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.module_name: str | None = None
        self.scores_kept: bool | None = None
        self._handle: Any = None
        for name, module in model.named_modules():
            if type(module).__name__.endswith("Attention") and hasattr(module, "config"):
                self.module_name = name
                self._handle = module.register_forward_hook(self._hook)
                break

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        import torch

        if not module.training or not isinstance(output, tuple) or len(output) < 2:
            return
        weights = output[1]
        self.scores_kept = isinstance(weights, torch.Tensor) and weights.dim() == 4
        if not torch.compiler.is_compiling():
            self.remove()

    def remove(self) -> None:
        """Unhook (also done by the first observation outside ``torch.compile``)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


# -- Liger -----------------------------------------------------------------------------------------------------


def _from_liger(fn: Any) -> bool:
    fn = getattr(fn, "__func__", fn)
    return str(getattr(fn, "__module__", "") or "").startswith("liger_kernel")


def liger_patched_modules(model: Any) -> list[str]:
    """Class names (sorted, each once) of the model's modules that run a Liger forward."""
    names: set[str] = set()
    for module in model.modules():
        cls = type(module)
        if (
            cls.__module__.startswith("liger_kernel")
            or _from_liger(module.__dict__.get("forward"))
            or _from_liger(getattr(cls, "forward", None))
        ):
            names.add(cls.__name__)
    return sorted(names)


# -- the record and the check ----------------------------------------------------------------------------------


def _unwrap_model(model: Any) -> Any:
    for _ in range(4):  # DDP/DeepSpeed .module, compile ._orig_mod
        if getattr(model, "config", None) is not None:
            return model
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
    return model


def collect(trainer: Any, model: Any, attention_probe: AttentionProbe | None = None) -> dict[str, Any]:
    """The kernel facts of a Trainer's run, as :class:`~hfscale.records.measurements.VerificationRecord` keywords.

    Args:
        trainer: the Trainer (its ``model_wrapped`` is what was stepped).
        model: the model (``trainer.model``).
        attention_probe: the probe installed at train begin; None leaves ``attention_scores_kept`` unread.
    """
    inner = _unwrap_model(model)
    config = getattr(inner, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    device = getattr(getattr(trainer.args, "device", None), "type", None)
    return {
        **compile_facts(trainer.model_wrapped),
        "attn_implementation": str(attn) if attn is not None else None,
        "attention_scores_kept": attention_probe.scores_kept if attention_probe is not None else None,
        # TF32 is a CUDA mode: on CPU the flag says nothing about the run.
        "tf32_matmul": tf32_matmul_enabled() if device == "cuda" else None,
        "liger_patched": liger_patched_modules(inner) if inner is not None else [],
    }


def check(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """The ways the record's kernels differ from the strategy's, one sentence each (None fields are not compared)."""
    problems: list[str] = []
    asked = strategy.torch_compile
    if asked is not None and rec.compiled is False:
        problems.append(
            f"torch_compile (backend {asked.backend!r}) was asked for, but the model that trained is not compiled "
            "(no torch.compile wrapper, or dynamo never compiled the model's forward): it ran eagerly"
        )
    elif asked is not None and rec.compile_backend is not None and rec.compile_backend != asked.backend:
        problems.append(f"torch.compile ran with backend {rec.compile_backend!r}, {asked.backend!r} was asked for")
    elif asked is not None and rec.compile_mode is not None and rec.compile_mode != asked.mode:
        problems.append(
            f"torch.compile ran in mode {rec.compile_mode!r}, torch_compile.mode={asked.mode!r} was asked for"
        )
    elif asked is None and rec.compiled:
        problems.append(
            f"the model ran compiled (backend {rec.compile_backend!r}) but the strategy asks for no torch_compile"
        )

    want = strategy.attn_implementation
    ran = rec.attn_implementation
    if want is not None and ran is not None and ran != want:
        problems.append(f"the model's attention is {ran!r} (config._attn_implementation), {want!r} was asked for")
    named = ran or want
    if named is not None and rec.attention_scores_kept is not None:
        if rec.attention_scores_kept and named != "eager":
            problems.append(
                f"the config says attention {named!r}, but the attention modules returned the seq x seq "
                "probabilities: eager attention ran"
            )
        elif not rec.attention_scores_kept and named == "eager":
            problems.append("the config says eager attention, but no seq x seq probabilities were formed")

    if strategy.device == "cuda" and rec.tf32_matmul is not None and rec.tf32_matmul != strategy.tf32:
        state = "allowed" if rec.tf32_matmul else "not allowed"
        why = " (transformers turns TF32 on for torch_compile when tf32 is unset)" if rec.tf32_matmul else ""
        problems.append(f"TF32 matmuls are {state} inside the run, strategy.tf32={strategy.tf32}{why}")

    if strategy.use_liger_kernel and not rec.liger_patched:
        problems.append("use_liger_kernel was asked for, but no module of the model runs a Liger kernel")
    elif not strategy.use_liger_kernel and rec.liger_patched:
        problems.append(f"Liger kernels patched {', '.join(rec.liger_patched)} but strategy.use_liger_kernel is False")
    return problems


def script_lines(strategy: Strategy) -> list[ScriptLine]:
    """``(why, line)`` for a user's own script: the attention kernel is chosen when the model is built. (Compile,
    TF32 and Liger are ``TrainingArguments`` keywords: the generated ``training_args.json`` holds them.)"""
    if strategy.attn_implementation is None:
        return []
    return [
        (
            "the attention kernel is the model's, not TrainingArguments': build the model with it (from_config "
            "or from_pretrained alike; it raises where the kernel is not available)",
            f"model = AutoModelForXxx.from_pretrained(name, attn_implementation={strategy.attn_implementation!r})",
        )
    ]


class Kernels(Technique):
    """Compilation, the attention implementation, TF32 and Liger: applied through the model's config and
    ``TrainingArguments`` (nothing for the trial to do), read back and checked from inside the run."""

    name = "kernels"

    def collect(self, run: TrainedRun) -> dict[str, Any]:
        return collect(run.trainer, run.model, run.attention_probe)

    check = staticmethod(check)

    script_lines = staticmethod(script_lines)


TECHNIQUE = Kernels()
"""This module's :class:`~hfscale.techniques.base.Technique` (registered in ``hfscale.techniques.TECHNIQUES``)."""

__all__ = [
    "LIGER_MODEL_TYPES",
    "TECHNIQUE",
    "AttentionProbe",
    "Kernels",
    "check",
    "check_liger_model_type",
    "collect",
    "compile_facts",
    "liger_model_types",
    "liger_patched_modules",
    "script_lines",
    "tf32_matmul_enabled",
    "uncompiled",
]
