"""hfscale.workload.data: seeded, validated dummy data sets in torch format."""

from __future__ import annotations

import time

import pytest
import torch

from hfscale.workload.data import make_causal_lm_dataset, make_classification_dataset, make_dataset
from hfscale.workload.spec import DataSpec


def test_classification_columns_dtypes_and_ranges():
    ds = make_classification_dataset(64, 32, token_low=10, token_high=50, num_labels=3, seed=1)
    assert len(ds) == 64
    batch = ds[:]
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == (64, 32) and ids.dtype == torch.int64
    assert mask.shape == (64, 32) and mask.dtype == torch.int64 and bool((mask == 1).all())
    assert labels.shape == (64,) and labels.dtype == torch.int64
    assert int(ids.min()) >= 10 and int(ids.max()) < 50
    # 2048 draws from 40 ids: every id shows up, so the range is really used (not a constant).
    assert len(torch.unique(ids)) == 40
    assert set(labels.tolist()) == {0, 1, 2}


def test_causal_lm_labels_are_the_inputs():
    ds = make_causal_lm_dataset(16, 24, seed=3)
    batch = ds[:]
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (16, 24)
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["labels"].dtype == torch.int64


def test_seeded_and_deterministic():
    a = make_classification_dataset(8, 16, seed=7)[:]
    b = make_classification_dataset(8, 16, seed=7)[:]
    c = make_classification_dataset(8, 16, seed=8)[:]
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"], c["input_ids"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"seq_len": -1}, "seq_len"),
        ({"seq_len": 2.5}, "seq_len"),
        ({"token_low": -1}, "token_low"),
        ({"token_low": 50, "token_high": 50}, "token_high"),
        ({"num_labels": 0}, "num_labels"),
        ({"seed": -3}, "seed"),
        ({"num_samples": True}, "num_samples"),
    ],
)
def test_invalid_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_classification_dataset(**kwargs)


def test_make_dataset_follows_the_spec():
    spec = DataSpec(num_samples=12, seq_len=20, token_low=5, token_high=9, num_labels=4, seed=2)
    cls = make_dataset(spec, "classification")[:]
    assert cls["input_ids"].shape == (12, 20)
    assert int(cls["input_ids"].min()) >= 5 and int(cls["input_ids"].max()) < 9
    direct = make_classification_dataset(12, 20, token_low=5, token_high=9, num_labels=4, seed=2)[:]
    assert torch.equal(cls["input_ids"], direct["input_ids"]) and torch.equal(cls["labels"], direct["labels"])
    lm = make_dataset(spec, "causal_lm")[:]
    assert torch.equal(lm["labels"], lm["input_ids"])
    with pytest.raises(ValueError, match="task"):
        make_dataset(spec, "translation")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"data\.seq_len"):
        make_dataset(DataSpec(seq_len=0), "causal_lm")


def test_large_data_set_is_vectorised():
    make_causal_lm_dataset(8, 8)  # imports done
    start = time.perf_counter()
    ds = make_causal_lm_dataset(2048, 512)  # 1M tokens
    elapsed = time.perf_counter() - start
    assert len(ds) == 2048
    # A per-token Python loop takes tens of seconds here; the numpy draw and Arrow conversion well under 10.
    assert elapsed < 10.0, f"took {elapsed:.1f} s"
