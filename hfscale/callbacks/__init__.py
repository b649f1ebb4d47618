"""Trainer callbacks that measure peak memory and steady-state throughput, on every rank, at negligible cost, and
one that checks the strategy asked for is the one that runs.

Add them to any ``transformers.Trainer``, and bind them to it with :func:`attach`::

    trainer = Trainer(...)
    memory, throughput = MemoryCallback(), ThroughputCallback(warmup_steps=5)
    attach(trainer, memory, throughput, VerificationCallback("configs/zero3"))
    trainer.train()
    memory.summary.to_dict()

Each callback fills a result dataclass (``summary``) when training ends, logs it through ``Trainer.log`` (so it
lands in ``trainer.state.log_history`` and in every ``report_to`` integration: TensorBoard, W&B, ...), and writes
it as JSON when given ``output_path`` (main process only). A callback passed in ``Trainer(callbacks=[...])`` and
never attached finds its Trainer at train begin (:mod:`hfscale.callbacks.base` says how).

Measuring does not change what is measured: no callback synchronises the device on a step (CUDA events, read once
they have completed), and the memory callback reads the allocator only in the first optimizer step and at the end.
"""

from hfscale.callbacks.base import attach
from hfscale.callbacks.memory import MEMORY_PHASES, MemoryCallback, MemorySummary, RankMemory
from hfscale.callbacks.throughput import ThroughputCallback, ThroughputSummary
from hfscale.callbacks.verification import VerificationCallback

__all__ = [
    "MEMORY_PHASES",
    "MemoryCallback",
    "MemorySummary",
    "RankMemory",
    "ThroughputCallback",
    "ThroughputSummary",
    "VerificationCallback",
    "attach",
]
