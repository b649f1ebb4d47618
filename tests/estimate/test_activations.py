"""hfscale.estimate.activations: the inventory against the bytes glibc's allocator holds after a forward pass.

Every CPU tensor is a malloc, so the allocator's in-use bytes after a training-mode forward pass, less what it held
before, are the tensors saved for the backward pass; the estimate's CPU inventory must match them, and scale with
batch and sequence length as they do.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch
from helpers.models import SMALL_BERT, SMALL_GPT2

from hfscale.estimate import activation_bytes, model_shape_from_module

_IN_BLOCK = re.compile(r"\.(layer|h)\.\d+\.")


def small_model(kind: str, *, checkpointing: bool = False, **overrides):
    """A small BERT classifier or GPT-2 LM in training mode, seeded."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(**{**SMALL_BERT, **overrides}))
    else:
        model = GPT2LMHeadModel(GPT2Config(**{**SMALL_GPT2, **overrides}))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _forward_retained_bytes(in_use, model, *, batch: int, seq_len: int, precision: str, task: str) -> int:
    """Bytes still allocated after a training-mode forward pass, the output's logits excluded."""
    ids = torch.randint(100, 1000, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    labels = ids if task == "causal_lm" else torch.zeros(batch, dtype=torch.long)
    retained = 0
    for _ in range(2):  # the first pass allocates one-time state
        gc.collect()
        before = in_use()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(input_ids=ids, labels=labels)
        retained = in_use() - before - out.logits.numel() * out.logits.element_size()
        out.loss.backward()
        del out
        model.zero_grad(set_to_none=True)
    return retained


def _predicted_forward_bytes(model, *, batch, seq_len, precision, checkpointing) -> int:
    shape = model_shape_from_module(model)
    act = activation_bytes(
        shape, batch_size=batch, seq_len=seq_len, precision=precision, device="cpu",
        gradient_checkpointing=checkpointing,
    )  # fmt: skip
    # the forward pass keeps what the layers save; one layer's rebuild happens later, in the backward pass.
    # Under autocast the half weight copies are saved too, except inside checkpointed layers.
    copies = 0
    if precision == "bf16":
        copies = 2 * sum(
            p.numel for p in shape.params if p.in_matmul and not (checkpointing and _IN_BLOCK.search(p.name))
        )
    return act.layers_kept + act.outside_layers + copies


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_activations_match_the_allocator(malloc_in_use, kind, precision, checkpointing):
    model = small_model(kind, checkpointing=checkpointing)
    task = "causal_lm" if kind == "gpt2" else "classification"
    measured = _forward_retained_bytes(malloc_in_use, model, batch=8, seq_len=128, precision=precision, task=task)
    predicted = _predicted_forward_bytes(model, batch=8, seq_len=128, precision=precision, checkpointing=checkpointing)
    assert predicted == pytest.approx(measured, rel=0.10), f"predicted {predicted} bytes, measured {measured}"


def test_activations_are_linear_in_batch(malloc_in_use):
    model = small_model("bert")
    m4, m8 = (
        _forward_retained_bytes(malloc_in_use, model, batch=b, seq_len=128, precision="fp32", task="classification")
        for b in (4, 8)
    )
    p4, p8 = (
        _predicted_forward_bytes(model, batch=b, seq_len=128, precision="fp32", checkpointing=False) for b in (4, 8)
    )
    assert m8 / m4 == pytest.approx(2.0, rel=0.05)
    assert p8 / p4 == pytest.approx(m8 / m4, rel=0.03)


def _quadratic_coefficient(points: list[tuple[int, int]]) -> float:
    """beta of f(s) = gamma + alpha*s + beta*s^2 through three points."""
    (s1, f1), (s2, f2), (s3, f3) = points
    d1 = (f2 - f1) / (s2 - s1)
    d2 = (f3 - f2) / (s3 - s2)
    return (d2 - d1) / (s3 - s1)


@pytest.mark.parametrize("attention_dropout", [0.1, 0.0], ids=["math-path", "flash-path"])
def test_activations_in_sequence_length(malloc_in_use, attention_dropout):
    """With attention dropout the CPU runs SDPA's math path and keeps s² scores; without, its flash kernel."""
    model = small_model("bert", attention_probs_dropout_prob=attention_dropout)
    lengths = (64, 128, 256)
    measured = [
        _forward_retained_bytes(malloc_in_use, model, batch=4, seq_len=s, precision="fp32", task="classification")
        for s in lengths
    ]
    predicted = [
        _predicted_forward_bytes(model, batch=4, seq_len=s, precision="fp32", checkpointing=False) for s in lengths
    ]
    beta_measured = _quadratic_coefficient(list(zip(lengths, measured, strict=True)))
    beta_predicted = _quadratic_coefficient(list(zip(lengths, predicted, strict=True)))
    if attention_dropout:
        # softmax output, dropout noise, dropped probabilities: 3 fp32 tensors of a*s^2*b per layer
        assert beta_predicted == 3 * 4 * 2 * 4 * 2
        assert beta_measured == pytest.approx(beta_predicted, rel=0.05)
    else:
        assert beta_predicted == 0
        assert abs(beta_measured) * lengths[-1] ** 2 < 0.02 * measured[-1]


def test_activation_bytes_rejects_an_empty_batch():
    model = small_model("bert")
    with pytest.raises(ValueError, match="batch_size and seq_len must be positive, got 0 and 16"):
        activation_bytes(model_shape_from_module(model), batch_size=0, seq_len=16)
