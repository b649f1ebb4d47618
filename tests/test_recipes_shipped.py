"""Every recipe shipped in recipes/ loads and validates (recipes are data: nothing imports them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfscale.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {"bert_large", "cpu_small", "gpt2_causal"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_loads_and_validates(path):
    recipe = load_recipe(path)
    assert recipe.trials, f"{path.name}: no trials"
    assert recipe.baseline in recipe.trial_names
    assert len(set(recipe.trial_names)) == len(recipe.trial_names)
    for trial in recipe.trials:
        assert trial.spec.strategy.device == recipe.device
        # The launch may change unpinned process counts; every trial must stay valid with 1, 2 and 8 processes.
    for n in (1, 2, 8):
        recipe.resolve(num_processes=n)


def test_bert_large_reproduces_the_reference_setup():
    recipe = load_recipe(next(p for p in RECIPES if p.stem == "bert_large"))
    config = recipe.model.config
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (1024, 24, 16)
    assert config["intermediate_size"] == 4096
    assert recipe.model.task == "classification" and recipe.device == "cuda"
    data = recipe.data
    assert (data.num_samples, data.seq_len, data.token_low, data.token_high) == (512, 512, 100, 30000)
    assert recipe.measure.max_steps is None and recipe.measure.num_epochs == 1
    rows = {
        (s.per_device_batch_size, s.gradient_accumulation_steps, s.gradient_checkpointing, s.precision, s.optimizer)
        for s in (t.spec.strategy for t in recipe.trials)
        if s.deepspeed is None and s.fsdp is None
    }
    # The nine rows of the transformers guide (shared/reference/v100-bert-large.md).
    reference = {
        (4, 1, False, "fp32", "adamw_torch"),
        (1, 4, False, "fp32", "adamw_torch"),
        (1, 4, True, "fp32", "adamw_torch"),
        (4, 1, False, "fp16", "adamw_torch"),
        (1, 4, True, "fp16", "adamw_torch"),
        (4, 1, False, "fp32", "adafactor"),
        (1, 4, True, "fp16", "adafactor"),
        (4, 1, False, "fp32", "adamw_bnb_8bit"),
        (1, 4, True, "fp16", "adamw_bnb_8bit"),
    }
    assert reference <= rows
    stages = {t.spec.strategy.deepspeed.zero_stage for t in recipe.trials if t.spec.strategy.deepspeed}
    assert stages == {1, 2, 3}
    assert any(t.spec.strategy.deepspeed and t.spec.strategy.deepspeed.offloads for t in recipe.trials)
    assert any(t.spec.strategy.fsdp for t in recipe.trials)
    assert any(t.spec.strategy.precision == "bf16" for t in recipe.trials)
