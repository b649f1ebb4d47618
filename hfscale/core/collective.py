"""One gather across the ranks of a training run, so every reader gathers alike (and one process gathers nothing),
and one way to take the process group down at the end of a run.

torch is imported when a gather or the end is asked for, not when this module is: the floors above import it at their
top.
"""

from __future__ import annotations

from typing import Any


def all_gather_object(obj: Any, world_size: int | None = None) -> list[Any]:
    """``obj`` from every rank, in rank order; ``[obj]`` without a started process group of two or more.

    A collective: under several processes every rank must call it, in the same order as every other collective.

    Args:
        obj: anything picklable (torch's ``all_gather_object`` pickles it).
        world_size: the run's process count as the caller knows it (accelerate's ``num_processes``); 1 or less
            gathers nothing whatever torch says. None asks torch alone.
    """
    import torch.distributed as dist

    if world_size is not None and world_size <= 1:
        return [obj]
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def end_process_group() -> None:
    """Take the run's process group down once every rank has reached this point; nothing without one.

    Call it on every rank, after the main process has written what the run produced. The barrier keeps the other
    ranks from exiting first: a rank can abort at interpreter exit (torch 2.13's Gloo teardown race, "terminate
    called without an active exception", pytorch/pytorch#179291), and the launcher then ends the whole group,
    the main process with it, possibly before it has written its result.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


__all__ = ["all_gather_object", "end_process_group"]
