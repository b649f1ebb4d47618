"""How many optimizer steps a trial trains, known before it runs.

Three places need the figure: the recipe's check that a warm-up leaves steps to measure, the adaptive search's
shortened first run, and the largest-batch trial, which keeps the trial's steps per epoch at its larger batch. One
count, the Trainer's, serves all three, so that they cannot disagree about the same trial.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hfscale.workload.lengths import packed_rows

if TYPE_CHECKING:
    from hfscale.strategy import Strategy
    from hfscale.workload.spec import DataSpec, TrialSpec


def rows_per_epoch(data: DataSpec) -> int | None:
    """Rows the dummy data set holds (packed data holds fewer rows than sequences); None when only
    ``data.factory`` knows."""
    if data.factory is not None:
        return None
    return packed_rows(data) if data.packing == "pack" else data.num_samples


def steps_per_epoch(strategy: Strategy, rows: int) -> int:
    """The Trainer's optimizer steps per epoch over ``rows`` rows: each replica's share rounded up, its batches
    rounded up, then its accumulated batches rounded up (the Trainer steps the optimizer on a last, partial
    accumulation)."""
    per_step = strategy.per_device_batch_size * strategy.gradient_accumulation_steps
    replicas = max(1, strategy.global_batch_size // per_step)
    batches = math.ceil(math.ceil(rows / replicas) / strategy.per_device_batch_size)
    return max(1, math.ceil(batches / strategy.gradient_accumulation_steps))


def epoch_steps(strategy: Strategy, data: DataSpec, num_epochs: float) -> int | None:
    """The optimizer steps of ``num_epochs`` epochs over the dummy data, rounded up as the Trainer rounds them; None
    when only the run knows: a data factory's data, or sequence parallelism (the Trainer shards the data over its
    ranks too and multiplies the steps back)."""
    rows = rows_per_epoch(data)
    if rows is None or (strategy.parallelism is not None and strategy.parallelism.sp > 1):
        return None
    return math.ceil(num_epochs * steps_per_epoch(strategy, rows))


BATCHING_ARGS = ("dataloader_drop_last", "accelerator_config")
"""``TrainingArguments`` keywords that change how the Trainer batches an epoch (dropping a last partial batch;
accelerate's ``split_batches``, ``even_batches``, ``dispatch_batches``): where a recipe sets one, the count is left
to the run."""


def batches_its_own_way(training_args: dict[str, object]) -> bool:
    """Whether ``training_args`` set one of :data:`BATCHING_ARGS`."""
    return any(training_args.get(key) for key in BATCHING_ARGS)


def optimizer_steps(spec: TrialSpec) -> int | None:
    """The optimizer steps a run of ``spec`` trains: ``measure.max_steps`` where given, else its epochs'
    (:func:`epoch_steps`); None when they are known only once it runs (a script's data, or ``training_args`` that
    batch an epoch their own way: :data:`BATCHING_ARGS`)."""
    if spec.measure.max_steps is not None:
        return spec.measure.max_steps
    if spec.script is not None or batches_its_own_way(spec.training_args):
        return None
    return epoch_steps(spec.strategy, spec.data, spec.measure.num_epochs)
