"""Train a tiny BERT with hfscale's callbacks inside whatever process group launched this script.

Launched by tests/test_callbacks.py as ``accelerate launch --multi_gpu --num_processes 2 ... THIS --out DIR`` (DDP
on CPU with ``use_cpu=True``), or as one plain process with ``--deepspeed STAGE`` (RANK/WORLD_SIZE/MASTER_* set).
Every rank writes ``DIR/rank{R}.json`` with what it saw (its own summaries, the wrapper class and world size that
really ran, its RSS high-water mark after training); the main process also writes the callbacks' own JSON
(``memory.json``, ``throughput.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_BERT = dict(
    vocab_size=30522,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    num_labels=2,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--deepspeed", type=int, choices=(0, 1, 2, 3), help="train under DeepSpeed ZeRO at this stage")
    opts = parser.parse_args(argv)
    out = Path(opts.out)

    import torch.distributed as dist
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from hfscale.callbacks import MemoryCallback, ThroughputCallback
    from hfscale.core.units import GIB
    from hfscale.measure.memory import cpu_peak_rss_bytes
    from hfscale.workload.data import make_classification_dataset

    model = BertForSequenceClassification(BertConfig(**TINY_BERT))
    dataset = make_classification_dataset(opts.batch * opts.steps * 4, opts.seq_len)
    deepspeed = None
    if opts.deepspeed is not None:
        deepspeed = {
            "zero_optimization": {"stage": opts.deepspeed},
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        }
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        deepspeed=deepspeed,
        gradient_accumulation_steps=opts.accumulation,
        per_device_train_batch_size=opts.batch,
        max_steps=opts.steps,
        logging_steps=opts.steps // 2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    memory = MemoryCallback(output_path=out / "memory.json")
    throughput = ThroughputCallback(opts.warmup, output_path=out / "throughput.json")
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[memory, throughput])
    trainer.train()

    record = {
        "rank": args.process_index,
        "args_world_size": args.world_size,
        "dist_initialized": dist.is_initialized(),
        "dist_world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "dist_backend": dist.get_backend() if dist.is_initialized() else None,
        "wrapper": type(trainer.model_wrapped).__name__,
        "vmhwm_after_gib": cpu_peak_rss_bytes() / GIB,
        "memory": memory.summary.to_dict(),
        "throughput": throughput.summary.to_dict(),
        "log_history": trainer.state.log_history,
    }
    (out / f"rank{args.process_index}.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    # End the process group once every rank has written its record: its Gloo threads otherwise race the interpreter's
    # teardown (helpers.teardown; a rank aborted so in a fresh-clone CI run of this script, 2026-11-28).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
