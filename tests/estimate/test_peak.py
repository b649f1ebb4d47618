"""hfscale.estimate.peak: the parts added into the peak, the overlap of gradients with activations, and (on a GPU)
torch's peak against the total.

The overlap is checked against the allocator, not against the estimate's own formula: on CPU every tensor is a
malloc, so sampling glibc's in-use bytes after the forward pass and as each gradient lands during the backward
pass gives the real peak of forward + backward; the forward-pass bytes F plus the gradient bytes G, less that peak,
is the part of the two that was never held at once.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from helpers.models import SMALL_BERT, TINY_BERT

from hfscale.core.units import GIB
from hfscale.estimate import MemoryEstimate, estimate_memory, model_shape_from_module
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy
from hfscale.workload.spec import ModelSpec


def _plain_sum(est: MemoryEstimate) -> float:
    return est.weights_gib + est.gradients_gib + est.optimizer_gib + est.activations_gib + est.overhead_gib


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


def test_gradients_overlap_activations_only_with_one_micro_batch():
    """Accumulation, DeepSpeed and FSDP keep gradients through the forward pass: the total is the plain sum."""
    model = ModelSpec(type="bert", config=TINY_BERT)
    base = Strategy(device="cuda", per_device_batch_size=16, precision="bf16", optimizer="adamw_torch")
    one = estimate_memory(model, base, seq_len=512)
    acc = estimate_memory(model, base.replace(gradient_accumulation_steps=4), seq_len=512)
    zero2 = estimate_memory(model, base.replace(deepspeed=DeepSpeedSpec(zero_stage=2)), seq_len=512)
    fsdp = estimate_memory(model, base.replace(num_processes=2, fsdp=FsdpSpec()), seq_len=512)

    for est in (acc, zero2, fsdp):
        assert est.overlap_gib == 0 and est.total_gib == pytest.approx(_plain_sum(est), rel=1e-12)
    # one micro-batch: the same parts as with accumulation (only when gradients live differs), less an overlap
    for part in ("weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "overhead_gib"):
        assert getattr(one, part) == getattr(acc, part)
    assert 0 < one.overlap_gib <= one.gradients_gib
    assert one.total_gib == pytest.approx(_plain_sum(one) - one.overlap_gib, rel=1e-12)
    assert any("overlap subtracted" in note for note in one.notes)

    # the step's temporaries (foreach AdamW: 4N) outgrow a tiny forward pass: nothing overlaps, the sum again
    tiny = estimate_memory(model, base.replace(per_device_batch_size=1), seq_len=8)
    assert "optimizer_step" in tiny.overhead_parts_gib
    assert tiny.overlap_gib == 0 and tiny.total_gib == pytest.approx(_plain_sum(tiny), rel=1e-12)


def _measured_forward_backward(in_use, model, *, batch: int, seq_len: int, keep_gradients: bool) -> dict[str, int]:
    """F (bytes the forward pass leaves allocated), G (gradient bytes) and the peak of forward + backward, each
    above what the model held with ``.grad`` unset; with ``keep_gradients`` the gradients of a previous micro-batch
    are held through the pass, as under gradient accumulation."""
    samples: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _: samples.append(in_use())) for p in model.parameters()]
    ids = torch.randint(100, 1000, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(batch, dtype=torch.long)
    try:
        result: dict[str, int] = {}
        for _ in range(2):  # the first pass allocates one-time state
            model.zero_grad(set_to_none=True)
            gc.collect()
            base = in_use()
            if keep_gradients:
                model(input_ids=ids, labels=labels).loss.backward()
                gc.collect()
            held = in_use()
            samples.clear()
            out = model(input_ids=ids, labels=labels)
            after_forward = in_use()
            out.loss.backward()
            del out
            grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
            result = {"F": after_forward - held, "G": grads, "peak": max(after_forward, *samples) - base}
    finally:
        for hook in hooks:
            hook.remove()
    return result


@pytest.mark.parametrize(
    ("batch", "seq_len", "attention_dropout", "bound"),
    [(8, 128, 0.1, "activations"), (1, 64, 0.0, "gradients")],
    ids=["activation-bound", "gradient-bound"],
)
def test_overlap_matches_the_allocator(malloc_in_use, batch, seq_len, attention_dropout, bound):
    """One micro-batch: the peak of forward + backward is below F + G by what the estimate calls the overlap."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**SMALL_BERT, attention_probs_dropout_prob=attention_dropout))
    model.train()
    m = _measured_forward_backward(malloc_in_use, model, batch=batch, seq_len=seq_len, keep_gradients=False)
    measured_overlap = m["F"] + m["G"] - m["peak"]
    # SGD without momentum: no optimizer state, no step temporaries, so forward + backward holds the peak
    strategy = Strategy(device="cpu", optimizer="sgd", per_device_batch_size=batch)
    est = estimate_memory(model_shape_from_module(model), strategy, seq_len=seq_len)

    if bound == "activations":  # the gradients are created while larger activations are freed: all of G overlaps
        assert m["F"] > m["G"] and measured_overlap == pytest.approx(m["G"], rel=0.10)
    else:  # the gradients outgrow the activations: the peak is at the end of backward, about G
        assert m["F"] < m["G"] and measured_overlap < 0.9 * m["G"]
    assert est.overlap_gib * GIB == pytest.approx(measured_overlap, rel=0.10), (m, est.overlap_gib * GIB)


def test_no_overlap_while_gradients_are_kept(malloc_in_use):
    """Under accumulation the previous micro-batch's gradients are held: the peak is the plain sum F + G."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**SMALL_BERT))
    model.train()
    m = _measured_forward_backward(malloc_in_use, model, batch=8, seq_len=128, keep_gradients=True)
    assert m["peak"] >= 0.98 * (m["F"] + m["G"]), m
    strategy = Strategy(device="cpu", optimizer="sgd", per_device_batch_size=8, gradient_accumulation_steps=4)
    assert estimate_memory(model_shape_from_module(model), strategy, seq_len=128).overlap_gib == 0


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
