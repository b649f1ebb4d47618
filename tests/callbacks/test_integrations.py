"""The callbacks' keys reach real ``report_to`` integrations, read back with each integration's own reader.

A Trainer logs what a callback passes to ``Trainer.log``; TensorBoard and W&B then prefix training keys with
``train/``. These tests train a tiny model for a handful of steps with the integration on, read what it wrote (the
TensorBoard event files with TensorBoard's ``EventAccumulator``; the W&B offline run's ``.wandb`` log with W&B's own
``wandb leet inspect``), and check that every ``memory/...`` and ``throughput/...`` figure arrived, at the last
step, with the value of the callbacks' summaries.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.models import TINY_BERT

from hfscale.callbacks import MEMORY_PHASES, MemoryCallback, ThroughputCallback
from hfscale.workload.data import make_classification_dataset

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="needs tensorboard: pip install 'hfscale[tensorboard]'",
)
needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="needs wandb: pip install 'hfscale[wandb]'",
)

STEPS = 6


def _train(output_dir: Path, report_to: str) -> SimpleNamespace:
    """Six optimizer steps of a tiny BERT with both callbacks (two warm-up steps) and one integration."""
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    memory, throughput = MemoryCallback(), ThroughputCallback(2)
    args = TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=STEPS,
        logging_steps=2,
        save_strategy="no",
        report_to=report_to,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=BertForSequenceClassification(BertConfig(**TINY_BERT)),
        args=args,
        train_dataset=make_classification_dataset(32, 32),
        callbacks=[memory, throughput],
    )
    trainer.train()
    assert trainer.state.global_step == STEPS
    logged = {**memory.summary.log_dict(), **throughput.summary.log_dict()}
    # What an integration should show: each figure under train/, the required ones present (none left as None).
    expected = {f"train/{key}": value for key, value in logged.items()}
    required = {"train/memory/peak_gib", "train/throughput/samples_per_s", "train/throughput/step_time_median_s"}
    required |= {f"train/memory/{phase}_gib" for phase in MEMORY_PHASES}
    assert required <= expected.keys()
    assert expected["train/memory/peak_gib"] == memory.summary.peak_gib
    assert expected["train/throughput/samples_per_s"] == throughput.summary.samples_per_s
    return SimpleNamespace(trainer=trainer, expected=expected)


def _ours(keys: object) -> set[str]:
    return {k for k in keys if k.startswith(("train/memory/", "train/throughput/"))}


@needs_tensorboard
def test_tensorboard_event_files_hold_the_callbacks_figures(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    run = _train(tmp_path / "out", "tensorboard")
    (events,) = (tmp_path / "out").rglob("events.out.tfevents.*")
    reader = event_accumulator.EventAccumulator(str(events.parent), size_guidance={event_accumulator.SCALARS: 0})
    reader.Reload()
    tags = reader.Tags()["scalars"]
    assert _ours(tags) == set(run.expected)
    for tag, value in run.expected.items():
        (event,) = reader.Scalars(tag)
        assert event.step == STEPS, tag
        # TensorBoard stores scalars as float32.
        assert event.value == pytest.approx(value, rel=1e-6), tag


@needs_wandb
def test_wandb_offline_run_holds_the_callbacks_figures(tmp_path, monkeypatch):
    import wandb

    inspect = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--help"], capture_output=True, text=True, timeout=60
    )
    if inspect.returncode != 0:
        pytest.skip(f"wandb {wandb.__version__} has no 'wandb leet inspect' to read an offline run with")
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": tmp_path,
        "WANDB_CONFIG_DIR": tmp_path / "config",
        "WANDB_CACHE_DIR": tmp_path / "cache",
        "WANDB_DATA_DIR": tmp_path / "data",
        "WANDB_PROJECT": "hfscale-test",
        "WANDB_SILENT": "true",
    }.items():
        monkeypatch.setenv(name, str(value))
    try:
        run = _train(tmp_path / "out", "wandb")
        wandb.finish()  # the Trainer's WandbCallback leaves the run open
    finally:
        wandb.teardown()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    read = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    records = [json.loads(line) for line in read.stdout.splitlines() if line.strip()]
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    seen = {key for item in history for key in _ours(item)}
    assert seen == set(run.expected)
    for key, value in run.expected.items():
        (item,) = [item for item in history if key in item]
        assert item[key] == value, key  # JSON keeps the double exactly
        assert item["train/global_step"] == STEPS, key
