"""Loss parity: the check on synthetic curves, and on curves of real tiny Trainer runs."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from helpers.paths import DATA

from hfscale.records.row import TrialOutcome, TrialResult
from hfscale.results.parity import annotate_rows, check_parity, smooth
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
    measured = TrialOutcome(trial=name, status="ok", loss_curve=curve) if status == "ok" else None
    return TrialResult(
        trial=name,
        strategy=Strategy(name=name, device="cpu", **strategy),
        status=status,
        is_baseline=baseline,
        measured=measured,
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
    parity = {r.trial: r.parity for r in rows}
    assert parity["base"].is_baseline
    assert parity["same"].compared and not parity["same"].flagged
    assert parity["broken"].flagged and parity["broken"].baseline == "base"
    assert not parity["acc2"].flagged and parity["acc2"].loss_scale == 2 and "x2" in parity["acc2"].note
    assert parity["acc2-3x"].flagged and parity["acc2-3x"].loss_scale == 1  # 3 is not a known scale here
    assert not parity["bigger"].compared and "global batch 16" in parity["bigger"].reason
    assert parity["failed"] is None


def test_a_loss_scaled_by_ranks_that_share_a_batch_is_flagged_not_rescaled():
    """Two DDP processes may log twice the loss (two replicas); two tp ranks share one batch, and a tp trial that
    logged twice the loss trained on it (the Trainer's token count divided by tp): flagged, not divided away."""
    from hfscale.strategy import ParallelismSpec

    rows = [
        _row("base", FLAT, baseline=True, per_device_batch_size=8),
        _row("ddp2", [2 * x for x in FLAT], per_device_batch_size=4, num_processes=2),
        _row("tp2", [2 * x for x in FLAT], per_device_batch_size=8, num_processes=2,
             parallelism=ParallelismSpec(tp=2)),
    ]  # fmt: skip
    annotate_rows(rows)
    parity = {r.trial: r.parity for r in rows}
    assert not parity["ddp2"].flagged and parity["ddp2"].loss_scale == 2
    assert parity["tp2"].compared and parity["tp2"].flagged and parity["tp2"].loss_scale == 1


def test_annotate_rows_without_a_finished_baseline():
    rows = [_row("base", [], baseline=True, status="crashed"), _row("other", FLAT)]
    annotate_rows(rows)
    assert rows[1].parity.compared is False
    assert "did not finish" in rows[1].parity.reason


# ---------------------------------------------------------------------------------------------------------------
# real runs: a tiny BERT trained 30 steps by the Trainer
# ---------------------------------------------------------------------------------------------------------------


def _train_curve(tmp_path, name: str, **training_args) -> list[float]:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from hfscale.workload.data import make_classification_dataset

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
    with caplog.at_level(logging.WARNING, logger="hfscale.results.parity"):
        annotate_rows(rows)
    parity = {r.trial: r.parity for r in rows}
    assert not parity["bf16"].flagged, parity["bf16"]
    assert parity["bf16"].max_rel_deviation < 0.02
    # another micro-batching of the same global batch: transformers logs BERT's loss summed over micro-batches
    assert not parity["acc2"].flagged, parity["acc2"]
    assert parity["acc2"].loss_scale == 2
    assert parity["lr10"].flagged, parity["lr10"]
    assert parity["lr10"].max_rel_deviation > 1.0
    assert "lr10" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# real curves: a bert-large sweep on an H100 (128 steps of batch 4 on random labels: large per-step noise)
# ---------------------------------------------------------------------------------------------------------------


def _h100_rows() -> list[TrialResult]:
    data = json.loads((DATA / "parity_h100.json").read_text(encoding="utf-8"))
    return [
        TrialResult(
            trial=t["trial"],
            strategy=Strategy.from_dict(t["strategy"]),
            status="ok",
            is_baseline=t["is_baseline"],
            measured=TrialOutcome(trial=t["trial"], status="ok", loss_curve=t["loss_curve"]),
        )
        for t in data["trials"]
    ]


def test_h100_noisy_curves_pass_and_accumulation_is_rescaled():
    rows = _h100_rows()
    base = next(r for r in rows if r.is_baseline).loss_curve
    # the relative band alone flags mixed precision and ZeRO on this noise; the noise-aware band does not
    fp16 = next(r for r in rows if r.trial == "bs4-fp16").loss_curve
    assert check_parity(base, fp16, noise_k=0).flagged
    annotate_rows(rows)
    parity = {r.trial: r.parity for r in rows}
    for name in ("bs4-fp16", "bs4-bf16", "zero2-bf16", "zero3-bf16", "bs4-adam8bit", "bs4-adafactor"):
        assert parity[name].compared and not parity[name].flagged, (name, parity[name].reason)
        assert parity[name].loss_scale == 1
    for name in ("bs1-acc4", "bs1-acc4-ckpt", "bs1-acc4-ckpt-fp16", "bs1-acc4-ckpt-fp16-adam8bit"):
        assert parity[name].loss_scale == 4 and "x4" in parity[name].note, (name, parity[name])
        assert not parity[name].flagged, (name, parity[name].reason)
        assert abs(parity[name].mean_rel_deviation) < 0.05
    assert parity["bs4-fp16"].noise > 0.1  # the baseline's measured step noise (random labels, batch 4)


def test_h100_noise_does_not_hide_a_real_departure():
    rows = _h100_rows()
    base = next(r for r in rows if r.is_baseline).loss_curve
    # a learning rate of 10 reaches losses of 50-400 within a few steps
    exploded = [*base[:10], *(50.0 + 3 * i for i in range(len(base) - 10))]
    result = check_parity(base, exploded)
    assert result.flagged and result.reason.startswith("smoothed loss") and result.worst_step > 10
    # a curve shifted up by 0.4 as a whole stays inside the per-step noise band (4 x 0.14) but not the mean check
    shifted = [x + 0.4 for x in base]
    result = check_parity(base, shifted)
    assert result.noise_k * result.noise > 0.4
    assert result.flagged and result.reason.startswith("mean loss"), result.reason
    assert result.mean_rel_deviation > 0.3
    # the accumulation curve compared as is (no accumulation recorded, so no known scale): flagged at step 1
    acc4 = next(r for r in rows if r.trial == "bs1-acc4")
    result = check_parity(base, acc4.loss_curve)
    assert result.flagged and result.worst_step is not None and result.max_rel_deviation > 2


# ---------------------------------------------------------------------------------------------------------------
# the shared real sweep: the parity the sweep stored is what the curves give
# ---------------------------------------------------------------------------------------------------------------


def test_the_parity_stored_by_the_sweep_is_what_its_curves_give(tiny_sweep_run):
    import dataclasses

    from hfscale.results.run_folder import RunFolder

    rows = RunFolder(tiny_sweep_run).rows()
    stored = {r.key: r.parity for r in rows}
    assert stored[("fp32", 0)].is_baseline and stored[("bf16", 0)].compared
    again = [dataclasses.replace(r, parity=None) for r in rows]
    annotate_rows(again)  # what a reader computes for rows that carry none
    assert {r.key: r.parity for r in again} == stored
