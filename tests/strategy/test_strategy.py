"""Strategy validation: every contradiction is refused when the strategy is built, with a message naming why."""

from __future__ import annotations

from typing import Any

import pytest

from hfscale.strategy import (
    CompileSpec,
    DeepSpeedSpec,
    FsdpSpec,
    LoraSpec,
    ParallelismSpec,
    Strategy,
    StrategyError,
    precision_from_flags,
)


def ds(**kw: Any) -> DeepSpeedSpec:
    return DeepSpeedSpec(**kw)


def fsdp(**kw: Any) -> FsdpSpec:
    return FsdpSpec(**kw)


# (id, builder, the part of the message a user reads)
CONTRADICTIONS: list[tuple[str, Any, str]] = [
    # -- choices and ranges --------------------------------------------------------------------------------
    ("bad_device", lambda: Strategy(device="tpu"), r"strategy\.device: expected one of 'cuda', 'cpu', got 'tpu'"),
    ("bad_precision", lambda: Strategy(precision="fp8"), r"strategy\.precision: expected one of .*got 'fp8'"),
    ("bad_optimizer", lambda: Strategy(optimizer="lion"), r"strategy\.optimizer: expected one of .*got 'lion'"),
    ("zero_batch", lambda: Strategy(per_device_batch_size=0), r"per_device_batch_size: expected a positive integer"),
    ("bool_batch", lambda: Strategy(gradient_accumulation_steps=True), r"gradient_accumulation_steps: expected a"),
    ("bad_ckpt", lambda: Strategy(gradient_checkpointing="yes"), r"gradient_checkpointing: expected true or false"),
    ("bad_name", lambda: Strategy(name="a/b"), r"strategy\.name: 'a/b' must be"),
    ("bad_zero_stage", lambda: ds(zero_stage=4), r"deepspeed\.zero_stage: expected one of 0, 1, 2, 3, got 4"),
    ("bad_offload", lambda: ds(offload_param="disk"), r"deepspeed\.offload_param: expected one of"),
    ("bad_sharding", lambda: fsdp(sharding="zero3"), r"fsdp\.sharding: expected one of"),
    ("bad_fsdp_version", lambda: fsdp(version=3), r"fsdp\.version: expected one of 1, 2, got 3"),
    # -- two fields that contradict each other ---------------------------------------------------------------
    ("fp16_and_bf16", lambda: precision_from_flags(fp16=True, bf16=True), r"fp16 and bf16 are both set"),
    (
        "deepspeed_and_fsdp",
        lambda: Strategy(deepspeed=ds(), fsdp=fsdp()),
        r"strategy\.deepspeed and strategy\.fsdp are both set",
    ),
    (
        "param_offload_below_stage3",
        lambda: ds(zero_stage=2, offload_param="cpu"),
        r"deepspeed\.offload_param='cpu' needs deepspeed\.zero_stage=3, got 2",
    ),
    (
        "offload_at_stage0",
        lambda: ds(zero_stage=0, offload_optimizer="cpu"),
        r"deepspeed\.offload_optimizer='cpu' needs deepspeed\.zero_stage 1, 2 or 3, got 0",
    ),
    (
        "nvme_without_path",
        lambda: ds(zero_stage=3, offload_param="nvme"),
        r"deepspeed\.nvme_path is required when an offload device is 'nvme'",
    ),
    (
        "nvme_optimizer_below_stage3",
        lambda: ds(zero_stage=2, offload_optimizer="nvme", nvme_path="/nvme"),
        r"deepspeed\.offload_optimizer='nvme' needs deepspeed\.zero_stage=3, got 2: ZeRO-1/2 silently keep",
    ),
    (
        "fp16_on_cpu",
        lambda: Strategy(device="cpu", precision="fp16"),
        r"strategy\.precision='fp16' with strategy\.device='cpu'",
    ),
    (
        "fsdp1_on_cpu",
        lambda: Strategy(device="cpu", num_processes=2, fsdp=fsdp(version=1)),
        r"fsdp\.version=1 with strategy\.device='cpu': FSDP1 needs an accelerator",
    ),
    (
        "fsdp_cpu_offload_on_cpu",
        lambda: Strategy(device="cpu", num_processes=2, fsdp=fsdp(cpu_offload=True)),
        r"fsdp\.cpu_offload=True with strategy\.device='cpu'.*pins host memory",
    ),
    (
        "eight_bit_with_ds_offload",
        lambda: Strategy(optimizer="adamw_bnb_8bit", deepspeed=ds(zero_stage=2, offload_optimizer="cpu")),
        r"strategy\.optimizer='adamw_bnb_8bit' with deepspeed\.offload_optimizer='cpu'.*8-bit states would never",
    ),
    (
        "sgd_with_ds_offload",
        lambda: Strategy(optimizer="sgd", deepspeed=ds(zero_stage=3, offload_optimizer="cpu")),
        r"strategy\.optimizer='sgd' with deepspeed\.offload_optimizer='cpu': ZeRO-Offload runs DeepSpeed's own",
    ),
    (
        "adafactor_with_ds_offload",
        lambda: Strategy(optimizer="adafactor", deepspeed=ds(zero_stage=1, offload_optimizer="cpu")),
        r"strategy\.optimizer='adafactor' with deepspeed\.offload_optimizer='cpu'",
    ),
    (
        "hybrid_shard_one_machine",
        lambda: Strategy(num_processes=4, fsdp=fsdp(sharding="hybrid_shard")),
        r"fsdp\.sharding='hybrid_shard' needs strategy\.num_machines >= 2",
    ),
    (
        "hybrid_shard_one_process_per_machine",
        lambda: Strategy(num_processes=2, num_machines=2, fsdp=fsdp(sharding="hybrid_shard")),
        r"hybrid_shard' with strategy\.num_processes=2 on strategy\.num_machines=2: one process per machine",
    ),
    (
        "fsdp2_no_shard",
        lambda: fsdp(sharding="no_shard", version=2),
        r"fsdp\.sharding='no_shard' with fsdp\.version=2: FSDP2 has no unsharded mode",
    ),
    (
        "layer_cls_without_auto_wrap",
        lambda: fsdp(auto_wrap="none", transformer_layer_cls="BertLayer"),
        r"fsdp\.transformer_layer_cls is set but fsdp\.auto_wrap is 'none'",
    ),
    (
        "processes_not_multiple_of_machines",
        lambda: Strategy(num_processes=3, num_machines=2),
        r"strategy\.num_processes=3 is not a multiple of strategy\.num_machines=2",
    ),
]


@pytest.mark.parametrize(("build", "match"), [c[1:] for c in CONTRADICTIONS], ids=[c[0] for c in CONTRADICTIONS])
def test_contradiction_is_refused(build: Any, match: str) -> None:
    with pytest.raises(StrategyError, match=match):
        build()


def test_strategy_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="both set"):
        Strategy(deepspeed=ds(), fsdp=fsdp())


VALID: list[Strategy] = [
    Strategy(),
    Strategy(device="cpu", precision="bf16", gradient_checkpointing=True, optimizer="adamw_bnb_8bit"),
    Strategy(device="cpu", num_processes=2, deepspeed=ds(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")),
    Strategy(precision="fp16", deepspeed=ds(zero_stage=3, offload_optimizer="nvme", nvme_path="/nvme")),
    Strategy(optimizer="sgd", deepspeed=ds(zero_stage=2)),
    Strategy(device="cpu", num_processes=2, fsdp=fsdp(sharding="shard_grad_op")),
    Strategy(num_processes=8, num_machines=2, fsdp=fsdp(sharding="hybrid_shard")),
    Strategy(num_processes=2, fsdp=fsdp(sharding="no_shard", version=1, cpu_offload=True)),
]


@pytest.mark.parametrize("strategy", VALID, ids=lambda s: s.describe())
def test_valid_strategy_round_trips(strategy: Strategy) -> None:
    assert Strategy.from_dict(strategy.to_dict()) == strategy


def test_from_dict_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(StrategyError, match=r"deepspeed: unknown key\(s\) stage; valid keys are"):
        Strategy.from_dict({"deepspeed": {"stage": 2}})
    with pytest.raises(StrategyError, match=r"strategy: unknown key\(s\) zero; valid keys are"):
        Strategy.from_dict({"zero": 2})


def test_precision_from_flags() -> None:
    assert precision_from_flags() == "fp32"
    assert precision_from_flags(fp16=True) == "fp16"
    assert precision_from_flags(bf16=True) == "bf16"


def test_describe_and_global_batch() -> None:
    s = Strategy(
        precision="bf16",
        per_device_batch_size=4,
        gradient_accumulation_steps=2,
        num_processes=4,
        deepspeed=ds(zero_stage=3, offload_optimizer="cpu"),
    )
    assert s.global_batch_size == 32
    assert s.describe() == "bf16, default optimizer, ZeRO-3 offload(opt->cpu), bs 4 x acc 2 x 4 proc"
    assert s.replace(optimizer="adamw_torch").describe().startswith("bf16, adamw_torch, ZeRO-3")


def test_unset_optimizer_is_the_installed_trainers_default() -> None:
    """A user who names no optimizer gets TrainingArguments' default (adamw_torch_fused in transformers 5): the
    baseline must be that, read from the installed version, not a name hfscale picked."""
    from transformers import TrainingArguments

    trainer_default = TrainingArguments(output_dir="unused", use_cpu=True).optim.value
    assert Strategy().optimizer is None
    assert Strategy().resolved_optimizer == trainer_default
    assert Strategy(optimizer="adamw_torch").resolved_optimizer == "adamw_torch"
    assert Strategy.from_dict(Strategy().to_dict()) == Strategy()


# -- the techniques of 0.3: each contradiction names its fields ---------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"device": "cpu", "tf32": True}, r"strategy.tf32=True with strategy.device='cpu'"),
        ({"device": "cpu", "use_liger_kernel": True}, r"use_liger_kernel=True with strategy.device='cpu'"),
        (
            {"device": "cpu", "attn_implementation": "flash_attention_2", "precision": "bf16"},
            r"flash_attention_2' with strategy.device='cpu'",
        ),
        ({"attn_implementation": "flash_attention_2"}, r"flash_attention_2' with strategy.precision='fp32'"),
        ({"attn_implementation": "flash"}, r"strategy.attn_implementation: expected one of 'eager'"),
        ({"tf32": True, "precision": "fp16"}, r"strategy.tf32=True with strategy.precision='fp16'"),
        ({"deepspeed": DeepSpeedSpec(cpu_checkpointing=True)}, r"need strategy.gradient_checkpointing=True"),
        ({"data_parallel": "dp", "device": "cpu", "num_processes": 2}, r"data_parallel='dp' with strategy.device"),
        ({"data_parallel": "dp", "num_processes": 1}, r"data_parallel='dp' needs strategy.num_processes >= 2"),
        (
            {"data_parallel": "dp", "num_processes": 2, "deepspeed": DeepSpeedSpec()},
            r"data_parallel='dp' with deepspeed/fsdp/parallelism",
        ),
        ({"data_parallel": "torchrun"}, r"strategy.data_parallel: expected one of 'ddp', 'dp'"),
        ({"num_processes": 4, "parallelism": {"tp": 2}}, r"= 2, but strategy.num_processes=4"),
        ({"num_processes": 2, "parallelism": {"sp": 2}}, r"parallelism.sp > 1 needs strategy.deepspeed"),
        ({"num_processes": 2, "parallelism": {"dp_shard": 2}}, r"dp_shard/cp > 1 need strategy.fsdp with version 2"),
        ({"lora": {"quantize_base": "4bit"}, "deepspeed": DeepSpeedSpec()}, r"lora.quantize_base='4bit' with"),
        (
            {"data_parallel": "dp", "num_processes": 2, "lora": {"quantize_base": "4bit"}},
            r"data_parallel='dp' with lora.quantize_base='4bit'",
        ),
        (
            {"num_processes": 2, "fsdp": FsdpSpec(version=1), "parallelism": {"tp": 2}},
            r"parallelism with fsdp.version=1",
        ),
        ({"num_processes": 2, "fsdp": FsdpSpec(), "parallelism": {"tp": 2}}, r"needs dp_shard or cp > 1"),
        ({"num_processes": 2, "fsdp": FsdpSpec(), "parallelism": {"dp_replicate": 2}}, r"needs dp_shard or cp > 1"),
        ({"num_processes": 2, "deepspeed": DeepSpeedSpec(), "parallelism": {"tp": 2}}, r"tp/cp > 1 with strategy"),
        (
            {"activation_offload": True, "data_parallel": "dp", "num_processes": 2},
            r"activation_offload=True with strategy.data_parallel='dp'",
        ),
        (
            {"device": "cpu", "gradient_checkpointing": True, "deepspeed": DeepSpeedSpec(cpu_checkpointing=True)},
            r"cpu_checkpointing without deepspeed.partition_activations on strategy.device='cpu'",
        ),
    ],
)
def test_technique_contradictions_are_refused(fields: dict[str, Any], match: str) -> None:
    fields = dict(fields)
    if isinstance(fields.get("parallelism"), dict):
        fields["parallelism"] = ParallelismSpec(**fields["parallelism"])
    if isinstance(fields.get("lora"), dict):
        fields["lora"] = LoraSpec(**fields["lora"])
    with pytest.raises(StrategyError, match=match):
        Strategy(**fields)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: LoraSpec(rank=0), r"lora.rank: expected a positive"),
        (lambda: LoraSpec(dropout=1.0), r"lora.dropout: expected a number"),
        (
            lambda: LoraSpec(target_modules=[]),
            r"lora.target_modules: expected a non-empty list",
        ),
        (
            lambda: CompileSpec(backend="eager", mode="max-autotune"),
            r"torch_compile.mode='max-autotune' with torch_compile.backend='eager'",
        ),
        (
            lambda: ParallelismSpec(tp=0),
            r"parallelism.tp: expected a positive integer",
        ),
    ],
)
def test_technique_specs_validate_their_fields(build: Any, match: str) -> None:
    with pytest.raises(StrategyError, match=match):
        build()


def test_technique_strategies_round_trip_and_describe_themselves() -> None:
    s = Strategy(
        precision="bf16",
        attn_implementation="sdpa",
        torch_compile=CompileSpec(mode="max-autotune"),
        tf32=True,
        lora=LoraSpec(rank=16, quantize_base="4bit", target_modules=("q_proj", "v_proj")),
        activation_offload=True,
    )
    assert Strategy.from_dict(s.to_dict()) == s
    assert s.describe() == (
        "bf16, default optimizer, attn sdpa, compile inductor/max-autotune, tf32, act-offload, QLoRA r16, bs 8 x acc 1"
    )
    dp = Strategy(data_parallel="dp", num_processes=4)
    assert (dp.world_size, dp.distributed, dp.global_batch_size) == (1, False, 32)
    assert "DataParallel x 4 GPU" in dp.describe()
    mesh = Strategy(num_processes=4, fsdp=FsdpSpec(), parallelism=ParallelismSpec(dp_shard=2, tp=2))
    assert mesh.parallelism.mesh() == {"dp_shard": 2, "tp": 2}
    assert "mesh dp_shard 2 x tp 2" in mesh.describe()
    assert Strategy.from_dict(mesh.to_dict()) == mesh
