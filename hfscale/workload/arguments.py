"""The ``TrainingArguments`` keywords a recipe trial trains with: the recipe's under the strategy's, under the
runner's.

The trial builds its ``TrainingArguments`` from them, and the recipe checks them with ``TrainingArguments``' own
rules before anything runs; both take them from here, so the keywords checked are the keywords trained with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfscale.strategy import Strategy
    from hfscale.workload.spec import TrialSpec

DEFAULT_SEED = 42
"""Seed of every trial whose recipe sets none (``TrainingArguments``' own default)."""

RUNNER_TRAINING_ARGS: dict[str, Any] = {
    "save_strategy": "no",
    "eval_strategy": "no",
}
"""``TrainingArguments`` the runner always sets, over the recipe and the strategy: a trial measures, it does not
keep checkpoints. Logging is left as the recipe (or transformers' default) has it: the loss curve is recorded by
:class:`~hfscale.trial.recording.LossRecorder`, not by logging every step, which would gather and read the loss
on every step. ``average_tokens_across_devices`` follows the strategy (:func:`average_tokens_across_devices`)."""


def average_tokens_across_devices(strategy: Strategy, *, task: str) -> bool:
    """``TrainingArguments.average_tokens_across_devices`` for ``strategy`` training a model of ``task``: False,
    unless tensor parallel ranks share a batch (``tp`` above one) and the loss divides by the token count (a causal
    LM's).

    With it on, an N-process data-parallel run logged its loss N times too large (measured): the Trainer multiplies
    the loss by the processes that see distinct batches, which cancels only a loss divided by the token count
    gathered over them. But the Trainer also divides its token count by the ranks that share a batch
    (``tp x cp x sp``, ``_get_num_items_in_batch``, transformers 5.25), which is right only for the gathered count:
    with it off, a causal LM under tp 2 trained on, and logged, twice the loss (11.1 at the first step of a tiny
    Llama of 256 tokens, where ln 256 = 5.55; 5.56 with it on; measured on 4 CPU processes, dp_shard 2 x tp 2, and
    on 2, tp 2, 2026-12-07). A classifier's loss ignores the count, so under dp_shard 2 x tp 2 it is right with it
    off and twice too large with it on (measured in a review run: 0.705 against 1.409 at the first step). cp and
    DeepSpeed's sp leave it off (not measured here: by the Trainer's code cp's loss is the same either way, and sp
    computes its own, ``deepspeed_sp_compute_loss``)."""
    p = strategy.parallelism
    return p is not None and p.tp > 1 and task == "causal_lm"


def runner_training_args(spec: TrialSpec) -> dict[str, Any]:
    """What the runner sets over everything: :data:`RUNNER_TRAINING_ARGS`, the step count of ``spec.measure`` and
    :func:`average_tokens_across_devices`."""
    steps = {"max_steps": spec.measure.max_steps} if spec.measure.max_steps is not None else {
        "max_steps": -1, "num_train_epochs": spec.measure.num_epochs}  # fmt: skip
    averaged = {"average_tokens_across_devices": average_tokens_across_devices(spec.strategy, task=spec.model.task)}
    return dict(RUNNER_TRAINING_ARGS) | steps | averaged


def owned_by_runner(spec: TrialSpec) -> dict[str, Any]:
    """:func:`runner_training_args` and the seed (the recipe's, else :data:`DEFAULT_SEED`)."""
    return runner_training_args(spec) | {"seed": int(spec.training_args.get("seed", DEFAULT_SEED))}


def trial_training_args(spec: TrialSpec, strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords of a recipe trial, ``output_dir`` aside: recipe < strategy < runner.

    The recipe's ``spec.training_args`` sit under ``strategy_kwargs`` (the strategy's keywords), and
    :func:`owned_by_runner` over both. ``report_to`` is ``"none"`` and ``disable_tqdm`` true unless the recipe sets
    them.
    """
    merged: dict[str, Any] = {"report_to": "none", "disable_tqdm": True, "dataloader_num_workers": 0}
    if spec.strategy.device == "cpu":
        merged["dataloader_pin_memory"] = False  # pinning needs a CUDA runtime
    merged |= spec.training_args
    merged |= strategy_kwargs
    merged |= owned_by_runner(spec)
    merged.pop("output_dir", None)
    return merged


__all__ = [
    "DEFAULT_SEED",
    "RUNNER_TRAINING_ARGS",
    "average_tokens_across_devices",
    "owned_by_runner",
    "runner_training_args",
    "trial_training_args",
]
