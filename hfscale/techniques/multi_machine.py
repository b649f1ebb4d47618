"""Across machines, verified: which machine each rank ran on, and how FSDP2 laid its mesh over them.

A run asked for M machines x P processes can run otherwise without any error: every process on one machine
(node ranks missing), machines with unequal shares of the ranks, or ``hybrid_shard`` falling back to a flat 1-D
mesh (every parameter sharded over all ranks, so each step all-gathers across the slow inter-machine link, the
very cost hybrid sharding exists to avoid). :func:`collect` reads, on every rank and after training:

========================  ==========================================================================================
field                     read from
========================  ==========================================================================================
``machine_rank_per_rank`` the node rank the launcher gave the process (torchrun's ``GROUP_RANK``, else
                          ``NODE_RANK``), gathered from every rank
``hostname_per_rank``     ``socket.gethostname()`` of each process
``fsdp_mesh``             the mesh FSDP2 shards each parameter group on, as FSDP reads it (its ``mesh_info``):
                          ``{"dp_replicate": R, "dp_shard": S}`` for HSDP, ``{"dp_shard": S}`` for a 1-D mesh
``fsdp_shard_groups``     each rank's shard process group (the ranks that split a parameter), deduplicated
========================  ==========================================================================================

:func:`check` compares them with the strategy: node ranks ``0 .. M-1`` all present, ``P / M`` ranks on each, one
host name per machine, and under FSDP2 the mesh (``hybrid_shard``: replicate over machines, shard within; a device
mesh, ``parallelism``: replicate over ``dp_replicate``, shard over ``dp_shard x cp``, so ``full_shard`` with
``dp_replicate > 1`` is hybrid too; else one dimension over every rank), each shard group inside one machine where
the replicas are machines (``hybrid_shard``, or ``dp_replicate`` a multiple of the machine count), and under hybrid
sharding parameters held per rank about ``1 / dp_shard`` (``1 / (dp_shard x tp)`` beside tensor parallel; not
sharded further, as a flat mesh would). ``hfscale.measure.verify`` calls both; a field it could not read is left out.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hfscale.core.collective import all_gather_object
from hfscale.core.params import fsdp2_param_groups
from hfscale.techniques.base import Technique, TrainedRun

if TYPE_CHECKING:
    import torch

    from hfscale.records.measurements import VerificationRecord
    from hfscale.strategy import Strategy

logger = logging.getLogger(__name__)

# An even share of parameters, padded (each FSDP2 shard is rounded up), is within this factor of total / shards;
# a mesh that shards further (a flat mesh over M x P ranks under hybrid_shard) is at most 1/M of it.
_SHARE_SLACK = 1.25


def machine_rank_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The node rank the launcher gave this process: torchrun's ``GROUP_RANK`` (its rendezvous' answer), else
    ``NODE_RANK``, else Slurm's ``SLURM_NODEID``, else ``RANK // LOCAL_WORLD_SIZE`` (launchers that number the ranks
    machine by machine); None when the environment says nothing of machines."""
    env = os.environ if env is None else env
    for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    try:
        return int(env["RANK"]) // max(int(env["LOCAL_WORLD_SIZE"]), 1)
    except (KeyError, ValueError):
        return None


def fsdp_mesh_facts(model: torch.nn.Module) -> tuple[dict[str, int] | None, list[int] | None]:
    """``(mesh, shard_group_ranks)`` of an FSDP2 model as FSDP itself reads its mesh: dimension -> size
    (``dp_replicate``, ``dp_shard``) and the global ranks this rank's parameters are sharded over; ``(None, None)``
    without FSDP2 or where torch's internals moved."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None, None
    try:
        for _, group in fsdp2_param_groups(model)[:1]:  # every unit shards on the same mesh
            info = group.mesh_info
            mesh: dict[str, int] = {}
            if getattr(info, "replicate_mesh_dim", None) is not None:
                mesh["dp_replicate"] = int(info.mesh.size(info.replicate_mesh_dim))
            ranks = None
            if getattr(info, "shard_mesh_dim", None) is not None:
                mesh["dp_shard"] = int(info.mesh.size(info.shard_mesh_dim))
                ranks = sorted(int(r) for r in dist.get_process_group_ranks(info.shard_process_group))
            return mesh, ranks
    except (AttributeError, RuntimeError) as exc:
        logger.warning("FSDP2's mesh could not be read (torch internals moved?): %s", exc)
    return None, None


def collect(model: torch.nn.Module, world_size: int) -> dict[str, Any]:
    """The machine fields of a :class:`~hfscale.records.measurements.VerificationRecord`, read on this rank and
    gathered.

    Collective under several processes (one ``all_gather_object``): call it on every rank.
    """
    mesh, shard_ranks = fsdp_mesh_facts(model)
    machine = machine_rank_from_env()
    if machine is None and world_size <= 1:
        machine = 0  # one process, no launcher: one machine
    gathered = all_gather_object((machine, socket.gethostname(), shard_ranks), world_size)
    groups = sorted({tuple(g) for _, _, g in gathered if g is not None})
    machines = [m for m, _, _ in gathered]
    return {
        # A rank whose launcher said nothing of machines leaves them unread (not compared), never guessed.
        "machine_rank_per_rank": [int(m) for m in machines] if None not in machines else [],
        "hostname_per_rank": [str(h) for _, h, _ in gathered],
        "fsdp_mesh": mesh,
        "fsdp_shard_groups": [list(g) for g in groups],
    }


def expected_fsdp_mesh(strategy: Strategy) -> dict[str, int] | None:
    """The mesh FSDP2 should shard on for ``strategy`` (:attr:`~hfscale.strategy.Strategy.fsdp_mesh`):
    ``hybrid_shard`` replicates across the machines and shards over each machine's processes; a device mesh
    (``parallelism``) shards over ``dp_shard x cp`` and replicates over ``dp_replicate``; any other sharding is one
    dimension over every process. None without FSDP2."""
    return strategy.fsdp_mesh


def check(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """How the machines and the FSDP2 mesh that ran differ from ``strategy``, one sentence each (empty: as asked,
    or not read)."""
    problems = _check_machines(strategy, rec)
    problems += _check_mesh(strategy, rec)
    return problems


def _check_machines(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    ranks = rec.machine_rank_per_rank
    machines, processes = strategy.num_machines, strategy.world_size
    if not ranks or len(ranks) != processes:
        return []  # not read, or a world-size mismatch already reported
    problems = []
    missing = sorted(set(range(machines)) - set(ranks))
    unexpected = sorted(set(ranks) - set(range(machines)))
    if missing or unexpected:
        what = []
        if missing:
            what.append(f"machine rank(s) {missing} took no part")
        if unexpected:
            what.append(f"machine rank(s) {unexpected} are outside 0..{machines - 1}")
        problems.append(
            f"{' and '.join(what)}: the ranks ran on machines {ranks}, strategy.num_machines={machines} asks for "
            f"{processes // machines} process(es) on each of machines 0..{machines - 1}"
        )
    else:
        per_machine = {m: ranks.count(m) for m in range(machines)}
        if len(set(per_machine.values())) > 1 or per_machine[0] != processes // machines:
            problems.append(
                f"processes per machine are {per_machine}, expected {processes // machines} on each of "
                f"{machines} machine(s) (strategy.num_processes={strategy.num_processes})"
            )
    hosts = rec.hostname_per_rank
    if len(hosts) == len(ranks):
        for m in sorted(set(ranks)):
            names = sorted({h for h, r in zip(hosts, ranks, strict=True) if r == m})
            if len(names) > 1:
                problems.append(f"the ranks of machine {m} ran on several hosts {names}")
    return problems


def _asked_mesh(strategy: Strategy) -> str:
    """How ``strategy`` asks for its FSDP2 mesh, in words, for a mismatch message."""
    p = strategy.parallelism
    if p is not None and p.size > 1:
        tp = f", tp={p.tp}" if p.tp > 1 else ""
        return f"parallelism dp_replicate={p.dp_replicate}, dp_shard={p.dp_shard}, cp={p.cp}{tp}"
    sharding = strategy.fsdp.sharding if strategy.fsdp is not None else None
    why = " (replicate across machines, shard within each)" if sharding == "hybrid_shard" else ""
    return (
        f"fsdp.sharding={sharding!r}{why} on {strategy.num_machines} machine(s) x "
        f"{strategy.num_processes // strategy.num_machines} process(es)"
    )


def _shard_groups_within_machines(strategy: Strategy) -> str | None:
    """What keeps every shard group inside one machine, in words, or None: ``hybrid_shard`` (replicate across the
    machines, shard within each), or a device mesh whose replicas are whole machines or parts of one
    (``dp_replicate`` a multiple of the machine count: ranks are numbered machine by machine, and a replica is a run
    of consecutive ranks)."""
    p, machines = strategy.parallelism, strategy.num_machines
    if p is not None and p.size > 1:  # the mesh decides, whatever fsdp.sharding says (Strategy.fsdp_mesh)
        return f"dp_replicate {p.dp_replicate} over {machines} machines" if p.dp_replicate % machines == 0 else None
    if strategy.fsdp is not None and strategy.fsdp.sharding == "hybrid_shard":
        return "hybrid_shard"
    return None


def _check_mesh(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    expected = expected_fsdp_mesh(strategy)
    if expected is None or rec.fsdp_mesh is None:
        return []
    problems = []
    if rec.fsdp_mesh != expected:
        layout = " x ".join(f"{k} {v}" for k, v in expected.items())
        ran = " x ".join(f"{k} {v}" for k, v in rec.fsdp_mesh.items()) or "none"
        problems.append(f"FSDP2 sharded on a mesh of {ran}, expected {layout} for {_asked_mesh(strategy)}")
    if "dp_replicate" not in expected:
        return problems
    ranks = rec.machine_rank_per_rank
    within = _shard_groups_within_machines(strategy)
    if within is not None and ranks and len(ranks) == strategy.num_processes:
        for group in rec.fsdp_shard_groups:
            on = sorted({ranks[r] for r in group if 0 <= r < len(ranks)})
            if len(on) > 1:
                problems.append(
                    f"FSDP2 shards parameters over ranks {group}, which span machines {on}: {within} keeps each "
                    "shard group inside one machine"
                )
    tp = strategy.parallelism.tp if strategy.parallelism is not None else 1
    shards = expected["dp_shard"] * tp  # tensor parallel splits the weights of its plan further
    if (
        rec.params_local_per_rank
        and rec.params_total
        and rec.params_local_max * _SHARE_SLACK < rec.params_total / shards
    ):
        problems.append(
            f"parameters are sharded further than hybrid_shard asks: {rec.params_local_max:,} of "
            f"{rec.params_total:,} elements on the fullest rank, expected about 1/{shards} (the dp_shard "
            f"{'x tp ' if tp > 1 else ''}ranks of one replica, {_asked_mesh(strategy)})"
        )
    return problems


class MultiMachine(Technique):
    """Several machines (``strategy.num_machines``) and FSDP2's mesh over them: nothing to apply (the launcher
    places the processes), read back and checked from inside the run."""

    name = "multi_machine"

    def collect(self, run: TrainedRun) -> dict[str, Any]:
        return collect(run.model, run.world_size)

    check = staticmethod(check)


TECHNIQUE = MultiMachine()
"""This module's :class:`~hfscale.techniques.base.Technique` (registered in ``hfscale.techniques.TECHNIQUES``)."""

__all__ = [
    "TECHNIQUE",
    "MultiMachine",
    "check",
    "collect",
    "expected_fsdp_mesh",
    "fsdp_mesh_facts",
    "machine_rank_from_env",
]
