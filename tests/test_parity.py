"""Loss parity: the check on synthetic curves, and on curves of real tiny Trainer runs."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hfscale.parity import annotate_rows, check_parity, smooth
from hfscale.results import TrialResult
from hfscale.strategy import Strategy

FLAT = [0.69 + 0.01 * math.sin(i) for i in range(30)]


def test_identical_and_slightly_noisy_curves_pass():
    assert not check_parity(FLAT, FLAT).flagged
    noisy = [x * (1 + 0.03 * (-1) ** i) for i, x in enumerate(FLAT)]
    result = check_parity(FLAT, noisy)
    assert not result.flagged and result.compared
    assert result.max_rel_deviation < 0.03  # smoothing averages the alternating noise out


def test_divergence_is_flagged_at_its_step():
    broken = FLAT[:10] + [x * 3 for x in FLAT[10:]]
    result = check_parity(FLAT, broken)
    assert result.flagged
    assert "step" in result.reason
    assert 8 <= result.worst_step <= 30
    assert result.max_rel_deviation > 1.0


def test_non_finite_loss_is_flagged():
    result = check_parity(FLAT, [*FLAT[:5], float("nan"), *FLAT[6:]])
    assert result.flagged and result.reason == "loss is nan at step 6"
    assert result.to_dict()["max_rel_deviation"] is None  # JSON-safe


def test_nothing_to_compare():
    result = check_parity(FLAT, [])
    assert not result.flagged and not result.compared and result.reason == "the trial logged no loss"
    assert not check_parity([], FLAT).compared


def test_length_difference_is_noted():
    result = check_parity(FLAT, FLAT[:20])
    assert result.steps_compared == 20 and "first 20" in result.note


def test_loss_scale_divides_the_curve():
    doubled = [2 * x for x in FLAT]
    assert check_parity(FLAT, doubled).flagged
    assert not check_parity(FLAT, doubled, loss_scale=2).flagged


def test_bad_arguments():
    with pytest.raises(ValueError, match="window must be positive"):
        check_parity(FLAT, FLAT, window=0)
    with pytest.raises(ValueError, match="tolerances must be >= 0"):
        check_parity(FLAT, FLAT, rel_tolerance=-1)


def test_smooth_is_a_centred_mean():
    assert smooth([0, 3, 6, 9], 3) == [1.5, 3.0, 6.0, 7.5]


def _row(name: str, curve: list[float], *, baseline: bool = False, status: str = "ok", **strategy) -> TrialResult:
    return TrialResult(
        trial=name,
        strategy=Strategy(name=name, device="cpu", **strategy).to_dict(),
        status=status,
        is_baseline=baseline,
        loss_curve=curve,
    )


def test_annotate_rows():
    rows = [
        _row("base", FLAT, baseline=True),
        _row("same", FLAT),
        _row("broken", [x * 5 for x in FLAT]),
        _row("acc2", [2 * x for x in FLAT], per_device_batch_size=4, gradient_accumulation_steps=2),
        _row("acc2-3x", [3 * x for x in FLAT], per_device_batch_size=4, gradient_accumulation_steps=2),
        _row("bigger", FLAT, per_device_batch_size=16),
        _row("failed", [], status="oom"),
    ]
    annotate_rows(rows)
    parity = {r.trial: r.extra.get("parity") for r in rows}
    assert parity["base"]["is_baseline"]
    assert parity["same"]["compared"] and not parity["same"]["flagged"]
    assert parity["broken"]["flagged"] and parity["broken"]["baseline"] == "base"
    assert not parity["acc2"]["flagged"] and parity["acc2"]["loss_scale"] == 2 and "x2" in parity["acc2"]["note"]
    assert parity["acc2-3x"]["flagged"] and parity["acc2-3x"]["loss_scale"] == 1  # 3 is not a known scale here
    assert not parity["bigger"]["compared"] and "global batch 16" in parity["bigger"]["reason"]
    assert parity["failed"] is None


def test_annotate_rows_without_a_finished_baseline():
    rows = [_row("base", [], baseline=True, status="crashed"), _row("other", FLAT)]
    annotate_rows(rows)
    assert rows[1].extra["parity"]["compared"] is False
    assert "did not finish" in rows[1].extra["parity"]["reason"]


# ---------------------------------------------------------------------------------------------------------------
# real runs: a tiny BERT trained 30 steps by the Trainer
# ---------------------------------------------------------------------------------------------------------------


def _train_curve(tmp_path, name: str, **training_args) -> list[float]:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from hfscale.data import make_classification_dataset

    data = make_classification_dataset(num_samples=240, seq_len=16, token_high=1000, seed=0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=64,
        )
    )  # fmt: skip
    args = dict(
        output_dir=str(tmp_path / name), use_cpu=True, max_steps=30, per_device_train_batch_size=8, logging_steps=1,
        report_to="none", disable_tqdm=True, save_strategy="no", seed=0, dataloader_pin_memory=False,
    )  # fmt: skip
    args.update(training_args)
    trainer = Trainer(model=model, args=TrainingArguments(**args), train_dataset=data)
    trainer.train()
    entries = sorted((e for e in trainer.state.log_history if "loss" in e), key=lambda e: e["step"])
    return [float(e["loss"]) for e in entries]


def test_real_runs_broken_learning_rate_is_flagged(tmp_path, caplog):
    curves = {
        "fp32": _train_curve(tmp_path, "fp32"),
        "bf16": _train_curve(tmp_path, "bf16", bf16=True),
        "acc2": _train_curve(tmp_path, "acc2", per_device_train_batch_size=4, gradient_accumulation_steps=2),
        "lr10": _train_curve(tmp_path, "lr10", learning_rate=10.0),
    }
    assert all(len(c) == 30 for c in curves.values())
    rows = [
        _row("fp32", curves["fp32"], baseline=True),
        _row("bf16", curves["bf16"], precision="bf16"),
        _row("acc2", curves["acc2"], per_device_batch_size=4, gradient_accumulation_steps=2),
        _row("lr10", curves["lr10"]),
    ]
    with caplog.at_level(logging.WARNING, logger="hfscale.parity"):
        annotate_rows(rows)
    parity = {r.trial: r.extra["parity"] for r in rows}
    assert not parity["bf16"]["flagged"], parity["bf16"]
    assert parity["bf16"]["max_rel_deviation"] < 0.02
    # another micro-batching of the same global batch: transformers logs BERT's loss summed over micro-batches
    assert not parity["acc2"]["flagged"], parity["acc2"]
    assert parity["acc2"]["loss_scale"] == 2
    assert parity["lr10"]["flagged"], parity["lr10"]
    assert parity["lr10"]["max_rel_deviation"] > 1.0
    assert "lr10" in caplog.text
