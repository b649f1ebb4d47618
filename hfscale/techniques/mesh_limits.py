"""Meshes the installed libraries cannot train, named before anything runs.

Each rule says why, in a user's terms, or returns None: the recipe check (:mod:`hfscale.recipes.checks`) and
``hfscale config --tp`` refuse by the same rules, so a mesh the sweep refuses is never printed for a user's script.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfscale.configs import fsdp as fsdp_configs

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
    return (
        f"tp {p.tp} beside {p.dp_replicate} data-parallel replicas alone: the Trainer would not average the "
        f"replicas' gradients (accelerate skips the DDP wrap under tensor parallel); shard over the other processes "
        f"with FSDP2 instead {fsdp_option}"
    )


def tp_beside_other_dims(strategy: Strategy) -> str | None:
    """Why tensor parallel cannot share the processes with another mesh dimension here, or None.

    Where transformers loads a tp model through ``DistributedConfig`` (5.x), that config builds one mesh of its
    own, ``pp x dp_replicate x fsdp x tp``, which must take every process: a model loaded with tp alone on more
    processes than tp fails the load ("The parallel mesh requires 2 processes, but world_size is 4"; measured with
    transformers 5.25 on 4 CPU processes, dp_shard 2 x tp 2, every trial a crashed row). The meshes beside tp
    hfscale loads that way are FSDP2's: ``dp_shard``, and HSDP's ``dp_replicate x dp_shard``
    (:func:`~hfscale.configs.fsdp.fsdp_by_transformers`: the model is sharded by transformers at load); context and
    sequence parallel beside tp are refused. None where tp takes every process, or where transformers has no such
    ``DistributedConfig`` (4.x: ``tp_plan``/``tp_size``)."""
    p = strategy.parallelism
    if p is None or p.tp == 1 or p.tp == p.size or not fsdp_configs.loads_with_distributed_config():
        return None
    others = {n: size for n, size in p.mesh().items() if n != "tp"}
    if fsdp_configs.fsdp_by_transformers(strategy) and set(others) <= {"dp_shard", "dp_replicate"}:
        return None
    shown = " x ".join(f"{n} {size}" for n, size in others.items())
    return (
        f"tp {p.tp} beside {shown}: the installed transformers loads a tp model through its DistributedConfig, whose "
        "own mesh must take every process, and of the other dimensions hfscale gives it FSDP2's (dp_shard, and "
        f"dp_replicate beside it); shard the other {p.size // p.tp} processes with dp_shard (fsdp version 2; "
        f"dp_replicate x dp_shard for replicas), or give tp all {p.size}"
    )


__all__ = ["replicas_beside_tp", "tp_beside_other_dims"]
