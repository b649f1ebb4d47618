"""The memory estimate against what the tensors really hold.

Model states: a real Trainer step on CPU under several strategies, with the bytes of parameters, ``.grad`` and
``optimizer.state`` summed tensor by tensor at ``on_optimizer_step`` (before ``zero_grad``). Activations: the bytes
glibc's allocator holds after a forward pass (``mallinfo2``: every CPU tensor is a malloc), against the estimate's
CPU inventory, and how they scale with batch and sequence length. GPU: torch's peak against the total.
"""

from __future__ import annotations

import ctypes
import gc
import math
import re

import pytest
import torch

from hfscale.estimate import (
    CUDA_CONTEXT_BYTES,
    GIB,
    MemoryEstimate,
    activation_bytes,
    describe_model,
    estimate_memory,
    main,
    model_shape_from_module,
    optimizer_state_bytes,
    predict_fit,
    predicted_to_fit,
)
from hfscale.memory import parse_memory_size
from hfscale.spec import DataSpec, ModelSpec, TrialSpec
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy

TINY_BERT = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)

SMALL_BERT = dict(
    vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
    max_position_embeddings=512,
)  # fmt: skip
_IN_BLOCK = re.compile(r"\.(layer|h)\.\d+\.")
SMALL_GPT2 = dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=2, n_positions=512)


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def _unique_bytes(tensors) -> int:
    """Bytes of distinct storages (shared tensors such as bitsandbytes' quantisation maps count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _train_one_step(model, strategy: Strategy, tmp_path, *, seq_len: int = 16, training_args: dict | None = None):
    """Run one real Trainer optimizer step on CPU; return the measured bytes and the estimate."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    measured: dict[str, int] = {}

    class Measure(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            model_, opt = kwargs["model"], kwargs["optimizer"]
            states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            measured["weights"] = _unique_bytes(model_.parameters())
            measured["gradients"] = _unique_bytes(p.grad for p in model_.parameters() if p.grad is not None)
            measured["optimizer"] = _unique_bytes(states)
            measured["weight_dtypes"] = {str(p.dtype) for p in model_.parameters()}
            measured["state_dtypes"] = {str(v.dtype) for v in states}

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (8, seq_len), generator=g)
    data = [{"input_ids": ids[k], "labels": torch.tensor(k % 2)} for k in range(8)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=strategy.per_device_batch_size,
        optim=strategy.optimizer,
        bf16=strategy.precision == "bf16",
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        dataloader_pin_memory=False,
        **(training_args or {}),
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Measure()]).train()
    estimate = estimate_memory(
        model_shape_from_module(model), strategy, seq_len=seq_len, training_args=training_args or {}
    )
    return measured, estimate


# ---------------------------------------------------------------------------------------------------------------
# model states: measured tensor by tensor after a real optimizer step
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "optimizer", "training_args"),
    [
        ("fp32", "adamw_torch", None),
        ("bf16", "adamw_torch", None),
        ("fp32", "adafactor", None),
        ("fp32", "sgd", None),
        ("fp32", "sgd", {"optim_args": "momentum=0.9"}),
        pytest.param("fp32", "adamw_bnb_8bit", None, marks=pytest.mark.bnb),
    ],
    ids=["fp32-adamw", "bf16-adamw", "adafactor", "sgd", "sgd-momentum", "adamw-8bit"],
)
def test_model_states_match_the_tensors(tmp_path, tiny_bert, precision, optimizer, training_args):
    if optimizer == "adamw_bnb_8bit":
        pytest.importorskip("bitsandbytes")
    strategy = Strategy(device="cpu", precision=precision, optimizer=optimizer, per_device_batch_size=4)
    measured, est = _train_one_step(tiny_bert, strategy, tmp_path, training_args=training_args)

    # what the estimate assumes about the run, checked on the run itself
    assert measured["weight_dtypes"] == {"torch.float32"}, "the Trainer keeps fp32 weights under bf16 autocast"
    for part in ("weights", "gradients", "optimizer"):
        predicted = round(getattr(est, f"{part}_gib") * GIB)
        assert predicted == measured[part], f"{part}: estimated {predicted} bytes, measured {measured[part]}"
    if optimizer == "adamw_bnb_8bit":
        assert "torch.uint8" in measured["state_dtypes"]
        # the Trainer keeps embeddings in 32-bit states: 8-bit saves far less than 8 -> 2 bytes here
        assert measured["optimizer"] > 2 * est.num_params
    if optimizer == "sgd" and not training_args:
        assert measured["optimizer"] == 0


def test_meta_build_counts_the_real_model(tiny_bert):
    shape = describe_model(ModelSpec(type="bert", config=TINY_BERT))
    real = model_shape_from_module(tiny_bert)
    assert shape.num_params == sum(p.numel() for p in tiny_bert.parameters())
    assert shape.params == real.params
    assert shape.largest_layer_params == tiny_bert.bert.embeddings.word_embeddings.weight.numel()
    assert shape.num_blocks == 2 and shape.block_params == sum(
        p.numel() for p in tiny_bert.bert.encoder.layer[0].parameters()
    )


def test_gpt2_tied_head_is_counted_once(tiny_gpt2):
    shape = model_shape_from_module(tiny_gpt2)
    assert shape.num_params == sum(p.numel() for p in tiny_gpt2.parameters())
    wte = next(p for p in shape.params if p.name.endswith("wte.weight"))
    assert wte.in_embedding and wte.in_matmul  # tied with the LM head: autocast casts it, bnb keeps it 32-bit


# ---------------------------------------------------------------------------------------------------------------
# activations: bytes glibc holds after the forward pass
# ---------------------------------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )
    ]  # fmt: skip


def _malloc_in_use():
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    fn.restype = _MallInfo2

    def in_use() -> int:
        info = fn()
        return info.uordblks + info.hblkhd

    return in_use


def _forward_retained_bytes(model, *, batch: int, seq_len: int, precision: str, task: str) -> int:
    """Bytes still allocated after a training-mode forward pass, the output's logits excluded."""
    in_use = _malloc_in_use()
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


def _small(kind: str, *, checkpointing: bool = False, **overrides):
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
def test_activations_match_the_allocator(kind, precision, checkpointing):
    model = _small(kind, checkpointing=checkpointing)
    task = "causal_lm" if kind == "gpt2" else "classification"
    measured = _forward_retained_bytes(model, batch=8, seq_len=128, precision=precision, task=task)
    predicted = _predicted_forward_bytes(model, batch=8, seq_len=128, precision=precision, checkpointing=checkpointing)
    assert predicted == pytest.approx(measured, rel=0.10), f"predicted {predicted} bytes, measured {measured}"


def test_activations_are_linear_in_batch():
    model = _small("bert")
    m4 = _forward_retained_bytes(model, batch=4, seq_len=128, precision="fp32", task="classification")
    m8 = _forward_retained_bytes(model, batch=8, seq_len=128, precision="fp32", task="classification")
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
def test_activations_in_sequence_length(attention_dropout):
    """With attention dropout the CPU runs SDPA's math path and keeps s² scores; without, its flash kernel."""
    model = _small("bert", attention_probs_dropout_prob=attention_dropout)
    lengths = (64, 128, 256)
    measured = [
        _forward_retained_bytes(model, batch=4, seq_len=s, precision="fp32", task="classification") for s in lengths
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


# ---------------------------------------------------------------------------------------------------------------
# formulas against their sources, budgets, CLI
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.deepspeed
@pytest.mark.parametrize("num_gpus", [1, 2, 8])
def test_zero_model_states_match_deepspeed_estimators(num_gpus):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = describe_model(
        ModelSpec(type="bert", config={"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4})
    )
    n, largest = shape.num_params, shape.largest_layer_params

    def states(ds: DeepSpeedSpec) -> float:
        est = estimate_memory(shape, Strategy(precision="bf16", deepspeed=ds, num_processes=num_gpus), seq_len=128)
        gathered = est.overhead_parts_gib.get("gathered_params", 0.0)
        return (est.weights_gib + est.gradients_gib + est.optimizer_gib + gathered) * GIB

    z2, z3 = estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs
    cases = [
        (DeepSpeedSpec(zero_stage=2), z2(n, num_gpus, 1, cpu_offload=False)[1]),
        (DeepSpeedSpec(zero_stage=2, offload_optimizer="cpu"), z2(n, num_gpus, 1, cpu_offload=True)[1]),
        (DeepSpeedSpec(zero_stage=3), z3(n, largest, num_gpus, 1, cpu_offload=False)[1]),
        (
            DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu"),
            z3(n, largest, num_gpus, 1, cpu_offload=True, cpu_offload_params=False)[1],
        ),
        (
            DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
            z3(n, largest, num_gpus, 1, cpu_offload=True, cpu_offload_params=True)[1],
        ),
    ]
    for ds, expected in cases:
        assert states(ds) == pytest.approx(expected, abs=1), ds


def test_sharding_divides_model_states():
    shape = describe_model(
        ModelSpec(type="bert", config={"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4})
    )
    single = estimate_memory(shape, Strategy(precision="bf16"), seq_len=128)
    ddp = estimate_memory(shape, Strategy(precision="bf16", num_processes=4), seq_len=128)
    fsdp = estimate_memory(shape, Strategy(precision="bf16", num_processes=4, fsdp=FsdpSpec()), seq_len=128)
    assert ddp.overhead_parts_gib["ddp_buckets"] == pytest.approx(single.gradients_gib)
    assert fsdp.optimizer_gib == pytest.approx(single.optimizer_gib / 4)
    assert fsdp.weights_gib == pytest.approx(single.weights_gib / 4)
    assert fsdp.activations_gib == pytest.approx(single.activations_gib)


def test_optimizer_state_bytes_rejects_unknown():
    shape = describe_model(
        ModelSpec(type="bert", config={"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2})
    )
    with pytest.raises(ValueError, match="no memory model"):
        optimizer_state_bytes(shape, "lion")


def test_memory_budget_strings():
    assert parse_memory_size("80GiB") == 80 * GIB
    assert parse_memory_size("16GB") == 16 * 10**9
    assert parse_memory_size("512 MiB") == 512 * 1024**2
    with pytest.raises(ValueError, match="expected a number and a unit"):
        parse_memory_size("1024")
    with pytest.raises(ValueError, match="expected a number and a unit"):
        parse_memory_size("lots")


def test_predicted_to_fit_counts_the_cuda_context():
    est = MemoryEstimate(
        weights_gib=1, gradients_gib=1, optimizer_gib=2, activations_gib=1, overhead_gib=0, total_gib=5
    )
    assert predicted_to_fit(est, 5 * GIB + CUDA_CONTEXT_BYTES)
    assert not predicted_to_fit(est, 5 * GIB)
    assert predicted_to_fit(est, 5 * GIB, reserve_bytes=0)


def test_predict_fit_gives_a_skip_reason():
    spec = TrialSpec(
        name="big",
        strategy=Strategy(per_device_batch_size=64),
        model=ModelSpec(type="bert", config={"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}),
        data=DataSpec(seq_len=512),
    )
    small = predict_fit(spec, 80 * GIB)
    tight = predict_fit(spec, GIB)
    assert small.fits and small.reason is None
    assert not tight.fits
    assert f"{tight.estimate.total_gib:.2f} GiB" in tight.reason and "budget 1.00 GiB" in tight.reason
    assert set(tight.estimate.to_dict()) >= {
        "weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "overhead_gib", "total_gib"
    }  # fmt: skip


def test_estimate_scales_with_batch_and_checkpointing_saves():
    model = ModelSpec(type="gpt2", task="causal_lm", config={"n_embd": 128, "n_layer": 4, "n_head": 4})
    est = {
        (b, ck): estimate_memory(model, Strategy(per_device_batch_size=b, gradient_checkpointing=ck), seq_len=256)
        for b in (4, 8)
        for ck in (False, True)
    }
    assert est[8, False].activations_gib == pytest.approx(2 * est[4, False].activations_gib, rel=1e-6)
    ckpt, plain = est[8, True].activation_parts, est[8, False].activation_parts
    assert ckpt["layers_kept_bytes"] + ckpt["recompute_bytes"] < plain["layers_kept_bytes"] / 2
    assert ckpt["outside_layers_bytes"] == plain["outside_layers_bytes"]
    assert est[8, False].weights_gib == est[4, False].weights_gib


def _plain_sum(est: MemoryEstimate) -> float:
    return est.weights_gib + est.gradients_gib + est.optimizer_gib + est.activations_gib + est.overhead_gib


def test_gradients_overlap_activations_only_with_one_micro_batch():
    """One micro-batch: peak = weights + optimizer + max(forward, gradients + step); else the plain sum."""
    model = ModelSpec(type="bert", config=TINY_BERT)
    base = Strategy(device="cuda", per_device_batch_size=16, precision="bf16")
    one = estimate_memory(model, base, seq_len=512)
    acc = estimate_memory(model, base.replace(gradient_accumulation_steps=4), seq_len=512)
    zero2 = estimate_memory(model, base.replace(deepspeed=DeepSpeedSpec(zero_stage=2)), seq_len=512)
    fsdp = estimate_memory(model, base.replace(num_processes=2, fsdp=FsdpSpec()), seq_len=512)

    # accumulation, DeepSpeed and FSDP keep the gradients through the forward pass: the total is the plain sum
    for est in (acc, zero2, fsdp):
        assert est.overlap_gib == 0 and est.total_gib == pytest.approx(_plain_sum(est), rel=1e-12)
    # one micro-batch: the same parts as with accumulation (only when gradients live differs) ...
    for part in ("weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "overhead_gib"):
        assert getattr(one, part) == getattr(acc, part)
    # ... less the overlap: min(gradients, what the forward pass holds - the step's temporaries)
    parts = one.overhead_parts_gib
    forward = one.activations_gib + parts.get("autocast_weight_copies", 0) + parts.get("loss_buffers", 0)
    step = 4 * one.num_params / GIB  # foreach AdamW on CUDA: one exp_avg_sq.sqrt() for every parameter
    always = one.overhead_gib - parts.get("autocast_weight_copies", 0) - parts.get("loss_buffers", 0)
    always -= parts.get("optimizer_step", 0)  # what is held throughout: the cuBLAS workspaces here
    assert forward > one.gradients_gib + step  # this shape is activation-bound: the whole gradient overlaps
    assert one.overlap_gib == pytest.approx(min(one.gradients_gib, forward - step), rel=1e-9)
    assert one.total_gib == pytest.approx(_plain_sum(one) - one.overlap_gib, rel=1e-12)
    assert one.total_gib == pytest.approx(
        one.weights_gib + one.optimizer_gib + max(forward, one.gradients_gib + step) + always, rel=1e-9
    )

    # the step's temporaries (foreach AdamW: 4N) outgrow a tiny forward pass: nothing overlaps, the sum again
    tiny = estimate_memory(model, base.replace(per_device_batch_size=1), seq_len=8)
    assert "optimizer_step" in tiny.overhead_parts_gib
    assert tiny.overlap_gib == 0 and tiny.total_gib == pytest.approx(_plain_sum(tiny), rel=1e-12)


def test_cli_table(capsys):
    model = ["--config", "hidden_size=128", "--config", "num_hidden_layers=2", "--config", "num_attention_heads=2"]
    code = main(["bert", *model, "--seq-len", "128", "--batch-size", "4", "--memory-budget", "2GiB"])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("fp32", "bf16-ckpt", "bf16-adam8bit", "bf16-zero3-offload"):
        assert f"\n{name} " in out
    assert "budget 2.00 GiB" in out


def test_cli_json_and_recipe(tmp_path, capsys):
    import json

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "device: cpu\n"
        "model: {type: bert, config: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2}}\n"
        "data: {seq_len: 64}\n"
        "trials:\n  - name: fp32\n  - {name: ckpt, gradient_checkpointing: true}\n",
        encoding="utf-8",
    )
    assert main([str(recipe), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["trial"] for r in rows] == ["fp32", "ckpt"]
    assert rows[1]["estimate"]["activations_gib"] < rows[0]["estimate"]["activations_gib"]


def test_cli_reports_errors(capsys):
    assert main(["no-such-model-type"]) == 2
    assert "hfscale estimate:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bert", "--num-gpus", "0"], "argument --num-gpus: expected a positive integer"),
        (["bert", "--seq-len", "-1"], "argument --seq-len: expected a positive integer"),
        (["bert", "--config", "hidden_size"], "argument --config: --config expects key=value"),
        (["bert", "--config", "hidden_size=-5"], "check --config"),
        (["bert", "--config", "hidden_size=abc"], "check --config"),
    ],
)
def test_cli_rejects_bad_arguments_without_a_traceback(argv, expected, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_cli_header_says_the_cuda_context_is_assumed(capsys):
    model = ["--config", "hidden_size=64", "--config", "num_hidden_layers=2", "--config", "num_attention_heads=2"]
    assert main(["bert", *model, "--seq-len", "32", "--memory-budget", "2GiB"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert f"+ {CUDA_CONTEXT_BYTES / GIB:.2f} GiB CUDA context" in header and "assumed, not measured" in header


# ---------------------------------------------------------------------------------------------------------------
# GPU: torch's peak against the total
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_peak_within_ten_percent(tmp_path, precision):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    config = dict(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    batch, seq_len = 32, 256
    peaks: list[int] = []

    class Peak(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**config))
    ids = torch.randint(100, 30000, (batch * 4, seq_len))
    data = [{"input_ids": ids[k], "labels": torch.tensor(k % 2)} for k in range(batch * 4)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=batch, bf16=precision == "bf16",
        report_to="none", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Peak()]).train()
    measured = max(peaks[1:])  # steady state: optimizer states exist
    est = estimate_memory(
        ModelSpec(type="bert", config=config),
        Strategy(precision=precision, per_device_batch_size=batch),
        seq_len=seq_len,
    )
    assert est.total_bytes == pytest.approx(measured, rel=0.10), (est.to_dict(), measured)
    assert math.isfinite(est.total_gib)
