"""Meshes the installed libraries cannot train, named before anything runs.

Each rule says why, in a user's terms, or returns None: the recipe check (:mod:`hfscale.recipes.checks`) and
``hfscale config --tp`` refuse by the same rules, so a mesh the sweep refuses is never printed for a user's script.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hfscale.strategy import Strategy


def replicas_beside_tp(strategy: Strategy, *, fsdp_option: str = "(dp_shard, fsdp version 2)") -> str | None:
    """Why a mesh of tensor parallel beside data-parallel replicas alone (``tp > 1``, ``dp_replicate > 1``,
    ``dp_shard == 1``) cannot train here, or None for any other mesh. accelerate refused it until 1.15 and takes it
    from 1.16, but nothing averages the gradients across the replicas: accelerate skips the DDP wrap whenever tp is
    on (``Accelerator.prepare_model``). ``fsdp_option`` is how the reader asks for FSDP2 (a recipe's keys;
    ``hfscale config`` passes its option)."""
    p = strategy.parallelism
    if p is None or p.tp == 1 or p.dp_replicate == 1 or p.dp_shard > 1 or strategy.fsdp is not None:
        return None  # with FSDP2 there is no DDP wrap to skip: what such a mesh lacks, other checks say
    instead = (
        f"give tp all {p.size} processes (the installed transformers loads a tp model beside no other mesh dimension)"
        if loads_with_distributed_config()
        else f"shard over the other processes with FSDP2 instead {fsdp_option}"
    )
    return (
        f"tp {p.tp} beside {p.dp_replicate} data-parallel replicas alone: the Trainer would not average the "
        f"replicas' gradients (accelerate skips the DDP wrap under tensor parallel); {instead}"
    )


def tp_beside_other_dims(strategy: Strategy) -> str | None:
    """Why tensor parallel cannot share the processes with another mesh dimension here, or None.

    The trial loads the model sharded through transformers' ``DistributedConfig`` of tp alone
    (:func:`hfscale.techniques.mesh.load_tensor_parallel`), and that config builds a mesh of its own,
    ``pp x dp_replicate x fsdp x tp``, which must take every process: with tp 2 of 4 processes transformers refuses
    the load ("The parallel mesh requires 2 processes, but world_size is 4"; measured with transformers 5.25 on 4
    CPU processes, dp_shard 2 x tp 2, every trial a crashed row). Giving it the FSDP sizes too gets past the load,
    but then the model is sharded by transformers and accelerate's FSDP2 refuses the Trainer's prepare of it
    (docs/techniques.md). None where tp takes every process, or where transformers has no ``DistributedConfig``
    that takes tp (4.x: ``tp_plan``/``tp_size``)."""
    p = strategy.parallelism
    if p is None or p.tp == 1 or p.tp == p.size or not loads_with_distributed_config():
        return None
    others = " x ".join(f"{n} {size}" for n, size in p.mesh().items() if n != "tp")
    return (
        f"tp {p.tp} beside {others}: the model is loaded sharded through transformers' DistributedConfig, whose own "
        f"mesh must take every process (transformers refuses the load: the parallel mesh requires {p.tp} "
        f"processes, but world_size is {p.size}); give tp all {p.size} processes"
    )


def loads_with_distributed_config() -> bool:
    """Whether the installed transformers loads a tensor-parallel model through a ``DistributedConfig`` that takes
    the tp sizes (5.x) rather than ``from_pretrained``'s own ``tp_plan``/``tp_size`` keywords (4.x, whose
    ``DistributedConfig``, where it has one, is for expert parallelism alone)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return "tp_size" in inspect.signature(DistributedConfig).parameters


__all__ = ["loads_with_distributed_config", "replicas_beside_tp", "tp_beside_other_dims"]
