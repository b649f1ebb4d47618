"""Every shipped recipe loads and validates, and what ships is what the checkout's recipes/ holds (recipes are
data: read with yaml.safe_load, never imported)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.paths import REPO

from hfscale.recipes.catalog import RECIPES_DIR, recipe_names, resolve_recipe, shipped_recipe
from hfscale.recipes.recipe import load_recipe, shipped_recipes
from hfscale.workload.model import build_config

CHECKOUT_RECIPES = REPO / "recipes"
RECIPES = sorted(CHECKOUT_RECIPES.glob("*.yaml"))


def test_recipes_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {"bert_large", "cpu_small", "gpt2_causal", "llama_1b", "cpu_techniques"} <= names


def test_the_shipped_list_is_the_recipes_folder():
    # The package lists exactly the checkout's files, byte for byte (also when hfscale is installed from a wheel).
    assert recipe_names() == [p.stem for p in RECIPES]
    for path in RECIPES:
        assert shipped_recipe(path.stem).read_bytes() == path.read_bytes()
    # The checkout's recipes/ is the package's folder, not a copy that could drift.
    assert CHECKOUT_RECIPES.resolve() == (CHECKOUT_RECIPES.parent / "hfscale" / "recipes" / "shipped").resolve()
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
    # Its special tokens are within its vocabulary (transformers warns about the config wherever it is built, once
    # per process, where one is not: every trial's log said so).
    config = build_config(recipe.model, recipe.data)
    vocab = config.get_text_config(decoder=True).vocab_size
    special = {k: v for k, v in config.to_dict().items() if k.endswith("_token_id") and isinstance(v, int)}
    assert all(0 <= v < vocab for v in special.values()), (special, vocab)


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
    # The nine rows of the transformers guide (their V100 figures: results/README.md).
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


def test_bert_large_has_the_speed_rows_a_big_gpu_user_tries():
    recipe = load_recipe("bert_large")
    trials = {t.name: t for t in recipe.trials}
    fast = [
        t
        for t in recipe.trials
        if (s := t.spec.strategy).precision == "bf16"
        and s.optimizer == "adamw_torch_fused"
        and s.attn_implementation == "sdpa"
        and s.torch_compile is not None
        and s.torch_compile.backend == "inductor"
    ]
    assert fast and all(t.batch == "max" for t in fast)  # compared at the largest batch it fits
    assert trials["bf16-fused-sdpa"].batch == "max" and trials["bf16-fused-sdpa"].spec.strategy.torch_compile is None
    tf32 = trials["bs4-tf32"].spec.strategy
    assert tf32.tf32 and tf32.precision == "fp32"
    assert tf32.replace(tf32=False, name="bs4") == trials["bs4"].spec.strategy  # the same job as bs4, but TF32
    assert any(t.spec.strategy.lora is not None for t in recipe.trials)


def test_llama_1b_is_llama_3_2_1b_shaped_with_every_strategy_at_fixed_and_max_batch():
    import torch
    import transformers

    from hfscale.workload.model import build_config

    recipe = load_recipe("llama_1b")
    assert recipe.model.type == "llama" and recipe.model.task == "causal_lm" and recipe.model.pretrained is None
    config = build_config(recipe.model, recipe.data)
    assert type(config).__name__ == "LlamaConfig"
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (2048, 16, 32, 8)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (8192, 128256, 64)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.tie_word_embeddings
    with torch.device("meta"):  # no memory: the parameter count of the real model
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.24
    assert recipe.data.seq_len == 2048 and recipe.data.token_high <= config.vocab_size
    strategies = [t.spec.strategy for t in recipe.trials]
    assert all(s.precision == "bf16" for s in strategies)
    assert recipe.sweep.batch == "both" and all(t.batch == "both" for t in recipe.trials)
    assert any(s.fsdp is not None and s.fsdp.version == 2 for s in strategies)
    assert any(s.deepspeed is not None and s.deepspeed.zero_stage == 3 for s in strategies)
    assert any(s.parallelism is not None and s.parallelism.tp == 2 == s.num_processes for s in strategies)
    assert {s.lora.quantize_base for s in strategies if s.lora is not None} == {"none", "4bit"}
    assert any(s.gradient_checkpointing for s in strategies)
    assert any(s.torch_compile is not None for s in strategies)


def test_cpu_techniques_exercises_every_cpu_runnable_technique():
    recipe = load_recipe("cpu_techniques")
    assert recipe.device == "cpu"
    strategies = [t.spec.strategy for t in recipe.trials]
    assert {s.attn_implementation for s in strategies} >= {"eager", "sdpa"}
    assert any(s.torch_compile is not None and s.torch_compile.backend in ("aot_eager", "eager") for s in strategies)
    assert any(s.lora is not None and s.lora.quantize_base == "none" for s in strategies)
    assert any(s.activation_offload for s in strategies)
    assert {s.num_processes for s in strategies} == {1, 2}
    assert any(t.batch == "both" for t in recipe.trials)
    # On CPU nothing runs out of memory below the address-space limit: the search needs its own upper limit.
    assert recipe.sweep.max_batch_limit is not None and recipe.sweep.max_batch_limit <= 64
    # A few minutes on 2 cores: a tiny model, one run per trial.
    assert recipe.model.config["hidden_size"] <= 64 and recipe.data.num_samples * recipe.data.seq_len <= 8192
    assert all(t.spec.measure.repeats == 1 for t in recipe.trials)
