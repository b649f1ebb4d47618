"""What ran, verified: ``check`` names every way a record differs from the strategy asked for, and ``collect`` reads
a real Trainer's record (multi-process records are read in tests/scenarios/test_strategies_cpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hfscale.measure import verify
from hfscale.measure.verify import LinearDtypeProbe, VerificationRecord, check, collect, count_parameters_held
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy
from hfscale.techniques.base import Technique, TrainedRun

TOTAL = 2_000_000


def record(**changes) -> VerificationRecord:
    """A record of a single-process fp32 run of transformers 5's default optimizer (fused AdamW) on CPU, batch 8,
    with ``changes`` applied."""
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
        optimizer_implementation="fused",
        global_batch_size=8,
        gradient_checkpointing=False,
    )
    return dataclasses.replace(base, **changes)


BASELINE = Strategy(name="fp32", device="cpu")
UNFUSED_ADAMW = {"optimizer_implementation": "for-loop"}
FSDP2 = Strategy(name="fsdp", device="cpu", num_processes=2, fsdp=FsdpSpec())
FSDP2_RECORD = dict(
    distributed_type="FSDP",
    world_size=2,
    wrapper="FSDP2",
    wrapper_class="torch.distributed.fsdp._fully_shard._fsdp_init.FSDPBertForSequenceClassification",
    params_local_per_rank=[TOTAL // 2, TOTAL // 2],
    fsdp_sharding="full_shard",
    fsdp_cpu_offload=False,
    global_batch_size=16,
)


GPU_FSDP_OFFLOAD = Strategy(name="fsdp-offload", device="cuda", num_processes=2, fsdp=FsdpSpec(cpu_offload=True))


def test_matching_records_have_no_mismatch():
    assert check(BASELINE, record()) == []
    assert check(FSDP2, record(**FSDP2_RECORD)) == []
    assert check(BASELINE.replace(optimizer="adamw_torch"), record(**UNFUSED_ADAMW)) == []
    assert check(BASELINE.replace(optimizer="sgd"), record(optimizer_class="torch.optim.sgd.SGD")) == []
    offloaded = record(**FSDP2_RECORD | {"device": "cuda", "fsdp_cpu_offload": True})
    assert check(GPU_FSDP_OFFLOAD, offloaded) == []
    # A record from before these fields existed is not failed for lacking them.
    old = record(optimizer_implementation=None, global_batch_size=None)
    assert check(BASELINE, old) == []
    # FSDP2's gather dtype: the half type asked, full precision under fp32, or not read.
    half = {"mixed_precision": "bf16", "linear_output_dtype": "bfloat16"}
    bf16 = FSDP2.replace(precision="bf16")
    for dtype in ("bfloat16", None):
        assert check(bf16, record(**FSDP2_RECORD | half | {"fsdp_param_dtype": dtype})) == []
    assert check(FSDP2, record(**FSDP2_RECORD | {"fsdp_param_dtype": "float32"})) == []


def test_fsdp_asked_but_ddp_ran_is_flagged():
    """accelerate on CPU silently runs DDP for an FSDP request: the record must not pass as FSDP."""
    ddp = record(
        distributed_type="MULTI_CPU",
        world_size=2,
        wrapper="DDP",
        wrapper_class="torch.nn.parallel.distributed.DistributedDataParallel",
        params_local_per_rank=[TOTAL, TOTAL],
        global_batch_size=16,
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
        (BASELINE, {"optimizer_state_dtypes": ["float32", "uint8"]}, "holds uint8 states, 'adamw_torch_fused'"),
        (BASELINE.replace(gradient_checkpointing=True), {}, "gradient checkpointing is not active"),
        (BASELINE, {"gradient_checkpointing": True}, "gradient checkpointing is active"),
        (BASELINE, {"device": "cuda"}, "trained on 'cuda'"),
        (BASELINE.replace(num_processes=2), {}, "1 process(es) ran, 2 were asked for"),
        (BASELINE, {"params_local_per_rank": [TOTAL // 2]}, "parameters are sharded"),
        # What the audit found passing unchecked (issue 11, item 4):
        (BASELINE.replace(optimizer="adafactor"), UNFUSED_ADAMW, "torch.optim.adamw.AdamW ran, 'adafactor' builds"),
        (BASELINE.replace(optimizer="sgd"), UNFUSED_ADAMW, "torch.optim.adamw.AdamW ran, 'sgd' builds torch.optim"),
        (BASELINE.replace(optimizer="adamw_torch_fused"), UNFUSED_ADAMW, "runs its for-loop kernel, 'adamw_torch_f"),
        (BASELINE, UNFUSED_ADAMW, "runs its for-loop kernel, 'adamw_torch_fused' asks for fused"),
        (BASELINE.replace(optimizer="adamw_torch"), {}, "runs its fused kernel, 'adamw_torch' is the unfused one"),
        (BASELINE.replace(precision="bf16"), {"linear_output_dtype": "bfloat16"}, "mixed_precision='no', expected 'bf"),
        (BASELINE, {"mixed_precision": "fp16"}, "mixed_precision='fp16', expected 'no' for precision 'fp32'"),
        (BASELINE, {"global_batch_size": 4}, "4 samples per optimizer step across ranks ran, 8 were asked for"),
        (FSDP2, FSDP2_RECORD | {"fsdp_sharding": "shard_grad_op"}, "FSDP runs shard_grad_op, fsdp.sharding='full_sh"),
        (
            FSDP2.replace(fsdp=FsdpSpec(sharding="shard_grad_op")),
            FSDP2_RECORD,
            "FSDP runs full_shard, fsdp.sharding='shard_grad_op' was asked for",
        ),
        (
            GPU_FSDP_OFFLOAD,
            FSDP2_RECORD | {"device": "cuda"},
            "FSDP CPU offload is False, fsdp.cpu_offload=True was asked for",
        ),
        (
            FSDP2.replace(precision="bf16"),
            FSDP2_RECORD | {"fsdp_param_dtype": "float32"},
            "FSDP2 gathers the parameters in float32, not bfloat16: precision bf16 runs as autocast alone",
        ),
        (
            FSDP2.replace(precision="bf16"),
            FSDP2_RECORD | {"fsdp_param_dtype": "bfloat16,float32"},
            "FSDP2 gathers the parameters in bfloat16,float32, not bfloat16 alone: some units gather another dtype",
        ),
    ],
)
def test_each_mismatch_is_named(strategy, changes, expected):
    problems = check(strategy, record(**changes))
    assert any(expected in p for p in problems), problems


class Says(Technique):
    """A technique that reads ``fields`` and finds ``problem`` whatever ran."""

    def __init__(self, name: str, problem: str, fields: dict | None = None) -> None:
        self.name, self.problem, self.fields = name, problem, fields or {}

    def collect(self, run: TrainedRun) -> dict:
        return self.fields

    def check(self, strategy: Strategy, record: VerificationRecord) -> list[str]:
        return [self.problem]


def test_each_registered_technique_is_checked_in_turn_after_the_optimizer_and_before_the_batch(monkeypatch):
    monkeypatch.setattr(verify, "TECHNIQUES", (Says("first", "first technique"), Says("second", "second technique")))
    problems = check(BASELINE, record(optimizer_state_dtypes=["uint8"], global_batch_size=99))
    assert len(problems) == 4
    assert "holds uint8 states" in problems[0]
    assert problems[1:3] == ["first technique", "second technique"]
    assert "99 samples per optimizer step" in problems[3]


def test_two_techniques_cannot_read_one_field(monkeypatch):
    claims = (Says("one", "", {"compiled": True}), Says("other", "", {"compiled": False}))
    monkeypatch.setattr(verify, "TECHNIQUES", claims)
    with pytest.raises(RuntimeError, match=r"technique 'other' reads \['compiled'\], already read by another"):
        verify._technique_fields(TrainedRun(trainer=None, world_size=1))  # type: ignore[arg-type]


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
        global_batch_size=16,
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


def gpt2_parameters(*, vocab: int, positions: int, hidden: int, layers: int) -> int:
    """GPT-2's parameter count from its architecture (tied head: no separate output matrix)."""
    per_layer = (
        2 * hidden  # ln_1
        + hidden * 3 * hidden
        + 3 * hidden  # c_attn (q, k, v)
        + hidden * hidden
        + hidden  # attention c_proj
        + 2 * hidden  # ln_2
        + hidden * 4 * hidden
        + 4 * hidden  # mlp c_fc
        + 4 * hidden * hidden
        + hidden  # mlp c_proj
    )
    return vocab * hidden + positions * hidden + layers * per_layer + 2 * hidden  # wte, wpe, blocks, ln_f


def bert_classifier_parameters(
    *, vocab: int, positions: int, hidden: int, layers: int, intermediate: int, labels: int, token_types: int = 2
) -> int:
    """BertForSequenceClassification's parameter count from its architecture."""
    embeddings = (vocab + positions + token_types) * hidden + 2 * hidden
    per_layer = (
        4 * (hidden * hidden + hidden)  # query, key, value, attention output
        + 2 * hidden  # attention LayerNorm
        + hidden * intermediate
        + intermediate  # intermediate
        + intermediate * hidden
        + hidden  # output
        + 2 * hidden  # output LayerNorm
    )
    pooler = hidden * hidden + hidden
    return embeddings + layers * per_layer + pooler + hidden * labels + labels


def test_count_parameters_held_counts_tied_weights_once(tiny_gpt2):
    total, local = count_parameters_held(tiny_gpt2)
    assert tiny_gpt2.lm_head.weight is tiny_gpt2.transformer.wte.weight
    expected = gpt2_parameters(vocab=30522, positions=512, hidden=64, layers=2)
    assert expected == 2_086_272  # 30522 x 64 + 512 x 64 + 2 x 49,984 + 128
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

    from hfscale.workload.data import make_classification_dataset

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
    assert rec.params_total == bert_classifier_parameters(
        vocab=30522, positions=512, hidden=64, layers=2, intermediate=128, labels=2
    )
    assert rec.linear_output_dtype == "float32"
    assert rec.mixed_precision == "no"
    assert rec.optimizer_class == "torch.optim.adamw.AdamW"
    assert rec.optimizer_implementation == "fused"  # transformers 5's default, adamw_torch_fused
    assert rec.optimizer_wrappers[0] == "AcceleratedOptimizer"
    assert rec.optimizer_state_dtypes == ["float32"]
    assert rec.global_batch_size == 2
    assert rec.fsdp_sharding is None and rec.fsdp_cpu_offload is None
    assert rec.gradient_checkpointing is True
    asked = Strategy(name="gc", device="cpu", gradient_checkpointing=True, per_device_batch_size=2)
    assert check(asked, rec) == []
    assert any("8 were asked for" in p for p in check(asked.replace(per_device_batch_size=8), rec))


def test_collect_reads_an_unfused_adamw(tmp_path, tiny_bert):
    """``optim="adamw_torch"`` runs AdamW's for-loop kernel on CPU: a fused request must not pass on it."""
    from transformers import Trainer, TrainingArguments

    from hfscale.workload.data import make_classification_dataset

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        optim="adamw_torch",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=tiny_bert, args=args, train_dataset=make_classification_dataset(8, 16))
    trainer.train()
    rec = collect(trainer, None)
    assert rec.optimizer_class == "torch.optim.adamw.AdamW"
    assert rec.optimizer_implementation in ("for-loop", "foreach")
    assert rec.global_batch_size == 4
    unfused = Strategy(name="a", device="cpu", optimizer="adamw_torch", per_device_batch_size=2)
    asked = unfused.replace(gradient_accumulation_steps=2)
    problems = check(asked, rec)
    assert problems == ["no nn.Linear forward was observed, so the compute precision is unverified"]
    assert any("asks for fused" in p for p in check(asked.replace(optimizer="adamw_torch_fused"), rec))
