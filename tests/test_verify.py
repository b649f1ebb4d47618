"""What ran, verified: ``check`` names every way a record differs from the strategy asked for, and ``collect`` reads
a real Trainer's record (multi-process records are read in tests/test_strategies_cpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy
from hfscale.verify import LinearDtypeProbe, VerificationRecord, check, collect, count_parameters

TOTAL = 2_000_000


def record(**changes) -> VerificationRecord:
    """A record of a single-process fp32 AdamW run on CPU, with ``changes`` applied."""
    base = VerificationRecord(
        distributed_type="NO",
        world_size=1,
        device="cpu",
        mixed_precision="no",
        wrapper="none",
        wrapper_class="transformers.models.bert.modeling_bert.BertForSequenceClassification",
        params_total=TOTAL,
        params_local_per_rank=[TOTAL],
        linear_layer="bert.encoder.layer.0.attention.self.query",
        linear_output_dtype="float32",
        optimizer_class="torch.optim.adamw.AdamW",
        optimizer_wrappers=["AcceleratedOptimizer", "AdamW"],
        optimizer_state_dtypes=["float32"],
        gradient_checkpointing=False,
    )
    return dataclasses.replace(base, **changes)


BASELINE = Strategy(name="fp32", device="cpu")
FSDP2 = Strategy(name="fsdp", device="cpu", num_processes=2, fsdp=FsdpSpec())
FSDP2_RECORD = dict(
    distributed_type="FSDP",
    world_size=2,
    wrapper="FSDP2",
    wrapper_class="torch.distributed.fsdp._fully_shard._fsdp_init.FSDPBertForSequenceClassification",
    params_local_per_rank=[TOTAL // 2, TOTAL // 2],
)


def test_matching_records_have_no_mismatch():
    assert check(BASELINE, record()) == []
    assert check(FSDP2, record(**FSDP2_RECORD)) == []


def test_fsdp_asked_but_ddp_ran_is_flagged():
    """accelerate on CPU silently runs DDP for an FSDP request: the record must not pass as FSDP."""
    ddp = record(
        distributed_type="MULTI_CPU",
        world_size=2,
        wrapper="DDP",
        wrapper_class="torch.nn.parallel.distributed.DistributedDataParallel",
        params_local_per_rank=[TOTAL, TOTAL],
    )
    problems = check(FSDP2, ddp)
    text = "\n".join(problems)
    assert "accelerate ran as MULTI_CPU, expected FSDP" in text
    assert "wrapped as DDP" in text and "expected FSDP2" in text
    assert "parameters are not sharded" in text
    assert len(problems) == 3


def test_check_accepts_the_stored_dict():
    assert check(FSDP2, record(**FSDP2_RECORD).to_dict()) == []
    # A row written by a newer hfscale may carry keys this one does not know.
    assert check(BASELINE, record().to_dict() | {"new_field": 1}) == []


@pytest.mark.parametrize(
    ("strategy", "changes", "expected"),
    [
        (BASELINE.replace(precision="bf16"), {}, "produced float32, expected bfloat16"),
        (BASELINE, {"linear_output_dtype": None}, "no nn.Linear forward was observed"),
        (BASELINE.replace(optimizer="adamw_bnb_8bit"), {}, "expected uint8 states for 'adamw_bnb_8bit'"),
        (BASELINE, {"optimizer_state_dtypes": ["float32", "uint8"]}, "holds uint8 states, 'adamw_torch'"),
        (BASELINE.replace(gradient_checkpointing=True), {}, "gradient checkpointing is not active"),
        (BASELINE, {"gradient_checkpointing": True}, "gradient checkpointing is active"),
        (BASELINE, {"device": "cuda"}, "trained on 'cuda'"),
        (BASELINE.replace(num_processes=2), {}, "1 process(es) ran, 2 were asked for"),
        (BASELINE, {"params_local_per_rank": [TOTAL // 2]}, "parameters are sharded"),
    ],
)
def test_each_mismatch_is_named(strategy, changes, expected):
    problems = check(strategy, record(**changes))
    assert any(expected in p for p in problems), problems


def deepspeed_record(stage: int, **changes) -> VerificationRecord:
    fields = dict(
        distributed_type="DEEPSPEED",
        world_size=2,
        wrapper="DeepSpeedEngine",
        wrapper_class="deepspeed.runtime.engine.DeepSpeedEngine",
        zero_stage=stage,
        zero_offload_optimizer=False,
        zero_offload_param=False if stage == 3 else None,
        params_local_per_rank=[TOTAL // 2, TOTAL // 2] if stage == 3 else [TOTAL, TOTAL],
    )
    return record(**(fields | changes))


def test_deepspeed_stage_sharding_and_offload_are_checked():
    zero3 = Strategy(name="z3", device="cpu", num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=3))
    assert check(zero3, deepspeed_record(3)) == []
    wrong_stage = check(zero3, deepspeed_record(2))
    assert any("runs ZeRO stage 2, 3 was asked for" in p for p in wrong_stage)
    assert any("parameters are not sharded" in p for p in wrong_stage)

    offload = zero3.replace(deepspeed=DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"))
    problems = check(offload, deepspeed_record(3))
    assert any("ZeRO optimizer offload is False" in p for p in problems)
    assert any("ZeRO-3 parameter offload is False" in p for p in problems)
    assert any("expected DeepSpeed's CPU Adam" in p for p in problems)
    applied = deepspeed_record(
        3,
        zero_offload_optimizer=True,
        zero_offload_param=True,
        optimizer_class="deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
    )
    assert check(offload, applied) == []


def test_record_round_trips_and_reports_sharding():
    rec = record(**FSDP2_RECORD)
    again = VerificationRecord.from_dict(rec.to_dict())
    assert again == rec
    assert again.sharded and again.params_local_max == TOTAL // 2
    assert not record().sharded


def test_count_parameters_counts_tied_weights_once(tiny_gpt2):
    total, local = count_parameters(tiny_gpt2)
    assert tiny_gpt2.lm_head.weight is tiny_gpt2.transformer.wte.weight
    expected = sum(p.numel() for p in {id(p): p for p in tiny_gpt2.parameters()}.values())
    assert total == local == expected


def test_probe_records_the_autocast_dtype_of_the_first_training_forward(tiny_bert):
    probe = LinearDtypeProbe(tiny_bert)
    assert probe.layer_name == "bert.encoder.layer.0.attention.self.query"
    ids = torch.randint(100, 1000, (2, 16))
    tiny_bert.eval()
    tiny_bert(input_ids=ids)
    assert probe.output_dtype is None  # evaluation forwards are not training
    tiny_bert.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tiny_bert(input_ids=ids)
    assert probe.output_dtype == "bfloat16"
    tiny_bert(input_ids=ids)  # unhooked after the first observation
    assert probe.output_dtype == "bfloat16"


def test_collect_reads_a_trainer_run(tmp_path, tiny_bert):
    from transformers import Trainer, TrainingArguments

    from hfscale.data import make_classification_dataset

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        activation_checkpointing=True,
        disable_tqdm=True,
    )
    probe = LinearDtypeProbe(tiny_bert)
    trainer = Trainer(
        model=tiny_bert,
        args=args,
        train_dataset=make_classification_dataset(8, 16),
    )
    trainer.train()
    rec = collect(trainer, probe)
    assert rec.distributed_type == "NO"
    assert rec.world_size == 1
    assert rec.wrapper == "none"
    assert rec.params_local_per_rank == [rec.params_total]
    assert rec.params_total == sum(p.numel() for p in tiny_bert.parameters())
    assert rec.linear_output_dtype == "float32"
    assert rec.optimizer_class == "torch.optim.adamw.AdamW"
    assert rec.optimizer_wrappers[0] == "AcceleratedOptimizer"
    assert rec.optimizer_state_dtypes == ["float32"]
    assert rec.gradient_checkpointing is True
    assert check(Strategy(name="gc", device="cpu", gradient_checkpointing=True), rec) == []
