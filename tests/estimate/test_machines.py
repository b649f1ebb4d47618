"""hfscale.estimate across machines: which processes share one copy of the model states.

Expected figures are derived by hand from N (parameter elements of the model) in each test: bf16 with
``adamw_torch`` on CUDA keeps 8 bytes of Adam state per element (exp_avg + exp_avg_sq in fp32, the step on the
host), FSDP keeps fp32 shards of weights, gradients and states, DeepSpeed ZeRO-3 keeps a 16-bit weight partition
(2N/g), an fp32 gradient partition (4N/g) and fp32 master weights with the Adam states ((4N + 8N)/g): 18N/g, the
figure of DeepSpeed's own estimator.
"""

from __future__ import annotations

import pytest

from hfscale.commands.estimate import default_strategies
from hfscale.core.units import GIB
from hfscale.estimate import describe_model, estimate_memory
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, ParallelismSpec, Strategy
from hfscale.workload.spec import ModelSpec

BERT_64 = ModelSpec(type="bert", config={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2})


def _bf16(**kw) -> Strategy:
    return Strategy(precision="bf16", optimizer="adamw_torch", device="cuda", **kw)


def _states_bytes(strategy: Strategy) -> tuple[float, float, float]:
    est = estimate_memory(describe_model(BERT_64), strategy, seq_len=32)
    return est.weights_gib * GIB, est.gradients_gib * GIB, est.optimizer_gib * GIB


def test_hsdp_on_two_machines_shards_over_one_machine_zero3_over_all():
    """2 machines x 2 processes. HSDP shards within a machine (group of 2) and replicates across the two, so each
    fp32 term is 1/2 of the unsharded one: weights 4N/2, gradients 4N/2, Adam 8N/2. ZeRO-3 and FSDP full_shard
    shard over all 4 processes whatever the machines: ZeRO-3 holds 2N/4, 4N/4, 12N/4 (18N/4 in all); FSDP 4N/4,
    4N/4, 8N/4."""
    n = describe_model(BERT_64).num_params
    hsdp = _states_bytes(_bf16(num_processes=4, num_machines=2, fsdp=FsdpSpec(sharding="hybrid_shard")))
    assert hsdp == pytest.approx((4 * n / 2, 4 * n / 2, 8 * n / 2))

    zero3 = _states_bytes(_bf16(num_processes=4, num_machines=2, deepspeed=DeepSpeedSpec(zero_stage=3)))
    assert zero3 == pytest.approx((2 * n / 4, 4 * n / 4, 12 * n / 4))
    assert sum(zero3) == pytest.approx(18 * n / 4)
    # the machines do not change ZeRO's partition: the same as 4 processes on one machine
    assert zero3 == pytest.approx(_states_bytes(_bf16(num_processes=4, deepspeed=DeepSpeedSpec(zero_stage=3))))

    full = _states_bytes(_bf16(num_processes=4, num_machines=2, fsdp=FsdpSpec()))
    assert full == pytest.approx((4 * n / 4, 4 * n / 4, 8 * n / 4))


def test_zero2_across_machines_partitions_over_every_process():
    """ZeRO-2 on 2 x 2: 16-bit weights whole (2N), 16-bit + fp32 gradients partitioned ((2N + 4N)/4), master
    weights + Adam partitioned ((4N + 8N)/4)."""
    n = describe_model(BERT_64).num_params
    zero2 = _states_bytes(_bf16(num_processes=4, num_machines=2, deepspeed=DeepSpeedSpec(zero_stage=2)))
    assert zero2 == pytest.approx((2 * n, 6 * n / 4, 12 * n / 4))


def test_explicit_mesh_replicates_over_dp_replicate():
    """A device mesh dp_replicate 2 x dp_shard 2 under FSDP2 full_shard is HSDP (accelerate shards over dp_shard
    x cp, replicates over dp_replicate): each term is 1/2 of the unsharded one (4N/2, 4N/2, 8N/2). The estimate
    used to shard over all 4 processes (1/4), under-estimating by half the model states."""
    n = describe_model(BERT_64).num_params
    mesh = _bf16(
        num_processes=4,
        num_machines=2,
        fsdp=FsdpSpec(),
        parallelism=ParallelismSpec(dp_replicate=2, dp_shard=2),
    )
    assert _states_bytes(mesh) == pytest.approx((4 * n / 2, 4 * n / 2, 8 * n / 2))
    with_cp = _bf16(num_processes=4, fsdp=FsdpSpec(), parallelism=ParallelismSpec(dp_shard=2, cp=2))
    assert _states_bytes(with_cp) == pytest.approx((4 * n / 4, 4 * n / 4, 8 * n / 4))
    est = estimate_memory(describe_model(BERT_64), with_cp, seq_len=32)
    assert any("not modelled" in note for note in est.notes)


def test_data_parallel_keeps_no_ddp_buckets():
    """nn.DataParallel runs in one process (world size 1): no DDP reducer, so no bucket bytes (4N under DDP)."""
    n = describe_model(BERT_64).num_params
    shape = describe_model(BERT_64)
    ddp = estimate_memory(shape, _bf16(num_processes=2), seq_len=32)
    dp = estimate_memory(shape, _bf16(num_processes=2, data_parallel="dp"), seq_len=32)
    assert ddp.overhead_parts_gib["ddp_buckets"] * GIB == pytest.approx(4 * n)
    assert "ddp_buckets" not in dp.overhead_parts_gib


def test_default_strategies_add_hsdp_on_several_machines():
    names = [s.name for s in default_strategies(num_gpus=4, num_machines=2)]
    assert "bf16-hsdp" in names
    hsdp = next(s for s in default_strategies(num_gpus=4, num_machines=2) if s.name == "bf16-hsdp")
    assert hsdp.fsdp is not None and hsdp.fsdp.sharding == "hybrid_shard" and hsdp.num_machines == 2
    assert "bf16-hsdp" not in [s.name for s in default_strategies(num_gpus=4)]
    # one process per machine leaves nothing to shard within a machine
    assert "bf16-hsdp" not in [s.name for s in default_strategies(num_gpus=2, num_machines=2)]
