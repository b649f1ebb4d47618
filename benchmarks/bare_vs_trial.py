"""The same training job as a bare Trainer script and as an hfscale trial, interleaved: does the harness distort it?

The job: a tiny BERT classifier (hidden 64, 2 layers), 64-token sequences, batch 8, 40 optimizer steps, fp32, one
process, ``OMP_NUM_THREADS=1``, the Trainer's default optimizer in both. Each round runs the bare script, then the
trial (``python -m hfscale.trial SPEC.json --result R.json``), each in a fresh process; the order alternates from
round to round so that a drift of the machine does not favour one side.

Printed for each side: steady-state samples/s (the steps after ``--warmup`` of them, timed from one optimizer step's
end to the next: the bare script with a one-line callback, the trial with its ThroughputCallback) as the median and
the min-max over rounds, and the whole process's wall time (start to exit) likewise; then the ratio trial / bare of
the medians, and the median of the per-round ratios with their min-max. The target is a ratio within 2%.

    python benchmarks/bare_vs_trial.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 64, 2, 2, 128, 30522
SEQ_LEN, BATCH, STEPS = 64, 8, 40

BARE_SCRIPT = """
import sys, time
import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

hidden, layers, heads, intermediate, vocab, seq_len, batch, steps, warmup, out = sys.argv[1:]
hidden, layers, heads, intermediate, vocab, seq_len, batch, steps, warmup = map(
    int, (hidden, layers, heads, intermediate, vocab, seq_len, batch, steps, warmup)
)


class StepClock(TrainerCallback):
    def __init__(self):
        self.marks = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())


torch.manual_seed(0)
n = batch * steps
ids = torch.randint(100, 30000, (n, seq_len))
labels = torch.randint(0, 2, (n,))
data = Dataset.from_dict({"input_ids": ids.numpy(), "labels": labels.numpy()}).with_format("torch")
model = BertForSequenceClassification(BertConfig(
    vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
    intermediate_size=intermediate, num_labels=2,
))
args = TrainingArguments(
    output_dir=out, use_cpu=True, per_device_train_batch_size=batch, max_steps=steps, report_to="none",
    save_strategy="no", disable_tqdm=True, seed=42,
)
clock = StepClock()
Trainer(model=model, args=args, train_dataset=data, callbacks=[clock]).train()
durations = [b - a for a, b in zip(clock.marks, clock.marks[1:])][warmup:]
print("SAMPLES_PER_S", batch * len(durations) / sum(durations))
"""


def _env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_bare(folder: Path, warmup: int) -> tuple[float, float]:
    """(steady samples/s, process wall seconds) of one bare run."""
    script = folder / "bare.py"
    script.write_text(BARE_SCRIPT, encoding="utf-8")
    args = [HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB, SEQ_LEN, BATCH, STEPS, warmup, folder / "bare_out"]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(script), *map(str, args)], env=_env(), capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"bare script failed:\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("SAMPLES_PER_S"))
    return float(line.split()[1]), wall


def write_spec(folder: Path, warmup: int) -> Path:
    from hfscale.strategy import Strategy
    from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

    config = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        num_labels=2,
    )
    spec = TrialSpec(
        name="default",
        strategy=Strategy(name="default", device="cpu", per_device_batch_size=BATCH),
        model=ModelSpec(type="bert", task="classification", config=config),
        data=DataSpec(num_samples=BATCH * STEPS, seq_len=SEQ_LEN),
        training_args={"report_to": "none", "seed": 42},
        measure=MeasureSpec(max_steps=STEPS, warmup_steps=warmup),
    )
    path = folder / "spec.json"
    spec.write(path)
    return path


def run_trial(spec: Path, folder: Path) -> tuple[float, float, str | None]:
    """(steady samples/s, process wall seconds, the optimizer class that ran) of one trial."""
    result = folder / "result.json"
    result.unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hfscale.trial", str(spec), "--result", str(result)],
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"trial failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    data = json.loads(result.read_text(encoding="utf-8"))
    verification = data.get("verification") or {}
    optimizer = f"{verification.get('optimizer_class')} ({verification.get('optimizer_implementation')})"
    if data.get("status") != "ok":
        print(f"  trial status {data.get('status')}: {data.get('reason')}", flush=True)
    return float(data["throughput"]["samples_per_s"]), wall, optimizer


def _summary(values: list[float]) -> str:
    return f"median {statistics.median(values):8.2f}  (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="bare + trial pairs (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps left out (default: %(default)s)")
    args = parser.parse_args(argv)
    bare_sps: list[float] = []
    bare_wall: list[float] = []
    trial_sps: list[float] = []
    trial_wall: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hfscale-bare-vs-trial-") as tmp:
        folder = Path(tmp)
        spec = write_spec(folder, args.warmup)
        for i in range(args.rounds):
            order = ("bare", "trial") if i % 2 == 0 else ("trial", "bare")
            for side in order:
                if side == "bare":
                    sps, wall = run_bare(folder, args.warmup)
                    bare_sps.append(sps)
                    bare_wall.append(wall)
                else:
                    sps, wall, optimizer = run_trial(spec, folder)
                    trial_sps.append(sps)
                    trial_wall.append(wall)
                print(f"round {i + 1} {side:5s}: {sps:8.2f} samples/s, process {wall:5.2f} s", flush=True)
    print(f"trial optimizer: {optimizer}")
    print(f"bare  samples/s  {_summary(bare_sps)}")
    print(f"trial samples/s  {_summary(trial_sps)}")
    print(f"bare  process s  {_summary(bare_wall)}")
    print(f"trial process s  {_summary(trial_wall)}")
    ratios = [t / b for t, b in zip(trial_sps, bare_sps, strict=True)]
    print(
        f"samples/s ratio trial/bare: {statistics.median(trial_sps) / statistics.median(bare_sps):.3f} of the "
        f"medians; per round median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    walls = [t / b for t, b in zip(trial_wall, bare_wall, strict=True)]
    print(
        f"process wall ratio trial/bare: per round median {statistics.median(walls):.3f} "
        f"(min {min(walls):.3f}, max {max(walls):.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
