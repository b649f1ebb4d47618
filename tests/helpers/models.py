"""Tiny models built from configs (never downloaded), and torch's own FLOP count as an independent check."""

from __future__ import annotations

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
TINY_LLAMA = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def counted_flops_per_token(model, batch: int, seq_len: int) -> float:
    """FLOPs per token of one training forward and backward of ``model`` (a causal or masked LM, labels = inputs)
    as torch's own FLOP counter (``torch.utils.flop_counter.FlopCounterMode``) counts them: the independent
    expectation for :mod:`hfscale.measure.flops`' formula."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops() / (batch * seq_len)


SMALL_BERT = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)
"""TINY_BERT with a 1,000-token vocabulary: the embedding table no longer dominates the parameters."""
SMALL_GPT2 = dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=2, n_positions=512)
