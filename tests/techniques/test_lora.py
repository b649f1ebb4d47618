"""LoRA and QLoRA (hfscale.techniques.lora): real tiny CPU trials verified from inside the run, a fallback to full
training caught, and the memory estimate, FLOPs and printed config checked against numbers derived by hand.

The tiny models: BERT (conftest.TINY_BERT: hidden 64, 2 layers, 2 labels) and a Llama (hidden 64, MLP 128, 2 layers,
4 heads, 2 key/value heads: head dim 16, so k_proj and v_proj are 64 -> 32; vocabulary 1000; untied head).
bitsandbytes 0.50 quantises to NF4 and trains through the 4-bit layers on CPU, so QLoRA is tested here too.
"""

from __future__ import annotations

import math

import pytest
from helpers.models import TINY_BERT, TINY_LLAMA, counted_flops_per_token

from hfscale.commands.config import main as config_main
from hfscale.core.units import GIB
from hfscale.estimate import estimate_memory
from hfscale.estimate.lora import SHARDED_LORA_NOTE
from hfscale.measure.flops import (
    GradientFlow,
    GradientFlowProbe,
    matmul_parameters,
    model_flops_per_token,
    transformer_flops_per_token,
)
from hfscale.measure.verify import check
from hfscale.records.measurements import VerificationRecord
from hfscale.strategy import DeepSpeedSpec, LoraSpec, Strategy
from hfscale.techniques.lora import apply_lora, default_target_modules, lora_config_kwargs
from hfscale.trial.train import run_trial
from hfscale.workload.model import build_model
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

pytest.importorskip("peft")

BERT = ModelSpec(type="bert", config=TINY_BERT)
LLAMA = ModelSpec(type="llama", task="causal_lm", config=TINY_LLAMA)
DATA = DataSpec(num_samples=32, seq_len=32, token_high=1000)

# Hand-derived counts (rank 4):
# BERT, peft's default targets query and value (64 -> 64 each): r * (in + out) = 4 * 128 = 512 per module, 2 modules
# x 2 layers = 2048; peft trains a copy of the classifier for SEQ_CLS: 64 * 2 + 2 = 130. Trainable: 2178.
BERT_ADAPTER_PARAMS = 2 * 2 * 4 * (64 + 64) + (64 * 2 + 2)
# TINY_BERT whole: word, position and token-type embeddings + embedding LayerNorm + 2 layers of 33,472 (4 attention
# Linears 64x64+64, FFN 64x128+128 and 128x64+64, two LayerNorms) + pooler 64x64+64 + classifier 64x2+2.
BERT_BASE_PARAMS = 30522 * 64 + 512 * 64 + 2 * 64 + 2 * 64 + 2 * 33_472 + 64 * 64 + 64 + 64 * 2 + 2
BERT_PEFT_TOTAL = BERT_BASE_PARAMS + BERT_ADAPTER_PARAMS  # the base, its LoRA adapters and peft's head copy
# Llama, targets q_proj (64 -> 64: 4 * 128 = 512) and v_proj (64 -> 32: 4 * 96 = 384), 2 layers: 1792.
LLAMA_ADAPTER_PARAMS = 2 * (4 * (64 + 64) + 4 * (64 + 32))
# Llama Linear weights per layer: q 64*64, k 64*32, v 64*32, o 64*64, gate/up/down 64*128 each = 36864; 2 layers.
LLAMA_LINEAR_PARAMS = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192)
LLAMA_HEAD = 1000 * 64  # lm_head (untied): transformers keeps it out of 4 bits
LLAMA_NORMS = 2 * 2 * 64 + 64  # two RMSNorms per layer and the final one


def lora_strategy(**lora: object) -> Strategy:
    return Strategy(name="lora", device="cpu", per_device_batch_size=4, lora=LoraSpec(rank=4, alpha=8, **lora))


def spec_for(model: ModelSpec, strategy: Strategy) -> TrialSpec:
    return TrialSpec(
        name=strategy.name,
        strategy=strategy,
        model=model,
        data=DATA,
        measure=MeasureSpec(max_steps=4, warmup_steps=1),
    )


# -- real trials on CPU --------------------------------------------------------------------------------------------


def test_lora_trial_trains_the_adapters_only_and_is_verified():
    outcome = run_trial(spec_for(BERT, lora_strategy()))

    assert outcome.status == "ok", outcome.mismatches  # the existing checks (sharding, dtype, ...) still pass
    rec = outcome.verification
    assert rec.params_trainable == BERT_ADAPTER_PARAMS == rec.params_adapter
    assert rec.params_trainable < rec.params_total
    assert rec.lora_layers == 4 and rec.lora_target_modules == ["query", "value"]
    assert rec.quantized_4bit_layers == 0
    assert len(outcome.loss_curve) == 4 and all(math.isfinite(x) for x in outcome.loss_curve)


def test_qlora_trial_on_cpu_keeps_the_base_in_4_bits_and_counts_its_flops_unpacked(tmp_path):
    """bf16 QLoRA: the 4-bit layers cast their output back to the input's dtype, so the precision check must observe
    an adapter's Linear (bf16 under autocast), and FLOPs must count the base at its unquantised shape."""
    strategy = lora_strategy(quantize_base="4bit").replace(precision="bf16")
    outcome = run_trial(spec_for(LLAMA, strategy))

    assert outcome.status == "ok", outcome.mismatches
    rec = outcome.verification
    assert rec.quantized_4bit_layers == 2 * 7  # q, k, v, o, gate, up, down per layer; lm_head kept
    assert rec.params_trainable == LLAMA_ADAPTER_PARAMS == rec.params_adapter
    assert rec.lora_target_modules == ["q_proj", "v_proj"]
    assert rec.linear_output_dtype == "bfloat16"
    # The expectation is torch's FLOP counter on the same LoRA Llama unquantised (4 bits are dequantised for each
    # matmul, so the work is the unquantised shape's). Packed counting read 667,008 per token; the formula without
    # the gradient flow it observes (frozen layer-0 projections with no backward) read 612,096, 1.05x the count.
    import transformers

    transformers.set_seed(0)
    unquantised = apply_lora(build_model(LLAMA, DATA), spec_for(LLAMA, lora_strategy()), scratch_dir=tmp_path)
    unquantised.set_attn_implementation("eager")  # the counter sees eager attention's matmuls, not CPU SDPA's kernel
    counted = counted_flops_per_token(unquantised, batch=4, seq_len=DATA.seq_len)
    # Within 1%: the RMSNorm weights in N (320 of ~140k parameters) do no matmul.
    assert outcome.throughput.flops_per_token == pytest.approx(counted, rel=0.01)


# -- verification: a fallback is caught ----------------------------------------------------------------------------


def _record(**changes: object) -> VerificationRecord:
    fields: dict[str, object] = dict(
        distributed_type="NO",
        world_size=1,
        device="cpu",
        mixed_precision="no",
        wrapper="none",
        wrapper_class="peft.peft_model.PeftModelForSequenceClassification",
        params_total=BERT_PEFT_TOTAL,
        linear_layer="query.base_layer",
        linear_output_dtype="float32",
        global_batch_size=4,
        params_trainable=BERT_ADAPTER_PARAMS,
        params_adapter=BERT_ADAPTER_PARAMS,
        lora_layers=4,
        lora_target_modules=["query", "value"],
        quantized_4bit_layers=0,
    )
    return VerificationRecord(**(fields | changes))


def lora_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    return [m for m in check(strategy, rec) if "optimizer" not in m]


def test_a_record_that_matches_lora_has_no_lora_mismatch():
    assert lora_problems(lora_strategy(), _record()) == []


def test_full_training_under_a_lora_strategy_is_caught():
    """The silent fallback: every parameter trainable (peft never wrapped the model, or the base was unfrozen)."""
    fell_back = _record(params_trainable=BERT_PEFT_TOTAL, params_adapter=0, lora_layers=0, lora_target_modules=[])
    problems = lora_problems(lora_strategy(), fell_back)
    assert any("every parameter is trainable (2,059,844 of 2,059,844): full training ran" in p for p in problems)
    assert any("no LoRA adapter layer" in p for p in problems)


def test_an_unfrozen_part_of_the_base_is_caught():
    problems = lora_problems(lora_strategy(), _record(params_trainable=BERT_ADAPTER_PARAMS + 4096))
    assert any("but the adapters hold 2,178: part of the base model is not frozen" in p for p in problems)


def test_adapters_on_other_modules_and_a_missing_4bit_base_are_caught():
    asked = lora_strategy(target_modules=("query", "key"), quantize_base="4bit")
    problems = lora_problems(asked, _record())
    assert any("sit on query, value, lora.target_modules names key, query" in p for p in problems)
    assert any("quantize_base='4bit' did not take effect" in p for p in problems)


def test_adapters_without_a_lora_strategy_are_caught():
    plain = Strategy(name="fp32", device="cpu", per_device_batch_size=4)
    problems = lora_problems(plain, _record(quantized_4bit_layers=3))
    assert any("4 LoRA adapter layer(s) trained, but strategy.lora is unset" in p for p in problems)
    assert any("3 Linear layer(s) ran in 4 bits" in p for p in problems)


# -- targets, FLOPs, estimate, config ------------------------------------------------------------------------------


def test_peft_has_default_targets_for_bert_and_llama_and_others_are_refused_by_field():
    assert default_target_modules("bert") == ("query", "value")
    assert default_target_modules("llama") == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match=r"lora.target_modules is unset and peft has no default .* 'no-such-model'"):
        lora_config_kwargs(LoraSpec(), task="causal_lm", model_type="no-such-model")


def test_flops_count_4bit_weights_at_their_unquantised_shape_and_frozen_weights_without_weight_gradients(tmp_path):
    import transformers

    transformers.set_seed(0)
    plain = build_model(LLAMA, DATA)
    unquantised = matmul_parameters(plain)
    assert unquantised == LLAMA_LINEAR_PARAMS + LLAMA_HEAD + LLAMA_NORMS
    qlora = apply_lora(plain, spec_for(LLAMA, lora_strategy(quantize_base="4bit")), scratch_dir=tmp_path)
    # bitsandbytes stores two NF4 weights per uint8 element: counting the stored tensors reads the Linear half.
    stored = sum(p.numel() for n, p in qlora.named_parameters() if "embed_tokens" not in n)
    assert stored == LLAMA_LINEAR_PARAMS // 2 + LLAMA_HEAD + LLAMA_NORMS + LLAMA_ADAPTER_PARAMS
    assert matmul_parameters(qlora) == unquantised + LLAMA_ADAPTER_PARAMS
    assert matmul_parameters(qlora, frozen_only=True) == unquantised

    # 6 per trainable parameter, 4 per frozen one (input gradient only), 2 fewer for each whose input needs no
    # gradient, and 2 H T fewer per skipped backward matmul of attention.
    flow = GradientFlow(no_input_grad_params=300, skipped_attention_matmuls=3)
    assert (
        transformer_flops_per_token(
            non_embedding_params=1000, num_layers=2, attention_width=8, seq_len=4, frozen_params=900, flow=flow
        )
        == 6 * 100 + 4 * 900 - 2 * 300 + (12 * 2 - 2 * 3) * 8 * 4
    )
    with pytest.raises(ValueError, match="frozen_params"):
        transformer_flops_per_token(
            non_embedding_params=10, num_layers=1, attention_width=1, seq_len=1, frozen_params=11
        )
    with pytest.raises(ValueError, match=r"flow\.skipped_attention_matmuls"):
        transformer_flops_per_token(
            non_embedding_params=10,
            num_layers=1,
            attention_width=1,
            seq_len=1,
            flow=GradientFlow(skipped_attention_matmuls=5),
        )


def _peft_llama(layers: int, targets: object):
    import peft
    import transformers

    transformers.set_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))


@pytest.mark.parametrize(
    ("layers", "targets", "static_ratio"),
    [
        (2, ["q_proj", "v_proj"], 1.061),
        (8, ["q_proj", "v_proj"], 1.018),
        (2, "all-linear", 1.039),
        (2, ["gate_proj"], 1.244),
    ],
    ids=["qv-2-layers", "qv-8-layers", "all-linear", "mlp-only"],
)
def test_lora_flops_match_torch_flop_counter(layers, targets, static_ratio):
    """The expectation is torch's FLOP counter on a real peft model's forward and backward. With the embeddings
    frozen, nothing upstream of the first adapter needs a gradient: layer 0's frozen projections do no backward,
    an adapter's A matrix computes its weight gradient only, and attention skips the gradients of Q, K or V that
    no adapter feeds. ``6 N - 2 N_frozen`` alone overcounts by the measured ``static_ratio``; with the gradient
    flow the probe reads, the formula is the count within 1% (RMSNorm weights in N do no matmul: 0.3%)."""
    model = _peft_llama(layers, targets)
    probe = GradientFlowProbe(model)
    counted = counted_flops_per_token(model, batch=2, seq_len=64)
    assert probe.flow is not None and probe.flow.no_input_grad_params > 0
    assert model_flops_per_token(model, 64, probe.flow) == pytest.approx(counted, rel=0.01)
    assert model_flops_per_token(model, 64) / counted == pytest.approx(static_ratio, abs=0.002)


def test_estimate_counts_gradients_and_optimizer_states_for_the_adapters_only():
    full = estimate_memory(BERT, Strategy(name="fp32", device="cpu", optimizer="adamw_torch"), seq_len=32, data=DATA)
    lora = estimate_memory(BERT, lora_strategy().replace(optimizer="adamw_torch"), seq_len=32, data=DATA)
    n = full.num_params
    assert full.gradients_gib * GIB == pytest.approx(4 * n)
    # The same trainable count the trial measured: 4 bytes of gradient, 8 of AdamW state (exp_avg, exp_avg_sq)
    # per trainable element, and a 4-byte step per trainable tensor on CPU (4 LoRA modules x A, B + classifier
    # weight and bias = 10 tensors). Weights: the whole base plus the adapters.
    assert lora.gradients_gib * GIB == pytest.approx(4 * BERT_ADAPTER_PARAMS)
    assert lora.optimizer_gib * GIB == pytest.approx(8 * BERT_ADAPTER_PARAMS + 4 * 10)
    assert lora.weights_gib * GIB == pytest.approx(4 * n + 4 * BERT_ADAPTER_PARAMS)
    # Under a sharding engine LoRA's states are not modelled, and the estimate says so.
    zero2 = lora_strategy().replace(deepspeed=DeepSpeedSpec(zero_stage=2))
    assert SHARDED_LORA_NOTE in estimate_memory(BERT, zero2, seq_len=32, data=DATA).notes


def test_estimate_stores_the_qlora_base_at_half_a_byte_plus_its_scales():
    qlora = estimate_memory(LLAMA, lora_strategy(quantize_base="4bit"), seq_len=32, data=DATA)
    # 73,728 Linear elements at 0.5 byte plus one fp32 absmax per 64; embedding (1000 x 64), lm_head and norms fp32;
    # adapters fp32 beside them.
    base = LLAMA_LINEAR_PARAMS / 2 + 4 * LLAMA_LINEAR_PARAMS / 64 + 4 * (1000 * 64 + LLAMA_HEAD + LLAMA_NORMS)
    assert qlora.weights_gib * GIB == pytest.approx(base + 4 * LLAMA_ADAPTER_PARAMS)
    assert qlora.gradients_gib * GIB == pytest.approx(4 * LLAMA_ADAPTER_PARAMS)
    assert any("NF4" in note for note in qlora.notes)


def test_hfscale_config_prints_the_lora_and_bitsandbytes_keywords(tmp_path, capsys):
    lora = ["--lora-rank", "8", "--lora-target", "q_proj", "v_proj"]
    argv = ["--out", str(tmp_path), "--device", "cpu", "--bf16", *lora]
    assert config_main([*argv, "--qlora"]) == 0
    out = capsys.readouterr().out
    assert "LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=['q_proj', 'v_proj']" in out
    assert (
        "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.bfloat16" in out
    )
    # strategy.json carries it, so VerificationCallback(config_dir) in the user's script checks the adapters.
    from hfscale.configs import read_strategy

    asked = LoraSpec(rank=8, alpha=16, target_modules=("q_proj", "v_proj"), quantize_base="4bit")
    assert read_strategy(tmp_path).lora == asked
    assert config_main(["--out", str(tmp_path / "x"), "--qlora"]) == 2
    assert "--lora-dropout and --qlora configure LoRA: add --lora-rank" in capsys.readouterr().err


def test_a_recipe_with_lora_on_a_model_without_peft_defaults_names_lora_target_modules(tmp_path):
    from hfscale.recipes.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(
        "name: r\nmodel: {type: mpnet, config: {vocab_size: 1000, hidden_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 2, intermediate_size: 128}}\ndata: {token_high: 1000}\n"
        "trials: [{name: lora, lora: {rank: 4}}]\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match=r"lora\.target_modules.*peft has no default target modules .*'mpnet'"):
        load_recipe(path)
    path.write_text(path.read_text(encoding="utf-8").replace("rank: 4", "rank: 4, target_modules: [q, v]"))
    assert load_recipe(path).trials[0].spec.strategy.lora.target_modules == ("q", "v")


@pytest.mark.gpu
def test_qlora_trial_on_cuda_keeps_the_base_in_4_bits_on_the_device():
    """The CUDA path: the 4-bit base is loaded onto this rank's device (``device_map``), bitsandbytes' CUDA kernels
    run, and bf16 autocast shows in the adapters' output."""
    strategy = Strategy(
        name="qlora",
        device="cuda",
        precision="bf16",
        per_device_batch_size=4,
        lora=LoraSpec(rank=4, alpha=8, quantize_base="4bit"),
    )
    outcome = run_trial(spec_for(LLAMA, strategy))

    assert outcome.status == "ok", outcome.mismatches
    rec = outcome.verification
    assert rec.device == "cuda"
    assert rec.quantized_4bit_layers == 2 * 7
    assert rec.params_trainable == LLAMA_ADAPTER_PARAMS == rec.params_adapter
    assert rec.linear_output_dtype == "bfloat16"
    assert outcome.memory.peak_gib > 0


@pytest.mark.parametrize(
    "model",
    [
        BERT,
        ModelSpec(type="gpt2", task="causal_lm", config=dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=2)),
        ModelSpec(type="gpt2", config=dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=2)),
        LLAMA,
    ],
    ids=["bert-cls", "gpt2-lm", "gpt2-cls", "llama-lm"],
)
def test_the_estimate_trains_what_peft_trains(model):
    """The estimate's adapters (read from the meta-device shapes) are the parameters peft makes trainable, for
    nn.Linear targets, GPT-2's Conv1D (c_attn, stored in x out) and a classifier head copy."""
    from hfscale.estimate import describe_model
    from hfscale.estimate.lora import trainable_shape

    strategy = lora_strategy()
    peft_model = apply_lora(build_model(model, DATA), spec_for(model, strategy), scratch_dir="unused")
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable_shape(describe_model(model, DATA), strategy).num_params == trainable
