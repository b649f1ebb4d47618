"""What MemoryCallback + ThroughputCallback cost per training step: runs without (A) and with (B) them, alternating.

Usage::

    python benchmarks/callback_overhead.py                 # CPU, tiny BERT
    python benchmarks/callback_overhead.py --device cuda   # the same on a GPU
    python benchmarks/callback_overhead.py --pairs 10 --steps 60 --json overhead.json

Each run is a fresh Trainer on the same tiny model (BERT, hidden 64, 2 layers) and data. Runs alternate A, B, A, B,
... so that drift of the machine (other processes, clocks, caches) hits both arms alike. Both arms carry the same
minimal step clock (``perf_counter`` at each step end; on CUDA a synchronisation at the end of the warm-up and at the
last step only, the same in both arms). Printed:

- the median step time each way and the overhead, from the median over runs of each run's mean post-warm-up step
  time, and from the pairs (each B against the A before it), with their spread as the noise floor;
- the callbacks' own time, measured inside their hooks and events (per step in steady state, and the one-off cost
  of finishing: the cross-rank gather, the log event and the JSON file). This figure does not depend on machine
  noise, so it is the one to trust on a busy machine.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEADY_EVENTS = ("on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end")
HOOKS = ("_count_batch", "_after_first_forward")


class SelfTime:
    """Wraps a callback's events and model hooks to add up the time spent inside them.

    Time is split into: train begin, the first steps (warm-up, where MemoryCallback measures its phases), the steady
    steps after warm-up (``in_window``, switched on by the step clock, which also closes each step's total), and
    the finish. Per-step totals give a median that a rare preemption of the process does not move.
    """

    def __init__(self) -> None:
        self.in_window = False
        self.begin_s = 0.0
        self.warmup_s = 0.0
        self.steady_s = 0.0
        self.finish_s = 0.0
        self.current_step_s = 0.0
        self.per_step_s: list[float] = []

    def close_step(self) -> None:
        if self.in_window:
            self.per_step_s.append(self.current_step_s)
        self.current_step_s = 0.0

    def _wrap(self, fn: Any, bucket: str | None) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                name = bucket or ("steady_s" if self.in_window else "warmup_s")
                setattr(self, name, getattr(self, name) + elapsed)
                if name == "steady_s":
                    self.current_step_s += elapsed

        return timed

    def instrument(self, callback: Any) -> None:
        for name in (*STEADY_EVENTS, *HOOKS):
            if hasattr(callback, name):
                setattr(callback, name, self._wrap(getattr(callback, name), None))
        callback.on_train_begin = self._wrap(callback.on_train_begin, "begin_s")
        # _finish runs inside the last on_step_end: counted in both buckets, taken out of steady_s below.
        callback._finish = self._wrap(callback._finish, "finish_s")


class StepClock:
    """The one clock both arms carry."""

    def __init__(self, warmup: int, sync_cuda: bool, self_time: SelfTime) -> None:
        from transformers import TrainerCallback

        clock = self

        class _Clock(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                last = state.global_step in (warmup, state.max_steps)
                if sync_cuda and last:
                    import torch

                    torch.cuda.synchronize()
                clock.ends.append(time.perf_counter())
                clock.cpu_ends.append(time.process_time())
                # Runs before the measured callbacks' on_step_end: their work from here on is steady-state.
                self_time.close_step()
                self_time.in_window = state.global_step >= warmup

        self.callback = _Clock()
        self.warmup = warmup
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def window(self) -> tuple[float, list[float], float]:
        """(mean step time after warm-up, per-step times after warm-up, mean process CPU time per step)."""
        ends = self.ends[self.warmup - 1 :]
        cpu = self.cpu_ends[self.warmup - 1 :]
        per_step = [b - a for a, b in itertools.pairwise(ends)]
        return (ends[-1] - ends[0]) / len(per_step), per_step, (cpu[-1] - cpu[0]) / len(per_step)


def one_run(opts: argparse.Namespace, model: Any, dataset: Any, with_callbacks: bool, out_dir: str) -> dict[str, Any]:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from hfscale.callbacks import MemoryCallback, ThroughputCallback

    self_time = SelfTime()
    clock = StepClock(opts.warmup, sync_cuda=opts.device == "cuda", self_time=self_time)
    callbacks: list[Any] = [clock.callback]
    if with_callbacks:
        ours = [MemoryCallback(), ThroughputCallback(opts.warmup)]
        for cb in ours:
            self_time.instrument(cb)
        callbacks += ours
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=opts.device == "cpu",
        per_device_train_batch_size=opts.batch,
        max_steps=opts.steps,
        logging_steps=opts.steps,  # one loss log, at the end, in both arms
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # no printing in either arm
    trainer.train()
    mean_s, per_step, cpu_s = clock.window()
    measured = opts.steps - opts.warmup
    return {
        "with_callbacks": with_callbacks,
        "mean_step_s": mean_s,
        "mean_step_cpu_s": cpu_s,
        "per_step_s": per_step,
        # Steady-state self time per step: the post-warm-up steps, less the finish inside the last step's end.
        "self_per_step_s": (self_time.steady_s - self_time.finish_s) / measured if with_callbacks else 0.0,
        "self_per_step_median_s": statistics.median(self_time.per_step_s) if self_time.per_step_s else 0.0,
        "warmup_self_s": self_time.warmup_s,
        "finish_s": self_time.finish_s,
        "begin_s": self_time.begin_s,
        "measured_steps": measured,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--pairs", type=int, default=6, help="A/B pairs (runs = 2 x pairs)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of each run's figure")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: least sensitive to other load on the machine)"
    )
    parser.add_argument("--json", help="also write the raw figures here")
    opts = parser.parse_args(argv)
    if opts.warmup < 1 or opts.steps < opts.warmup + 2:
        parser.error("need --warmup >= 1 and --steps >= --warmup + 2")

    import logging

    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from hfscale.workload.data import make_classification_dataset

    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(opts.threads)
    hf_logging.set_verbosity_error()
    logging.getLogger("hfscale").setLevel(logging.ERROR)

    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    dataset = make_classification_dataset(opts.batch * opts.steps, opts.seq_len)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        one_run(opts, model, dataset, False, tmp)  # warms the process (imports, allocator), not counted
        for i in range(opts.pairs):
            for with_callbacks in (False, True):
                run = one_run(opts, model, dataset, with_callbacks, tmp)
                runs.append(run)
                print(
                    f"pair {i + 1}/{opts.pairs} {'B (with)   ' if with_callbacks else 'A (without)'} "
                    f"mean step {run['mean_step_s'] * 1e3:8.2f} ms",
                    file=sys.stderr,
                )

    a = [r for r in runs if not r["with_callbacks"]]
    b = [r for r in runs if r["with_callbacks"]]
    a_mean = statistics.median(r["mean_step_s"] for r in a)
    b_mean = statistics.median(r["mean_step_s"] for r in b)
    a_median = statistics.median(t for r in a for t in r["per_step_s"])
    b_median = statistics.median(t for r in b for t in r["per_step_s"])
    paired = [(rb["mean_step_s"] - ra["mean_step_s"]) / ra["mean_step_s"] * 100 for ra, rb in zip(a, b, strict=True)]
    a_spread = (max(r["mean_step_s"] for r in a) - min(r["mean_step_s"] for r in a)) / a_mean * 100
    a_cpu = statistics.median(r["mean_step_cpu_s"] for r in a)
    b_cpu = statistics.median(r["mean_step_cpu_s"] for r in b)
    self_us = statistics.median(r["self_per_step_s"] for r in b) * 1e6
    self_median_us = statistics.median(r["self_per_step_median_s"] for r in b) * 1e6
    finish_ms = statistics.median(r["finish_s"] for r in b) * 1e3
    begin_ms = statistics.median(r["begin_s"] for r in b) * 1e3
    warmup_ms = statistics.median(r["warmup_self_s"] for r in b) * 1e3
    device_name = torch.cuda.get_device_name() if opts.device == "cuda" else "CPU"

    print(
        f"\ncallback overhead: {device_name}, tiny BERT (hidden 64, 2 layers), batch {opts.batch} x seq "
        f"{opts.seq_len}, {opts.steps} steps ({opts.warmup} warm-up), {opts.pairs} A/B pairs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} torch threads on {os.cpu_count()} CPUs"
    )
    # On CUDA the per-step figures are host-side times (no per-step synchronisation); the run means are exact.
    print(f"  median step time without callbacks: {a_median * 1e3:8.2f} ms   (median of run means {a_mean * 1e3:.2f})")
    print(f"  median step time with callbacks:    {b_median * 1e3:8.2f} ms   (median of run means {b_mean * 1e3:.2f})")
    print(f"  overhead, run means:    {(b_mean - a_mean) / a_mean * 100:+.2f} %")
    print(
        f"  overhead, process CPU time per step: {(b_cpu - a_cpu) / a_cpu * 100:+.2f} % "
        f"({a_cpu * 1e3:.2f} -> {b_cpu * 1e3:.2f} ms; less sensitive to other processes than wall time)"
    )
    print(f"  overhead, median steps: {(b_median - a_median) / a_median * 100:+.2f} %")
    print(
        f"  overhead, pairs:        median {statistics.median(paired):+.2f} %, range "
        f"[{min(paired):+.2f}, {max(paired):+.2f}] %; run-to-run spread without callbacks {a_spread:.1f} %"
    )
    print(
        f"  callbacks' own time:    {self_median_us:.1f} us per step (median; mean {self_us:.1f}) = "
        f"{self_median_us / 1e6 / a_mean * 100:.3f} % of a step ({self_us / 1e6 / a_mean * 100:.3f} % by the mean); "
        f"once per run: {begin_ms:.2f} ms at train begin, {warmup_ms:.2f} ms in the warm-up steps (memory phases), "
        f"{finish_ms:.2f} ms to finish (gather, log, JSON)"
    )
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as fh:
            json.dump({"options": vars(opts), "device_name": device_name, "runs": runs}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
