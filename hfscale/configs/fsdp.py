"""Strategy -> PyTorch FSDP settings, in the two shapes the libraries read them.

* :func:`fsdp_plugin_kwargs`: the ``fsdp_config`` section of an accelerate config YAML (``fsdp_``-prefixed keys,
  as ``accelerate config`` writes them); ``accelerate launch`` turns them into ``FSDP_*`` environment variables.
* :func:`fsdp_training_args`: ``fsdp`` / ``fsdp_config`` for ``transformers.TrainingArguments``, which builds
  accelerate's ``FullyShardedDataParallelPlugin`` from them.

Both come from one table, so the launcher and the Trainer always agree.

Sharding strategies map onto FSDP2 as transformers and accelerate do: ``full_shard`` is
``reshard_after_forward=True``, ``shard_grad_op`` is ``False`` (parameters stay gathered from forward to
backward), ``hybrid_shard`` is full sharding inside a machine plus replication across machines, which FSDP2
expresses as a 2-D device mesh (accelerate's ``parallelism_config``: ``dp_replicate_size`` machines x
``dp_shard_size`` processes each). FSDP2 has no ``no_shard``; :class:`~hfscale.strategy.Strategy` rejects it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from hfscale.strategy import FsdpSpec, Strategy

# FSDP2 checkpoints per rank by default (no gather to rank 0); FSDP1 keeps the HF-compatible single file.
_STATE_DICT_TYPE = {1: "FULL_STATE_DICT", 2: "SHARDED_STATE_DICT"}


@functools.cache
def loads_with_distributed_config() -> bool:
    """Whether the installed transformers loads a tensor-parallel model through a ``DistributedConfig`` that takes
    the mesh's sizes (5.x) rather than ``from_pretrained``'s own ``tp_plan``/``tp_size`` keywords (4.x, whose
    ``DistributedConfig``, where it has one, is for expert parallelism alone)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return {"tp_size", "fsdp_size"} <= set(inspect.signature(DistributedConfig).parameters)


def fsdp_by_transformers(strategy: Strategy) -> bool:
    """Whether transformers shards the model with FSDP2 itself, when it loads it (FSDP2 beside tensor parallel,
    where transformers loads tp through ``DistributedConfig``): accelerate then gets no FSDP plugin, and the
    Trainer prepares the sharded model without wrapping it again (``is_distributed_loading_by_transformers``).

    transformers builds one mesh of ``pp x dp_replicate x fsdp x tp`` from that config, which must take every
    process, so FSDP2 x tp cannot go through accelerate's FSDP2 on such a transformers: a model loaded with tp alone
    fails the load on more processes than tp ("The parallel mesh requires 2 processes, but world_size is 4"), and
    one loaded with the FSDP sizes too is refused by accelerate's FSDP2 prepare (both measured with transformers
    5.25 and accelerate 1.16 on 4 CPU processes)."""
    p = strategy.parallelism
    fsdp2 = strategy.fsdp is not None and strategy.fsdp.version == 2
    return fsdp2 and p is not None and p.tp > 1 and loads_with_distributed_config()


def fsdp_by_accelerate(strategy: Strategy) -> bool:
    """Whether accelerate applies the strategy's FSDP (its plugin, the YAML's ``fsdp_config``, the Trainer's
    ``fsdp`` keywords, the ``FSDP`` distributed type): wherever there is FSDP and transformers does not shard the
    model itself (:func:`fsdp_by_transformers`)."""
    return strategy.fsdp is not None and not fsdp_by_transformers(strategy)


def transformers_fsdp_refusal(strategy: Strategy, transformer_layer_cls: str | None = None) -> tuple[str, str] | None:
    """``(the trial's key, why)`` for a setting that transformers' own sharding of a tp model does not take
    (:func:`fsdp_by_transformers`), or None. transformers shards every decoder layer with
    ``reshard_after_forward=True`` along the model's own plan (``full_shard``, its own wrapping), offloads to the
    CPU where asked (``DistributedConfig(fsdp_cpu_offload=True)``) and gathers the parameters in bf16 where asked
    (``fsdp_mixed_precision=True``, bf16 only: fp16 is refused, its gathers would stay fp32);
    ``transformer_layer_cls`` is a block class named beside the strategy's."""
    if not fsdp_by_transformers(strategy):
        return None
    fsdp = _spec(strategy)
    why = "beside tp, transformers shards the model itself when it loads it"
    if fsdp.sharding != "full_shard":
        return "fsdp.sharding", (
            f"{why}, as full_shard (resharding each layer after forward; hybrid where parallelism has dp_replicate, "
            f"so write full_shard for that too); got {fsdp.sharding}"
        )
    if fsdp.auto_wrap != "transformer_layer":
        return "fsdp.auto_wrap", f"{why}, one unit per decoder layer by the model's own plan; got {fsdp.auto_wrap}"
    named = transformer_layer_cls or fsdp.transformer_layer_cls
    if named is not None:
        return "fsdp.transformer_layer_cls", f"{why}, one unit per decoder layer by the model's own plan: not {named}"
    if strategy.precision == "fp16":
        return "precision", f"{why}, and its FSDP casts the parameters to bf16 only (fp16 would gather fp32): use bf16"
    return None


def _spec(strategy: Strategy) -> FsdpSpec:
    if strategy.fsdp is None:
        raise ValueError("the strategy has no FSDP section (strategy.fsdp is None)")
    return strategy.fsdp


def _layer_cls(spec: FsdpSpec, transformer_layer_cls: str | None) -> str | None:
    if spec.auto_wrap != "transformer_layer":
        return None
    return transformer_layer_cls or spec.transformer_layer_cls


def _settings(strategy: Strategy, transformer_layer_cls: str | None) -> dict[str, Any]:
    """The FSDP settings without prefix, in ``TrainingArguments.fsdp_config`` spelling."""
    spec = _spec(strategy)
    settings: dict[str, Any] = {"version": spec.version}
    if spec.version == 2:
        settings["reshard_after_forward"] = spec.sharding != "shard_grad_op"
    else:
        settings["reshard_after_forward"] = spec.sharding.upper()
    settings["cpu_offload"] = spec.cpu_offload
    settings["auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP" if spec.auto_wrap == "transformer_layer" else "NO_WRAP"
    layer_cls = _layer_cls(spec, transformer_layer_cls)
    if layer_cls is not None:
        settings["transformer_layer_cls_to_wrap"] = layer_cls
    settings["state_dict_type"] = _STATE_DICT_TYPE[spec.version]
    # Models are built in every process; loading on rank 0 only and broadcasting is for big pretrained weights.
    settings["cpu_ram_efficient_loading"] = False
    # FSDP's own activation checkpointing: the Trainer's `activation_checkpointing` with FSDP adds a redundant
    # all-gather in backward, and the Trainer refuses both at once.
    settings["activation_checkpointing"] = strategy.gradient_checkpointing
    if spec.version == 1:
        settings |= {
            "backward_prefetch": "BACKWARD_PRE",
            "forward_prefetch": False,
            "use_orig_params": True,
            "sync_module_states": True,
        }
    return settings


def fsdp_plugin_kwargs(strategy: Strategy, *, transformer_layer_cls: str | None = None) -> dict[str, Any]:
    """The ``fsdp_config`` section of an accelerate config YAML.

    Args:
        strategy: a strategy with ``fsdp`` set.
        transformer_layer_cls: the block class to wrap (e.g. ``"BertLayer"``); overrides
            ``strategy.fsdp.transformer_layer_cls``. None leaves it to the model's ``_no_split_modules``.

    Raises:
        ValueError: when the strategy has no FSDP section.
    """
    settings = _settings(strategy, transformer_layer_cls)
    # accelerate's YAML names the offload flag after what it offloads.
    settings["offload_params"] = settings.pop("cpu_offload")
    return {f"fsdp_{key}": value for key, value in settings.items()}


def fsdp_training_args(strategy: Strategy, *, transformer_layer_cls: str | None = None) -> dict[str, Any]:
    """``fsdp`` and ``fsdp_config`` keywords for ``transformers.TrainingArguments`` (empty without FSDP, and where
    transformers shards the model itself: :func:`fsdp_by_transformers`)."""
    if not fsdp_by_accelerate(strategy):
        return {}
    settings = _settings(strategy, transformer_layer_cls)
    if "transformer_layer_cls_to_wrap" in settings:
        settings["transformer_layer_cls_to_wrap"] = [settings["transformer_layer_cls_to_wrap"]]
    if strategy.fsdp.version == 1:
        settings["reshard_after_forward"] = settings["reshard_after_forward"].lower()
        settings["backward_prefetch"] = settings["backward_prefetch"].lower()
    return {"fsdp": True, "fsdp_config": settings}


def hybrid_shard_section(strategy: Strategy) -> dict[str, Any]:
    """accelerate's ``parallelism_config`` YAML section for ``hybrid_shard``: the 2-D mesh FSDP2 uses, else empty.

    The same section for a ``strategy.parallelism`` mesh is :func:`hfscale.configs.accelerate.accelerate_section`;
    the mesh as the object ``TrainingArguments`` takes is
    :func:`hfscale.techniques.mesh.accelerate_parallelism_config`.
    """
    spec = strategy.fsdp
    if spec is None or spec.version != 2 or spec.sharding != "hybrid_shard":
        return {}
    return {
        "parallelism_config_dp_replicate_size": strategy.num_machines,
        "parallelism_config_dp_shard_size": strategy.num_processes // strategy.num_machines,
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 1,
    }


__all__ = [
    "fsdp_by_accelerate",
    "fsdp_by_transformers",
    "fsdp_plugin_kwargs",
    "fsdp_training_args",
    "hybrid_shard_section",
    "loads_with_distributed_config",
    "transformers_fsdp_refusal",
]
