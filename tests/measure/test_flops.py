"""hfscale.measure.flops: the FLOPs-per-token formula against torch's FLOP counter, the peak table, MFU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.models import TINY_GPT2, counted_flops_per_token

from hfscale.measure.flops import (
    DEVICE_PEAK_FLOPS,
    canonical_device,
    compute_dtype,
    count_parameters_for_flops,
    matmul_parameters,
    mfu,
    model_flops_per_token,
    model_shape,
    peak_flops_per_s,
    transformer_flops_per_token,
)


def _small_vocab_gpt2(*, tied: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    # A small vocabulary keeps the output head from dominating; eager attention is plain matmuls the counter sees.
    config = GPT2Config(
        **TINY_GPT2
        | {"vocab_size": 256, "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": tied},
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(config)


def _small_vocab_bert(*, tied: bool):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return BertForMaskedLM(config)


def _qwen3_with_wide_heads():
    """A tiny Qwen3: 4 query heads x head_dim 32 = 128 attention width on a hidden size of 64 (Qwen3-0.6B has 16 x
    128 on 1024), 2 key/value heads (grouped-query attention)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("build", [_small_vocab_gpt2, _small_vocab_bert], ids=["gpt2", "bert"])
def test_formula_matches_torch_flop_counter(build, tied):
    """Decoder and encoder, output head tied to the token embedding or not: the formula is torch's FLOP count
    within 3% (a tied head left out read 0.62x on GPT-2)."""
    model = build(tied=tied)
    head = model.get_output_embeddings().weight
    assert (head is model.get_input_embeddings().weight) is tied
    counted = counted_flops_per_token(model, batch=2, seq_len=64)
    formula = model_flops_per_token(model, 64)
    # The counter sees matmuls only; biases and LayerNorm weights (in N, ~1.5% here) do no matmul work.
    assert formula == pytest.approx(counted, rel=0.03)


def test_attention_counts_heads_times_head_dim_not_the_hidden_size():
    """Qwen3 sets head_dim apart from hidden / heads: the attention term is query heads x head_dim (128 here), and
    the hidden size (64) read 0.89x of torch's count at 64 tokens and 0.735x at 256 (the attention term grows with
    the context). torch's FLOP counter is the expectation; within 3% (RMSNorm weights in N do no matmul)."""
    model = _qwen3_with_wide_heads()
    assert model.config.num_attention_heads * model.config.head_dim != model.config.hidden_size
    for seq_len in (64, 256):
        counted = counted_flops_per_token(model, batch=2, seq_len=seq_len)
        assert model_flops_per_token(model, seq_len) == pytest.approx(counted, rel=0.03), seq_len


def test_recomputation_is_not_counted_as_useful_work():
    plain = _small_vocab_gpt2(tied=False)
    checkpointed = _small_vocab_gpt2(tied=False)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    counted_plain = counted_flops_per_token(plain, batch=2, seq_len=64)
    counted_ckpt = counted_flops_per_token(checkpointed, batch=2, seq_len=64)
    # Checkpointing really does more arithmetic (the layers' forward runs twice) ...
    assert counted_ckpt > 1.15 * counted_plain
    # ... but the model FLOPs stay those of one forward and one backward.
    assert model_flops_per_token(checkpointed, 64) == model_flops_per_token(plain, 64)


def test_embeddings_are_excluded_and_the_head_counted_tied_or_not():
    tied = _small_vocab_gpt2(tied=True)
    untied = _small_vocab_gpt2(tied=False)
    embeddings = ("transformer.wte", "transformer.wpe")
    embedding_free = sum(p.numel() for n, p in tied.named_parameters() if not n.startswith(embeddings))
    head = 256 * 64  # vocabulary x hidden
    assert count_parameters_for_flops(tied) == embedding_free
    assert count_parameters_for_flops(untied) == embedding_free + head
    assert count_parameters_for_flops(tied, exclude_embeddings=False) == sum(p.numel() for p in tied.parameters())
    # The FLOPs formula's N: the head's matmul counts whether or not it shares the embedding's tensor.
    assert matmul_parameters(tied) == matmul_parameters(untied) == embedding_free + head


def test_sharded_parameters_are_counted_from_the_config():
    """FSDP1 leaves each rank views of its own shard: counting them reads low by the world size. The shape is then
    taken from a meta-device copy built from the config."""
    model = _small_vocab_gpt2(tied=True)
    whole = model_shape(model)
    for param in model.parameters():
        param.data = param.data.flatten()[: param.numel() // 2]  # what one of two ranks holds
    assert model_shape(model)[0] < 0.6 * whole[0]
    assert model_shape(model, from_config=True) == whole


def test_zero3_partitioned_parameters_count_their_full_size():
    layer = torch.nn.Linear(8, 8, bias=False)
    layer.weight.data = torch.empty(0)  # what ZeRO-3 leaves on a rank
    layer.weight.ds_numel = 64
    assert count_parameters_for_flops(layer) == 64


def test_formula_terms():
    assert transformer_flops_per_token(non_embedding_params=1000, num_layers=2, attention_width=8, seq_len=16) == (
        6 * 1000 + 12 * 2 * 8 * 16
    )
    with pytest.raises(ValueError, match="seq_len"):
        transformer_flops_per_token(non_embedding_params=1000, num_layers=2, attention_width=8, seq_len=0)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_flops_per_token(torch.nn.Linear(2, 2), 16)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla V100-SXM2-16GB", "V100 SXM"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla T4", "T4"),
        ("AMD EPYC 7B13", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_device_names_map_to_the_right_entry(name, key):
    assert canonical_device(name) == key


def test_peak_lookup_by_dtype():
    assert peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert peak_flops_per_s("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops_per_s("NVIDIA A100-SXM4-40GB", "fp16") == 312e12
    assert peak_flops_per_s("Tesla V100-SXM2-16GB", "fp16") == 125e12
    assert peak_flops_per_s("Tesla V100-SXM2-16GB", "bf16") is None  # Volta has no bf16
    assert peak_flops_per_s("AMD EPYC 7B13", "fp32") is None
    for key, peaks in DEVICE_PEAK_FLOPS.items():
        # Dense peaks: 16-bit at least the fp32 figure, and nothing above 1 PFLOP/s on these parts.
        assert all(0 < v < 1.0e15 for v in peaks.values()), key
        if "fp16" in peaks and "fp32" in peaks:
            assert peaks["fp16"] > peaks["fp32"], key


def test_compute_dtype_from_arguments():
    assert compute_dtype(SimpleNamespace(bf16=True, fp16=False, tf32=None)) == "bf16"
    assert compute_dtype(SimpleNamespace(bf16=False, fp16=True, tf32=None)) == "fp16"
    assert compute_dtype(SimpleNamespace(bf16=False, fp16=False, tf32=True)) == "tf32"
    # With tf32 unset, the answer follows torch's global matmul settings: set each one and check both outcomes.
    # What a Linear really produced wins: a bf16 model trained without args.bf16 computes in bf16, and args.bf16
    # that did not take effect (a Linear produced fp32) is not counted against the bf16 peak.
    fp32_args = SimpleNamespace(bf16=False, fp16=False, tf32=None)
    assert compute_dtype(fp32_args, observed="bfloat16") == "bf16"
    assert compute_dtype(fp32_args, observed="float16") == "fp16"
    assert compute_dtype(SimpleNamespace(bf16=True, fp16=False, tf32=True), observed="float32") == "tf32"
    plain = SimpleNamespace(bf16=False, fp16=False, tf32=None)
    precision, allow_tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert compute_dtype(plain) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert compute_dtype(plain) == "tf32"
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def test_mfu():
    # 1e5 tokens/s x 6e9 FLOPs/token = 6e14 FLOP/s over two 1e15 devices.
    assert mfu(tokens_per_s=1e5, flops_per_token=6e9, peak_flops_per_s=1e15, num_devices=2) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="peak_flops_per_s"):
        mfu(tokens_per_s=1.0, flops_per_token=1.0, peak_flops_per_s=0.0, num_devices=1)
    with pytest.raises(ValueError, match="num_devices"):
        mfu(tokens_per_s=1.0, flops_per_token=1.0, peak_flops_per_s=1.0, num_devices=0)
