"""MemoryCallback and ThroughputCallback on real (tiny) Trainer runs: CPU here, CUDA where marked ``gpu``. Under two
DDP processes and under DeepSpeed ZeRO-2 they are checked in a user's script launched as `hfscale config` prints it
(tests/scenarios/test_user_configs.py): the launch that proves the configuration ran also measures it."""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers.models import TINY_BERT
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from hfscale.callbacks import (
    MEMORY_PHASES,
    MemoryCallback,
    MemorySummary,
    ThroughputCallback,
    ThroughputSummary,
    timing,
)
from hfscale.callbacks.throughput import _detected_warmup
from hfscale.core.units import GIB
from hfscale.measure.memory import cpu_peak_rss_bytes
from hfscale.workload.data import make_causal_lm_dataset, make_classification_dataset

MEMORY_KEYS = {
    "device",
    "world_size",
    "peak_gib",
    "peak_reserved_gib",
    "phases_gib",
    "phase_peaks_gib",
    "alloc_retries",
    "ooms",
    "nvml_process_used_gib",
    "nvml_device_used_gib",
    "per_rank",
}
RANK_KEYS = (MEMORY_KEYS - {"per_rank", "world_size"}) | {"rank"}
THROUGHPUT_KEYS = {
    "samples_per_s",
    "tokens_per_s",
    "step_time_median_s",
    "step_time_p90_s",
    "step_time_mean_s",
    "measured_steps",
    "warmup_steps",
    "samples_per_step",
    "tokens_per_sample",
    "world_size",
    "flops_per_token",
    "mfu",
    "peak_flops_per_s",
    "device_name",
}


def _args(output_dir: Path, **overrides) -> TrainingArguments:
    base = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=8,
        logging_steps=4,
        learning_rate=1e-4,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    base.update(overrides)
    return TrainingArguments(**base)


def _tiny_bert() -> BertForSequenceClassification:
    return BertForSequenceClassification(BertConfig(**TINY_BERT))


class LogRecorder(TrainerCallback):
    """Stands in for a report_to integration: it sees on_log before the user's callbacks, as they do."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


class SlowFirstSteps(TrainerCallback):
    """Makes the first ``steps`` optimizer steps ``seconds`` slower: a warm-up that must be left out."""

    def __init__(self, steps: int, seconds: float) -> None:
        self.steps, self.seconds = steps, seconds

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step < self.steps:
            time.sleep(self.seconds)


class StepClock(TrainerCallback):
    """An independent clock at each optimizer step's end: the boundary the ThroughputCallback marks (at
    ``on_step_end`` the last step would also hold the callbacks' end-of-training summaries)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


# --------------------------------------------------------------------------------------------------------------
# One CPU run shared by several tests: 8 steps, both callbacks (the throughput one with a warm-up of 2, 0 and
# "auto"), a slow 2-step warm-up, an independent clock.
# --------------------------------------------------------------------------------------------------------------

SLOW_S = 1.0


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu_run")
    recorder, clock = LogRecorder(), StepClock()
    memory = MemoryCallback(output_path=out / "memory.json")
    tp_warm2 = ThroughputCallback(2, output_path=out / "throughput.json")
    tp_warm0 = ThroughputCallback(0)
    tp_auto = ThroughputCallback("auto", output_path=out / "throughput_auto.json")
    model = _tiny_bert()
    trainer = Trainer(
        model=model,
        args=_args(out / "trainer"),
        train_dataset=make_classification_dataset(64, 64),
        callbacks=[recorder, SlowFirstSteps(2, SLOW_S), memory, tp_warm2, tp_warm0, tp_auto, clock],
    )
    result = trainer.train()
    return SimpleNamespace(
        out=out,
        trainer=trainer,
        result=result,
        model=model,
        recorder=recorder,
        clock=clock,
        memory=memory,
        tp2=tp_warm2,
        tp0=tp_warm0,
        tp_auto=tp_auto,
        hwm_after_gib=cpu_peak_rss_bytes() / GIB,
    )


def _entries_with(history: list[dict], prefix: str) -> list[dict]:
    return [e for e in history if any(k.startswith(prefix) for k in e)]


def test_keys_reach_log_history_and_report_to_callbacks(cpu_run):
    history = cpu_run.trainer.state.log_history
    (mem_entry,) = _entries_with(history, "memory/")
    tp_entries = _entries_with(history, "throughput/")  # one per ThroughputCallback (warm-up 2, 0 and auto)
    assert len(tp_entries) == 3
    (tp_entry,) = [e for e in tp_entries if e["throughput/measured_steps"] == 6 and "throughput/warmup_steps" not in e]
    assert mem_entry["step"] == tp_entry["step"] == 8
    for phase in MEMORY_PHASES:
        assert mem_entry[f"memory/{phase}_gib"] == cpu_run.memory.summary.phases_gib[phase]
    assert mem_entry["memory/peak_gib"] == cpu_run.memory.summary.peak_gib
    assert tp_entry["throughput/samples_per_s"] == cpu_run.tp2.summary.samples_per_s
    assert tp_entry["throughput/step_time_median_s"] == cpu_run.tp2.summary.step_time_median_s
    # CPU has no reserved pool, counters or NVML: those keys are left out rather than logged as None.
    assert "memory/peak_reserved_gib" not in mem_entry and "memory/ooms" not in mem_entry
    # The integrations (which run before user callbacks) saw the same keys.
    seen = {k for logs in cpu_run.recorder.logs for k in logs}
    assert {"memory/peak_gib", "memory/forward_gib", "throughput/samples_per_s", "throughput/mfu"} - seen == {
        "throughput/mfu"
    }
    # Our log event did not swallow the Trainer's own loss log for the last step.
    assert [e for e in history if "loss" in e and e["step"] == 8]
    assert [e for e in history if "loss" in e and e["step"] == 4]


def test_summaries_follow_the_contract(cpu_run):
    mem = cpu_run.memory.summary.to_dict()
    tp = cpu_run.tp2.summary.to_dict()
    assert set(mem) >= MEMORY_KEYS
    assert set(mem["phases_gib"]) == set(mem["phase_peaks_gib"]) == set(MEMORY_PHASES)
    assert len(mem["per_rank"]) == 1 and set(mem["per_rank"][0]) >= RANK_KEYS and mem["per_rank"][0]["rank"] == 0
    assert set(tp) >= THROUGHPUT_KEYS
    assert mem["device"] == "cpu" and mem["world_size"] == 1 and tp["world_size"] == 1
    # Written as JSON by the main process, and read back to the same summary.
    assert json.loads((cpu_run.out / "memory.json").read_text()) == json.loads(json.dumps(mem))
    assert json.loads((cpu_run.out / "throughput.json").read_text()) == json.loads(json.dumps(tp))
    assert MemorySummary.from_dict(mem) == cpu_run.memory.summary
    assert ThroughputSummary.from_dict(tp) == cpu_run.tp2.summary


def test_cpu_memory_figures(cpu_run):
    s = cpu_run.memory.summary
    assert s.peak_gib is not None and s.peak_gib > 0
    phases = s.phases_gib
    assert all(phases[p] is not None and phases[p] > 0 for p in MEMORY_PHASES)
    # Adam's two states per parameter (~35 MB here) are allocated in the first optimizer step.
    assert phases["optimizer_step"] > phases["model_load"]
    assert s.peak_gib >= max(phases.values()) - 1 / 1024
    # The process high-water mark after training bounds the training peak (no reset after the first step).
    assert s.peak_gib <= cpu_run.hwm_after_gib + 1 / 1024
    assert s.peak_reserved_gib is None and s.alloc_retries is None and s.ooms is None
    assert s.nvml_device_used_gib is None


def test_throughput_is_consistent_with_step_times(cpu_run):
    s = cpu_run.tp2.summary
    assert s.timer == "perf_counter" and s.total_steps == 8 and s.measured_steps == 6
    assert s.samples_per_step == s.samples_per_step_configured == 4
    assert s.measured_samples == 6 * 4
    assert s.tokens_per_sample == 64  # read from the batches
    assert s.samples_per_s == pytest.approx(s.measured_samples / s.measured_time_s)
    assert s.samples_per_s == pytest.approx(s.samples_per_step / s.step_time_mean_s)
    assert s.tokens_per_s == pytest.approx(s.samples_per_s * 64)
    assert s.step_time_min_s <= s.step_time_median_s <= s.step_time_p90_s <= s.step_time_max_s
    # An independent clock at the same boundaries gives the same step times.
    ends = cpu_run.clock.ends
    independent = [b - a for a, b in itertools.pairwise(ends[1:])]  # steps 3..8
    assert len(independent) == 6
    assert s.step_time_mean_s == pytest.approx(statistics.fmean(independent), rel=0.05, abs=0.005)
    assert s.step_time_median_s == pytest.approx(statistics.median(independent), rel=0.05, abs=0.005)
    # The Trainer's own figure includes the slow warm-up, so it is lower than the steady state.
    assert cpu_run.result.metrics["train_samples_per_second"] < s.samples_per_s
    # BERT classifier (hidden 64, 2 layers, intermediate 128), from its architecture: per layer 4 x (64 x 64 + 64)
    # attention + 2 x 128 LayerNorms + (64 x 128 + 128) + (128 x 64 + 64) = 33,472; two layers, the pooler
    # (4,160), the classifier (130) and the embedding LayerNorm (128): N = 71,362. 6 N + 12 x 2 x 64 x 64 tokens.
    assert s.flops_per_token == 6 * 71_362 + 12 * 2 * 64 * 64
    assert s.compute_dtype == "fp32"
    assert s.mfu is None and s.peak_flops_per_s is None  # CPU: no known peak
    assert s.device_name


def test_warmup_steps_are_excluded(cpu_run):
    with_warmup, without = cpu_run.tp2.summary, cpu_run.tp0.summary
    assert without.measured_steps == 8 and with_warmup.measured_steps == 6
    assert min(without.step_times_s[:2]) >= SLOW_S  # the slowed steps are in
    # ... and left out: the same six later steps, timed by the other callback's own marks.
    assert with_warmup.step_times_s == pytest.approx(without.step_times_s[2:], abs=0.05)
    assert without.step_time_mean_s > with_warmup.step_time_mean_s + 0.5 * 2 * SLOW_S / 8


# --------------------------------------------------------------------------------------------------------------
# warmup_steps="auto": the warm-up read from the run's own step times (hfscale.measure.warmup)
# --------------------------------------------------------------------------------------------------------------


def test_auto_warmup_leaves_out_the_slow_steps_it_detects(cpu_run):
    s, everything = cpu_run.tp_auto.summary, cpu_run.tp0.summary
    assert s.warmup_detected and s.steady_state is not None and s.total_steps == 8
    # Both slowed steps are left out (MSER may leave out steady ones more: on 8 steps it often does), and the
    # measured steps are those after the detected end, timed by the other callback's own marks.
    assert s.warmup_steps >= 2 and s.measured_steps == 8 - s.warmup_steps
    assert s.step_times_s == pytest.approx(everything.step_times_s[s.warmup_steps :], abs=0.05)
    (entry,) = [e for e in cpu_run.trainer.state.log_history if "throughput/warmup_steps" in e]  # given: not logged
    assert (entry["throughput/warmup_steps"], entry["throughput/steady_state"]) == (s.warmup_steps, s.steady_state)
    assert ThroughputSummary.from_dict(json.loads((cpu_run.out / "throughput_auto.json").read_text())) == s
    assert (everything.warmup_detected, everything.steady_state) == (False, None)


def _drive(callback: ThroughputCallback, durations: list[float], monkeypatch, tmp_path: Path) -> ThroughputSummary:
    """``callback`` through ``len(durations)`` steps without a Trainer, on a clock that advances by ``durations``:
    step times a test chooses, whatever the machine's load."""
    clock = itertools.accumulate([0.0, *durations])
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    args, state, control = _args(tmp_path), TrainerState(max_steps=len(durations)), TrainerControl()
    callback.on_train_begin(args, state, control, model=None)
    for step in range(1, len(durations) + 1):
        state.global_step = step
        callback.on_step_end(args, state, control)
    return callback.summary


def test_auto_warmup_says_when_the_run_did_not_settle(tmp_path, monkeypatch, caplog):
    steady = [0.9, 0.4, *[0.1, 0.11, 0.09] * 6]
    with caplog.at_level(logging.WARNING, logger="hfscale.callbacks"):
        s = _drive(ThroughputCallback("auto"), steady, monkeypatch, tmp_path)
    assert (s.warmup_steps, s.steady_state, s.measured_steps) == (2, True, 18)
    assert s.step_time_mean_s == pytest.approx(0.1)
    assert "steady state" not in caplog.text
    drifting = [0.2 - 0.005 * k for k in range(20)]  # faster every step, to the end
    with caplog.at_level(logging.WARNING, logger="hfscale.callbacks"):
        s = _drive(ThroughputCallback("auto"), drifting, monkeypatch, tmp_path)
    assert s.steady_state is False and s.warmup_steps > 10 and s.measured_steps == 20 - s.warmup_steps
    assert "the run did not reach a steady state" in caplog.text and "train longer" in caplog.text


def test_auto_warmup_counts_only_uninterrupted_steps():
    # Step 1 held an evaluation (its time is not training's): detection runs on the others, and the evaluation
    # step, inside the detected warm-up, is left out with it.
    times = [0.9, 5.0, 0.3, *[0.1] * 8]
    interrupted = [False, True, *[False] * 9]
    warmup, detection = _detected_warmup(times, interrupted)
    assert (detection.steps, detection.steady, warmup) == (2, True, 3)
    assert _detected_warmup([0.3, 0.1, 0.1, 0.1, 0.1], [False] * 5)[0] == 1


def test_auto_warmup_on_too_short_a_run_leaves_nothing_out_and_says_so(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="hfscale.callbacks"):
        s = _drive(ThroughputCallback("auto"), [0.3, 0.1, 0.1], monkeypatch, tmp_path)
    assert "training has 3 optimizer steps to run, fewer than the 4 a warm-up is detected on" in caplog.text
    assert (s.warmup_steps, s.measured_steps, s.warmup_detected, s.steady_state) == (0, 3, True, False)
    assert s.step_time_mean_s == pytest.approx(0.5 / 3)  # still measured, and marked as not steady


def test_a_summary_written_before_detection_reads_back_with_a_given_warmup(cpu_run):
    old = cpu_run.tp2.summary.to_dict()
    del old["warmup_detected"], old["steady_state"]
    back = ThroughputSummary.from_dict(old)
    assert (back.warmup_steps, back.warmup_detected, back.steady_state) == (2, False, None)
    assert "throughput/warmup_steps" not in back.log_dict()


# --------------------------------------------------------------------------------------------------------------
# Memory grows with the batch; the peak is the training run's, not the process's lifetime peak.
# --------------------------------------------------------------------------------------------------------------


def _train_memory(tmp_path: Path, batch: int, seq_len: int = 512) -> MemorySummary:
    memory = MemoryCallback()
    Trainer(
        model=_tiny_bert(),
        args=_args(tmp_path / f"b{batch}", per_device_train_batch_size=batch, max_steps=2),
        train_dataset=make_classification_dataset(2 * batch, seq_len),
        callbacks=[memory],
    ).train()
    return memory.summary


def test_peak_grows_with_batch_and_is_not_a_lifetime_peak(tmp_path):
    # A 768 MiB spike before training: it must show in the model_load phase's peak, not in the training peak.
    spike = np.ones(768 * 1024**2 // 8)
    del spike
    spike_hwm_gib = cpu_peak_rss_bytes() / GIB
    small = _train_memory(tmp_path, 2)
    assert small.phase_peaks_gib["model_load"] >= spike_hwm_gib - 1 / 1024
    assert small.peak_gib < spike_hwm_gib - 0.25
    large = _train_memory(tmp_path, 16)
    # Attention scores alone are 16 x 2 heads x 512 x 512 x 4 B = 32 MiB per copy, several per layer.
    assert large.peak_gib > small.peak_gib + 0.1
    assert large.phases_gib["forward"] > small.phases_gib["forward"]


# --------------------------------------------------------------------------------------------------------------
# Gradient accumulation, a last partial batch, causal LM tokens and MFU with a given peak
# --------------------------------------------------------------------------------------------------------------


def test_gradient_accumulation_and_partial_last_batch(tmp_path, tiny_gpt2):
    num_samples, batch, accumulation = 42, 4, 2  # 11 batches (the last holds 2) -> 6 optimizer steps
    memory, throughput = MemoryCallback(), ThroughputCallback(1, peak_flops=1e12)
    trainer = Trainer(
        model=tiny_gpt2,
        args=_args(
            tmp_path,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            max_steps=-1,
            num_train_epochs=1,
        ),
        train_dataset=make_causal_lm_dataset(num_samples, 32),
        callbacks=[memory, throughput],
    )
    trainer.train()
    s = throughput.summary
    assert s.total_steps == trainer.state.global_step == 6
    assert s.samples_per_step == s.samples_per_step_configured == batch * accumulation
    # Every sample but the warm-up step's: the last step's partial batch counts what it held.
    assert s.measured_samples == num_samples - batch * accumulation
    assert s.tokens_per_sample == 32
    # GPT-2 (vocabulary 30522, hidden 64, 2 layers), from its architecture: 2 blocks of 49,984 and ln_f (128) do
    # matmul work, and so does the output head tied to the token embedding (30522 x 64 = 1,953,408).
    flops_per_token = 6 * (2 * 49_984 + 128 + 30_522 * 64) + 12 * 2 * 64 * 32
    assert s.flops_per_token == flops_per_token
    # MFU from the raw counts: tokens in the measured steps over their time, times FLOPs per token, over 1e12.
    assert s.mfu == pytest.approx(s.measured_samples * 32 / s.measured_time_s * flops_per_token / 1e12)
    m = memory.summary
    assert all(m.phases_gib[p] is not None for p in MEMORY_PHASES)
    assert any("gradient accumulation" in note for note in m.notes)


class SlowFinish(MemoryCallback):
    """A memory callback whose end-of-training work takes ``seconds`` (NVML, a gather over ranks, logging)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.started_at: float | None = None

    def _finish(self, args, state, control):
        if not getattr(self, "_finished", True):
            self.started_at = time.perf_counter()
            time.sleep(self.seconds)
        super()._finish(args, state, control)


@pytest.mark.parametrize("memory_first", [True, False], ids=["memory-first", "throughput-first"])
def test_no_callbacks_end_of_training_work_is_timed(tmp_path, tiny_bert, memory_first):
    """Issue 11, item 10: on the last step the memory callback finished (before the throughput callback, when it
    comes first) inside the last timed step."""
    slow, throughput = SlowFinish(0.5), ThroughputCallback(0)
    callbacks = [slow, throughput] if memory_first else [throughput, slow]
    Trainer(
        model=tiny_bert,
        args=_args(tmp_path, per_device_train_batch_size=2, max_steps=4, logging_steps=100),
        train_dataset=make_classification_dataset(8, 16),
        callbacks=callbacks,
    ).train()
    s = throughput.summary
    assert s.measured_steps == 4
    # The last step's boundary was taken before the other callback's end-of-training work began.
    last_boundary = throughput._timer._marks[-1]
    assert slow.started_at is not None and last_boundary <= slow.started_at
    assert sum(throughput._timer.durations_s()) == pytest.approx(s.measured_time_s)


def test_compute_dtype_is_what_the_first_forward_ran_in(tmp_path, tiny_bert):
    """Issue 11, item 8: a model loaded in bf16 without args.bf16 computes in bf16, and its MFU is against the bf16
    peak (the arguments alone said fp32: about 15x too high a figure on an H100)."""
    import torch

    throughput = ThroughputCallback(0, peak_flops=1e12)
    Trainer(
        model=tiny_bert.to(torch.bfloat16),
        args=_args(tmp_path, per_device_train_batch_size=2, max_steps=2),
        train_dataset=make_classification_dataset(4, 16),
        callbacks=[throughput],
    ).train()
    assert throughput.summary.compute_dtype == "bf16"


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: counts the waits a timer makes (a wait is a host-device sync)."""

    waits = 0
    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self) -> None:
        FakeEvent.clock += 0.01
        self.at = FakeEvent.clock

    def query(self) -> bool:  # non-blocking
        return True

    def synchronize(self) -> None:
        FakeEvent.waits += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0


def test_cuda_event_timer_waits_once_at_the_end_not_per_step(monkeypatch):
    """What can be counted without a GPU: the event timer never waits on an event while steps are marked (it polls
    with query), and waits for the last event once, when the durations are read."""
    import torch

    from hfscale.callbacks.timing import _CudaEventTimer

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "waits", 0)
    timer = _CudaEventTimer(window=4)
    for _ in range(101):
        timer.mark()
    assert FakeEvent.waits == 0
    durations = timer.durations_s()
    assert FakeEvent.waits == 1
    assert durations == pytest.approx([0.01] * 100)


# --------------------------------------------------------------------------------------------------------------
# Too few steps, bad options, no Trainer
# --------------------------------------------------------------------------------------------------------------


def test_too_few_steps_warns_and_gives_none(tmp_path, tiny_bert, caplog):
    throughput = ThroughputCallback(2)
    memory = MemoryCallback()
    trainer = Trainer(
        model=tiny_bert,
        args=_args(tmp_path, per_device_train_batch_size=2, max_steps=3),
        train_dataset=make_classification_dataset(8, 16),
        callbacks=[memory, throughput],
    )
    with caplog.at_level(logging.WARNING, logger="hfscale.callbacks"):
        trainer.train()
    assert "fewer than warmup_steps + 2" in caplog.text
    s = throughput.summary
    assert s.measured_steps == 1
    assert s.samples_per_s is None and s.step_time_median_s is None and s.mfu is None
    (entry,) = _entries_with(trainer.state.log_history, "throughput/")
    assert "throughput/samples_per_s" not in entry and entry["throughput/measured_steps"] == 1
    assert memory.summary.peak_gib > 0  # memory is still measured


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"warmup_steps": "Auto"}, r'warmup_steps: expected an integer >= 0 or "auto", got \'Auto\''),
        ({"warmup_steps": True}, r'warmup_steps: expected an integer >= 0 or "auto", got True'),
        ({"peak_flops": 0.0}, "peak_flops"),
        ({"flops_per_token": -5.0}, "flops_per_token"),
    ],
)
def test_throughput_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ThroughputCallback(**kwargs)


def test_without_a_trainer_the_summary_is_still_made(tmp_path, caplog):
    args = _args(tmp_path, per_device_train_batch_size=3)
    state, control = TrainerState(max_steps=4), TrainerControl()
    callback = ThroughputCallback(1, flops_per_token=100.0, peak_flops=1e9)
    with caplog.at_level(logging.WARNING, logger="hfscale.callbacks"):
        callback.on_train_begin(args, state, control, model=None)
        for step in range(1, 5):
            time.sleep(0.01)
            state.global_step = step
            callback.on_step_end(args, state, control)
    s = callback.summary
    assert s.total_steps == 4 and s.measured_steps == 3
    assert s.samples_per_step == 3  # nothing counted (no model): the configured figure, with a warning
    assert "counted no samples" in caplog.text and "no transformers.Trainer" in caplog.text
    assert s.step_time_min_s >= 0.009


# --------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a device)
# --------------------------------------------------------------------------------------------------------------


def _sync_is_an_error_inside_steps(monkeypatch, *callbacks) -> None:
    """Run every per-step hook of ``callbacks`` under ``torch.cuda.set_sync_debug_mode("error")``: any
    host-device synchronisation in them (``.item()``, a device-to-host copy, ``synchronize``, an event wait)
    raises. Only the end-of-training summary (``_finish``) may wait, once."""
    import torch

    def under(mode, fn):
        def wrapped(*args, **kwargs):
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(mode)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(previous)

        return wrapped

    per_step = (
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
        "_count_batch",  # forward pre-hook, bound at train begin
        "_after_first_forward",  # forward hook, bound at train begin
    )
    for callback in callbacks:
        for name in per_step:
            if hasattr(callback, name):
                monkeypatch.setattr(callback, name, under("error", getattr(callback, name)))
        monkeypatch.setattr(callback, "_finish", under("default", callback._finish))


def _counted_classifier_flops_per_token(seq_len: int) -> float:
    """FLOPs per token of one training step of the tiny BERT classifier, as torch's FLOP counter counts them on CPU
    with eager attention (its matmuls are what the counter sees)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**TINY_BERT, attn_implementation="eager")).train()
    ids = torch.randint(100, 1000, (2, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=torch.zeros(2, dtype=torch.long)).loss.backward()
    return counter.get_total_flops() / (2 * seq_len)


@pytest.mark.gpu
def test_cuda_allocator_phases_events_and_nvml(tmp_path, monkeypatch):
    import torch

    callers: list[str] = []
    real_sync = torch.cuda.synchronize

    def counting_sync(*args, **kwargs):
        callers.append(sys._getframe(1).f_globals.get("__name__", ""))
        return real_sync(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", counting_sync)
    memory, throughput = MemoryCallback(), ThroughputCallback(2)
    _sync_is_an_error_inside_steps(monkeypatch, memory, throughput)
    trainer = Trainer(
        model=_tiny_bert(),
        args=_args(tmp_path, use_cpu=False, per_device_train_batch_size=16, max_steps=8),
        train_dataset=make_classification_dataset(128, 256),
        callbacks=[memory, throughput],
    )
    trainer.train()
    assert not [c for c in callers if c.startswith("hfscale")], "the callbacks must not synchronise the device"
    m = memory.summary
    assert m.device == "cuda"
    p = m.phases_gib
    assert p["forward"] > p["model_load"]  # + activations
    assert p["optimizer_step"] > p["backward"]  # + Adam's two states
    assert m.peak_gib >= max(p.values())
    assert m.peak_reserved_gib >= m.peak_gib
    assert m.alloc_retries == 0 and m.ooms == 0
    if m.nvml_device_used_gib is not None:
        assert m.nvml_device_used_gib >= 0.9 * m.peak_reserved_gib
    s = throughput.summary
    assert s.timer == "cuda_events" and s.measured_steps == 6
    assert s.step_time_median_s > 0 and s.samples_per_step == 16
    assert s.device_name == torch.cuda.get_device_name()
    # The callback's FLOPs against torch's FLOP counter on the same model and sequence length: 1.044x, the pooler
    # and classifier (in N, but run on the first token only) and the biases and LayerNorms (no matmul).
    counted = _counted_classifier_flops_per_token(seq_len=256)
    assert s.tokens_per_sample == 256 and s.flops_per_token == pytest.approx(counted, rel=0.05)
    if s.peak_flops_per_s is not None:
        from hfscale.measure.flops import DEVICE_PEAK_FLOPS, canonical_device

        # The datasheet's dense peak for this device and the dtype the run computed in, and the counted work per
        # second (one device) below it: an MFU that is a fraction of something real.
        assert s.peak_flops_per_s == DEVICE_PEAK_FLOPS[canonical_device(s.device_name)][s.compute_dtype]
        achieved = s.tokens_per_s * counted
        assert 0 < achieved < s.peak_flops_per_s
        assert s.mfu == pytest.approx(achieved / s.peak_flops_per_s, rel=0.05)


def test_a_skipped_first_optimizer_step_is_measured_at_the_first_step_that_runs(tmp_path):
    """An fp16 loss scaler that skips the first step allocates no optimizer state there: the phase must be read at
    the step that really ran. 256 MiB touched between the skipped step and the real one stands in for the states."""
    import types

    import numpy as np
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    memory = MemoryCallback()
    memory.on_train_begin(args, state, control)
    memory.on_pre_optimizer_step(args, state, control)  # the first step's backward ends
    memory.on_optimizer_step(args, state, control, optimizer=types.SimpleNamespace(step_was_skipped=True))
    memory.on_pre_optimizer_step(args, state, control)  # the second step's backward ends
    states = np.ones(256 * 2**20, dtype=np.uint8)  # allocated by the step that runs
    memory.on_optimizer_step(args, state, control, optimizer=types.SimpleNamespace(step_was_skipped=False))
    memory.on_train_end(args, state, control)
    phases = memory.summary.phases_gib
    assert phases["optimizer_step"] - phases["backward"] > 0.2, phases
    del states


# --------------------------------------------------------------------------------------------------------------
# Binding to the Trainer, and the verification callback
# --------------------------------------------------------------------------------------------------------------


def _verify_trainer(tmp_path, strategy, callbacks=(), **overrides):
    from hfscale.configs import training_args_kwargs

    kwargs = training_args_kwargs(strategy) | dict(max_steps=2, save_strategy="no", report_to="none")
    kwargs |= dict(disable_tqdm=True, logging_steps=1) | overrides
    return Trainer(
        model=_tiny_bert(),
        args=TrainingArguments(output_dir=str(tmp_path / "trainer"), **kwargs),
        train_dataset=make_classification_dataset(16, 16),
        callbacks=list(callbacks),
    )


def test_attach_binds_callbacks_without_searching_the_call_stack(tmp_path, monkeypatch):
    import hfscale.callbacks.base as callbacks_base

    def no_search(callback):
        raise AssertionError("the call stack was searched for the Trainer")

    monkeypatch.setattr(callbacks_base, "_find_trainer", no_search)
    from hfscale.callbacks import attach
    from hfscale.strategy import Strategy

    memory = MemoryCallback()
    trainer = _verify_trainer(tmp_path, Strategy(device="cpu"), callbacks=[memory])
    throughput = ThroughputCallback(0)
    attach(trainer, memory, throughput)
    assert sum(cb is memory for cb in trainer.callback_handler.callbacks) == 1  # held already: not added twice
    trainer.train()
    history = trainer.state.log_history
    assert _entries_with(history, "memory/") and _entries_with(history, "throughput/")


def test_a_callback_bound_to_one_trainer_reports_to_the_next_one_it_runs_in(tmp_path):
    """attach(a, callback), then the same callback in another Trainer: b's run is b's, logged into b, and verified
    against b's model (its parameters, not a's)."""
    from hfscale.callbacks import VerificationCallback, attach
    from hfscale.strategy import Strategy

    throughput, verify = ThroughputCallback(0), VerificationCallback(Strategy(device="cpu"), on_mismatch="warn")
    first = _verify_trainer(tmp_path / "a", Strategy(device="cpu"))
    attach(first, throughput, verify)
    first.train()
    bigger = dict(TINY_BERT, num_hidden_layers=TINY_BERT["num_hidden_layers"] + 2)
    second = Trainer(
        model=BertForSequenceClassification(BertConfig(**bigger)),
        args=first.args,
        train_dataset=make_classification_dataset(16, 16),
        callbacks=[throughput, verify],
    )
    second.train()
    assert len(_entries_with(first.state.log_history, "throughput/")) == 1  # its own run only
    assert _entries_with(second.state.log_history, "throughput/") and _entries_with(second.state.log_history, "verify/")
    assert verify.record.params_total == sum(p.numel() for p in second.model.parameters())


def test_a_resumed_run_is_warned_of_the_steps_it_has_left(tmp_path, caplog):
    first = Trainer(model=_tiny_bert(), args=_args(tmp_path, max_steps=10, save_strategy="steps", save_steps=8),
                    train_dataset=make_classification_dataset(64, 16))  # fmt: skip
    first.train()
    throughput = ThroughputCallback(5)
    data = make_classification_dataset(64, 16)
    again = Trainer(model=_tiny_bert(), args=_args(tmp_path, max_steps=10), train_dataset=data, callbacks=[throughput])
    with caplog.at_level(logging.WARNING, logger="hfscale.callbacks"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    assert "training has 2 optimizer steps to run, fewer than warmup_steps + 2 = 7" in caplog.text


def test_bind_refuses_a_non_trainer_and_a_trainer_without_the_callback(tmp_path):
    from hfscale.callbacks import attach
    from hfscale.strategy import Strategy

    trainer = _verify_trainer(tmp_path, Strategy(device="cpu"))
    with pytest.raises(ValueError, match="not among the Trainer's callbacks"):
        MemoryCallback().bind(trainer)
    with pytest.raises(TypeError, match=r"expected a transformers\.Trainer, got str"):
        MemoryCallback().bind("trainer")
    with pytest.raises(TypeError, match=r"attach: expected a transformers\.Trainer"):
        attach(object(), MemoryCallback())


def test_verification_callback_logs_the_record_and_writes_it(tmp_path):
    from hfscale.callbacks import VerificationCallback, attach
    from hfscale.configs import write_configs
    from hfscale.strategy import Strategy

    strategy = Strategy(device="cpu", per_device_batch_size=4, gradient_accumulation_steps=2, optimizer="adamw_torch")
    write_configs(strategy, tmp_path / "cfg")
    trainer = _verify_trainer(tmp_path, strategy, max_steps=3)
    recorder = LogRecorder()
    verify = VerificationCallback(tmp_path / "cfg", output_path=tmp_path / "verify.json")  # read from strategy.json
    attach(trainer, recorder, verify)
    trainer.train()
    assert verify.strategy == strategy
    assert verify.mismatches == []
    (entry,) = _entries_with(trainer.state.log_history, "verify/")
    assert entry["step"] == 1  # checked at the end of the first optimizer step
    assert entry["verify/ok"] == 1 and entry["verify/mismatches"] == 0
    assert entry["verify/distributed_type"] == "NO" and entry["verify/wrapper"] == "none"
    assert entry["verify/global_batch_size"] == 8 and entry["verify/linear_output_dtype"] == "float32"
    assert entry["verify/optimizer_class"] == "torch.optim.adamw.AdamW"
    assert any("verify/ok" in logs for logs in recorder.logs)  # reached the report_to integrations too
    written = json.loads((tmp_path / "verify.json").read_text())
    assert written["ok"] is True and written["mismatches"] == []
    assert written["record"]["params_total"] == entry["verify/params_total"]
    assert written["strategy"] == strategy.to_dict()


def test_verification_callback_raises_on_a_mismatch_or_warns(tmp_path, caplog):
    from hfscale.callbacks import VerificationCallback, attach
    from hfscale.measure.verify import VerificationError
    from hfscale.strategy import Strategy

    asked = Strategy(device="cpu", precision="bf16", per_device_batch_size=4)
    ran = Strategy(device="cpu", per_device_batch_size=4)  # the arguments leave bf16 out: fp32 runs
    trainer = _verify_trainer(tmp_path, ran)
    attach(trainer, VerificationCallback(asked))
    with pytest.raises(VerificationError, match="produced float32, expected bfloat16") as raised:
        trainer.train()
    assert trainer.state.global_step == 1  # stopped at the first step
    assert any("mixed_precision='no'" in m for m in raised.value.mismatches)

    trainer = _verify_trainer(tmp_path, ran)
    verify = VerificationCallback(asked, on_mismatch="warn")
    attach(trainer, verify)
    with caplog.at_level(logging.WARNING, logger="hfscale.callbacks"):
        trainer.train()
    assert trainer.state.global_step == 2  # trained on
    assert "what runs is not what was asked" in caplog.text
    (entry,) = _entries_with(trainer.state.log_history, "verify/")
    assert entry["verify/ok"] == 0 and "expected bfloat16" in entry["verify/reason"]
    assert verify.record is not None and verify.record.linear_output_dtype == "float32"


def test_verification_callback_options_are_validated(tmp_path):
    from hfscale.callbacks import VerificationCallback
    from hfscale.strategy import Strategy

    with pytest.raises(ValueError, match="on_mismatch: expected one of raise, warn, got 'ignore'"):
        VerificationCallback(Strategy(), on_mismatch="ignore")
    with pytest.raises(FileNotFoundError, match=r"no strategy\.json; give the folder `hfscale config --out` wrote"):
        VerificationCallback(tmp_path)
    (tmp_path / "strategy.json").write_text('{"precision": "fp8"}')
    with pytest.raises(ValueError, match="precision"):
        VerificationCallback(tmp_path)
