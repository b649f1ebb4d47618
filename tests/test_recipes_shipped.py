"""Every shipped recipe loads and validates, and what ships is what the checkout's recipes/ holds (recipes are
data: read with yaml.safe_load, never imported)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hfscale.catalog import RECIPES_DIR, recipe_names, resolve_recipe, shipped_recipe, shipped_recipes
from hfscale.recipe import load_recipe

CHECKOUT_RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(CHECKOUT_RECIPES.glob("*.yaml"))


def test_recipes_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {"bert_large", "cpu_small", "gpt2_causal"} <= names


def test_the_shipped_list_is_the_recipes_folder():
    # The package lists exactly the checkout's files, byte for byte (also when hfscale is installed from a wheel).
    assert recipe_names() == [p.stem for p in RECIPES]
    for path in RECIPES:
        assert shipped_recipe(path.stem).read_bytes() == path.read_bytes()
    # The checkout's recipes/ is the package's folder, not a copy that could drift.
    assert CHECKOUT_RECIPES.resolve() == (CHECKOUT_RECIPES.parent / "hfscale" / "recipes").resolve()
    listed = shipped_recipes()
    assert [r.name for r in listed] == recipe_names()
    for entry in listed:
        recipe = load_recipe(entry.path)
        assert entry.path.parent == RECIPES_DIR
        assert entry.trial_count == len(recipe.trials) > 0
        assert entry.description and entry.device == recipe.device


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_loads_and_validates(path, tmp_path, monkeypatch):
    # By name, from a folder without recipe files, as an installed user runs it; the same recipe as its path.
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(path.stem)
    assert resolve_recipe(path.stem) == shipped_recipe(path.stem)
    assert dataclasses.replace(load_recipe(path), path=recipe.path) == recipe
    assert recipe.trials, f"{path.name}: no trials"
    assert recipe.baseline in recipe.trial_names
    assert len(set(recipe.trial_names)) == len(recipe.trial_names)
    for trial in recipe.trials:
        assert trial.spec.strategy.device == recipe.device
        # The launch may change unpinned process counts; every trial must stay valid with 1, 2 and 8 processes.
    for n in (1, 2, 8):
        recipe.resolve(num_processes=n)


def test_bert_large_reproduces_the_reference_setup():
    recipe = load_recipe("bert_large")
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
