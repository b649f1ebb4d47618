"""The optimizer steps a trial trains, counted once (hfscale.workload.steps) for the recipe's warm-up check, the
adaptive search's short first run and the largest-batch row, and checked against the Trainer's own count."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.models import TINY_BERT

from hfscale.launch.plan import PlannedRun
from hfscale.recipes.schema import RecipeTrial, RunSpec
from hfscale.strategy import DeepSpeedSpec, ParallelismSpec, Strategy
from hfscale.sweep.adaptive import MIN_SHORT_STEPS, first_run
from hfscale.workload.lengths import packed_rows
from hfscale.workload.spec import DataSpec, LengthSpec, MeasureSpec, ModelSpec, ScriptSpec, TrialSpec
from hfscale.workload.steps import epoch_steps, optimizer_steps, steps_per_epoch

PACKED = DataSpec(
    num_samples=800, seq_len=128, lengths=LengthSpec(distribution="normal", mean=16, sd=4), packing="pack"
)
"""800 sequences of about 16 tokens: about 100 packed rows of 128, an eighth of the samples."""


@pytest.mark.parametrize(
    ("rows", "batch", "accumulation", "epochs"),
    [(128, 8, 1, 1.0), (100, 8, 1, 1.0), (100, 8, 3, 1.0), (100, 7, 2, 2.5), (5, 8, 4, 0.4)],
)
def test_the_count_is_the_trainers_own(rows: int, batch: int, accumulation: int, epochs: float, tmp_path) -> None:
    """The Trainer's ``set_initial_training_values`` on a loader of ``rows`` rows, against ours: one process."""
    from torch.utils.data import DataLoader
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=epochs,
        use_cpu=True,
        report_to="none",
    )
    trainer = Trainer(model=BertForSequenceClassification(BertConfig(**TINY_BERT)), args=args)
    trainer_steps = trainer.set_initial_training_values(args, DataLoader(range(rows), batch_size=batch))[-1]
    strategy = Strategy(name="s", per_device_batch_size=batch, gradient_accumulation_steps=accumulation)
    data = DataSpec(num_samples=rows, seq_len=16)
    assert epoch_steps(strategy, data, epochs) == trainer_steps


def test_replicas_share_the_rows_before_the_batch_rounds_up() -> None:
    """100 rows over two replicas: 50 each, 7 batches of 8 (the last partial), 7 steps."""
    assert steps_per_epoch(Strategy(name="s", per_device_batch_size=8, num_processes=2), 100) == 7


def test_packed_data_counts_its_rows_not_its_sequences() -> None:
    spec = TrialSpec(name="t", strategy=Strategy(name="t", per_device_batch_size=4), data=PACKED)
    assert optimizer_steps(spec) == -(-packed_rows(PACKED) // 4) < PACKED.num_samples // 4


def test_only_the_run_knows_a_factorys_a_scripts_or_a_sequence_parallel_count() -> None:
    strategy = Strategy(name="t", per_device_batch_size=4)
    assert optimizer_steps(TrialSpec(name="t", strategy=strategy, data=DataSpec(factory="m:f"))) is None
    scripted = TrialSpec(name="t", strategy=strategy, script=ScriptSpec(path="train.py"))
    assert optimizer_steps(scripted) is None
    capped = dataclasses.replace(scripted, measure=MeasureSpec(max_steps=30))
    assert optimizer_steps(capped) == 30
    ulysses = Strategy(
        name="sp2", num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=1), parallelism=ParallelismSpec(sp=2)
    )
    assert epoch_steps(ulysses, DataSpec(num_samples=64), 1.0) is None


def test_a_packed_trials_short_first_run_is_shorter_than_its_full_run() -> None:
    """The search's first run of a packed trial: half its steps, at least MIN_SHORT_STEPS. It counted sequences
    (200 steps for the 800 of PACKED at batch 4) where the Trainer counts packed rows (about 25), so the "short"
    run was capped at 100 steps and trained four epochs, four times the full run."""
    spec = TrialSpec(
        name="t",
        strategy=Strategy(name="t", per_device_batch_size=4),
        model=ModelSpec(type="gpt2", task="causal_lm"),
        data=PACKED,
    )
    full = optimizer_steps(spec)
    assert full is not None and full > MIN_SHORT_STEPS
    planned = PlannedRun(trial=RecipeTrial(spec=spec, run=RunSpec()), repeat=0, index=0)
    assert first_run(planned).trial.spec.measure.max_steps == max(MIN_SHORT_STEPS, -(-full // 2))


def test_training_args_that_batch_an_epoch_their_own_way_leave_the_count_to_the_run():
    """dataloader_drop_last: 100 rows at batch 8 train 12 steps, not 13; accelerate's split or uneven batches
    change it too. The warm-up check and the search's short run then wait for the run."""
    spec = TrialSpec(name="t", strategy=Strategy(name="t", per_device_batch_size=8), data=DataSpec(num_samples=100))
    assert optimizer_steps(spec) == 13
    for args in ({"dataloader_drop_last": True}, {"accelerator_config": {"split_batches": True}}):
        assert optimizer_steps(dataclasses.replace(spec, training_args=args)) is None, args
    assert optimizer_steps(dataclasses.replace(spec, training_args={"dataloader_drop_last": False})) == 13


def test_a_packed_warm_up_too_long_for_its_rows_is_refused_naming_the_rows(tmp_path):
    from helpers.runs import write_recipe

    from hfscale.recipes.recipe import load_recipe
    from hfscale.recipes.schema import RecipeError

    recipe = {
        "device": "cpu",
        "model": {"type": "gpt2", "task": "causal_lm", "config": {"n_embd": 32, "n_layer": 1, "n_head": 2}},
        "data": {"num_samples": 800, "seq_len": 128, "lengths": {"distribution": "normal", "mean": 16, "sd": 4},
                 "packing": "pack", "token_high": 1000},
        "measure": {"warmup_steps": 30},
        "trials": [{"name": "t", "per_device_batch_size": 4}],
    }  # fmt: skip
    rows = packed_rows(DataSpec(**{**recipe["data"], "lengths": LengthSpec(**recipe["data"]["lengths"])}))
    with pytest.raises(RecipeError, match=rf"of {rows} samples \(the rows data.num_samples 800 packs into\)"):
        load_recipe(write_recipe(tmp_path, recipe))
