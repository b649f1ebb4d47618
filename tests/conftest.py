"""Shared fixtures: tiny models built from configs (never downloaded) and hardware markers."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip hardware-bound tests where the hardware is missing; they are collected, never deleted."""
    n_gpus = _cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason=f"needs 2+ CUDA devices, found {n_gpus}")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


TINY_BERT = dict(
    vocab_size=30522,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    num_labels=2,
)
TINY_GPT2 = dict(vocab_size=30522, n_embd=64, n_layer=2, n_head=2, n_positions=512)


@pytest.fixture
def tiny_bert():
    """A 2-layer, hidden-64 BERT classifier with random weights (about 2M parameters, mostly embeddings)."""
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(**TINY_BERT))


@pytest.fixture
def tiny_gpt2():
    """A 2-layer, hidden-64 GPT-2 causal LM with random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**TINY_GPT2))
