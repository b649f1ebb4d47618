"""Variable-length dummy data (issue 23): lengths drawn from a distribution, padded per batch or packed, checked at
recipe load; and one real sweep of the same model on padded and on packed data, real-token throughput in each."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.runs import one_thread, write_recipe

from hfscale.recipes.recipe import load_recipe
from hfscale.recipes.schema import RecipeError
from hfscale.strategy import Strategy
from hfscale.workload.data import make_training_data
from hfscale.workload.lengths import PAD_ID, draw_lengths, packed_rows
from hfscale.workload.spec import DataSpec, LengthSpec, TrialSpec

UNIFORM = DataSpec(num_samples=64, seq_len=32, token_high=500, lengths=LengthSpec(min=4))


def test_lengths_follow_the_distribution_asked_for() -> None:
    uniform = draw_lengths(DataSpec(num_samples=4000, seq_len=64, lengths=LengthSpec(min=8)))
    assert uniform.min() == 8 and uniform.max() == 64 and abs(uniform.mean() - 36) < 1
    bell = LengthSpec(distribution="normal", mean=40, sd=5)
    normal = draw_lengths(DataSpec(num_samples=4000, seq_len=64, lengths=bell))
    assert abs(normal.mean() - 40) < 0.5 and abs(normal.std() - 5) < 0.5
    hist = LengthSpec(distribution="histogram", histogram={16: 3.0, 64: 1.0})
    drawn = draw_lengths(DataSpec(num_samples=4000, seq_len=64, lengths=hist))
    assert set(np.unique(drawn)) == {16, 64} and abs((drawn == 16).mean() - 0.75) < 0.03


def test_padded_batches_pad_to_their_longest_and_packed_rows_are_full() -> None:
    dataset, collate = make_training_data(UNIFORM, "causal_lm")
    batch = collate([dataset[i] for i in range(8)])
    lengths = draw_lengths(UNIFORM)[:8]
    assert batch["input_ids"].shape == (8, lengths.max())
    assert batch["attention_mask"].sum(1).tolist() == lengths.tolist()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == PAD_ID).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    packed, none = make_training_data(dataclasses.replace(UNIFORM, packing="pack"), "causal_lm")
    assert none is None and len(packed) == packed_rows(UNIFORM) == int(draw_lengths(UNIFORM).sum()) // 32
    assert packed[0]["input_ids"].shape == (32,) and int(packed[0]["attention_mask"].sum()) == 32
    written = json.dumps(TrialSpec(name="t", strategy=Strategy(), data=UNIFORM).to_dict())
    assert TrialSpec.from_dict(json.loads(written)).data == UNIFORM  # lengths survive trial.json


def _recipe(packing: str, task: str = "causal_lm", **lengths) -> dict:
    return {
        "name": f"lengths-{packing}",
        "device": "cpu",
        "model": {"type": "gpt2", "task": task, "config": {"n_embd": 32, "n_layer": 2, "n_head": 2,
                                                           "vocab_size": 512, "n_positions": 64}},
        "data": {"num_samples": 96, "seq_len": 64, "token_high": 500, "packing": packing,
                 "lengths": {"distribution": "uniform", "min": 8, **lengths}},
        "measure": {"warmup_steps": 2, "max_steps": 8, "repeats": 1, "timeout_s": 300},
        "defaults": {"per_device_batch_size": 4},
        "trials": [{"name": packing}],
    }  # fmt: skip


def test_bad_lengths_and_packing_are_refused_with_their_keys(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"data\.packing: pack joins sequences into rows: only for task causal_lm"):
        load_recipe(write_recipe(tmp_path, _recipe("pack", task="classification")))
    with pytest.raises(RecipeError, match=r"data\.lengths\.min: expected 1 to data\.seq_len \(64\), got 100"):
        load_recipe(write_recipe(tmp_path, _recipe("pad", min=100)))
    bad = _recipe("pad")
    bad["data"]["lengths"] = {"distribution": "histogram", "histogram": {16: 1.0, 128: 1.0}}
    with pytest.raises(RecipeError, match=r"data\.lengths\.histogram: .*not \[128\]"):
        load_recipe(write_recipe(tmp_path, bad))
    factory = _recipe("pad")
    factory["data"]["factory"] = "os:getcwd"  # any importable function taking no argument: the lengths beside it
    with pytest.raises(RecipeError, match=r"data\.lengths: shapes hfscale's dummy data: not with data\.factory"):
        load_recipe(write_recipe(tmp_path, factory))


@pytest.mark.slow
def test_padded_against_packed_on_the_same_model_reports_real_token_throughput(tmp_path: Path) -> None:
    from hfscale.sweep.loop import run_sweep

    rows = {}
    for packing in ("pad", "pack"):
        recipe = write_recipe(tmp_path, _recipe(packing), name=f"{packing}.yaml")
        with one_thread():
            run_sweep(recipe, run_dir=tmp_path / packing, report=False, progress=lambda line: None)
        (row,) = [json.loads(line) for line in (tmp_path / packing / "results.jsonl").read_text().splitlines()]
        assert row["status"] == "ok", row["reason"]
        rows[packing] = row["measured"]["throughput"]
    padded, packed = rows["pad"], rows["pack"]
    # Padded batches: the mask keeps fewer tokens than the model computed; packed rows are full.
    assert 0 < padded["real_tokens_per_s"] < padded["tokens_per_s"]
    assert packed["real_tokens_per_s"] == pytest.approx(packed["tokens_per_s"])
    assert packed["tokens_per_sample"] == 64 and padded["tokens_per_sample"] < 64
