"""A user's own training script, written as the transformers examples are: TrainingArguments first, then the model,
then the Trainer with hfscale's MemoryCallback and ThroughputCallback added. It takes the files ``hfscale config --out
CFG`` wrote and adds exactly the lines it printed.

Launched by tests/scenarios/test_user_configs.py with the printed command:
``accelerate launch --config_file CFG/accelerate.yaml THIS CFG OUT [--fsdp2-on-cpu]``. ``--fsdp2-on-cpu`` runs the
extra line ``hfscale config`` prints for FSDP on CPU (the test passes it only when the line was printed). The
callbacks write ``OUT/memory.json`` and ``OUT/throughput.json`` (gathered over the ranks); after training every rank
writes ``OUT/rank{R}.json``: the Trainer's log history (with the ``verify/`` record), the callbacks' summaries as that
rank holds them, the process group that really ran, and the process's resident high-water mark.
"""

from __future__ import annotations

import json
import os
import sys

cfg, out = sys.argv[1], sys.argv[2]
# fmt: off
if "--fsdp2-on-cpu" in sys.argv[3:]:
    import hfscale.techniques.fsdp_cpu; hfscale.techniques.fsdp_cpu.enable_fsdp2_on_cpu()  # noqa: E702, I001 - the printed line, verbatim
# fmt: on

from transformers import AutoConfig, AutoModelForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from hfscale.callbacks import MemoryCallback, ThroughputCallback  # noqa: E402
from hfscale.workload.data import make_classification_dataset  # noqa: E402

STEPS, WARMUP = 6, 2

args = TrainingArguments(
    output_dir=os.path.join(out, "trainer"),
    max_steps=STEPS,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    dataloader_pin_memory=False,
    **json.load(open(os.path.join(cfg, "training_args.json"))),  # noqa: SIM115 - as the printed line has it
)
config = AutoConfig.for_model(
    "bert",
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
    num_labels=2,
)
model = AutoModelForSequenceClassification.from_config(config)
train_dataset = make_classification_dataset(256, 32, token_high=1000)
memory = MemoryCallback(output_path=os.path.join(out, "memory.json"))
throughput = ThroughputCallback(WARMUP, output_path=os.path.join(out, "throughput.json"))
trainer = Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[memory, throughput])
# fmt: off
from hfscale.callbacks import VerificationCallback, attach; attach(trainer, VerificationCallback(cfg))  # noqa: E402, E702, I001
# fmt: on
trainer.train()

import torch.distributed as dist  # noqa: E402

from hfscale.core.units import GIB  # noqa: E402
from hfscale.measure.memory import cpu_peak_rss_bytes  # noqa: E402

record = {
    "rank": args.process_index,
    "max_steps": STEPS,
    "warmup_steps": WARMUP,
    "dist_world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
    "vmhwm_after_gib": cpu_peak_rss_bytes() / GIB,
    "memory": memory.summary.to_dict(),
    "throughput": throughput.summary.to_dict(),
    "log_history": trainer.state.log_history,
}
with open(os.path.join(out, f"rank{args.process_index}.json"), "w") as fh:
    json.dump(record, fh, indent=2)

# End the process group before the interpreter exits, once every rank has written its file: its background threads
# otherwise race the teardown ("terminate called without an active exception", seen in 2-process FSDP2 runs on CPU),
# and a rank aborting at exit makes the launcher end the others.
if dist.is_available() and dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
