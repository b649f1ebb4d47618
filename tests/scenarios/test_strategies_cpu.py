"""Strategies launched as the sweep launches them, where the trial's own path differs from a user's script (the
model built before TrainingArguments, FSDP2 switched on for CPU, the blocks FSDP wraps named by the runner), and the
fp32 loss curves of strategies that must train the same model. The same verification of every CPU configuration
through the generated configs in a user-style script (bf16, 8-bit, ZeRO 1/2/3 and offload, DDP, FSDP2) is in
``test_user_configs.py``; GPU-only strategies are written here too and skipped without a GPU.

Each test is one trial in a fresh process group: ``write_configs`` writes accelerate.yaml, deepspeed.json and
training_args.json, and ``accelerate launch --config_file accelerate.yaml -m hfscale.trial spec.json --result
result.json`` runs it. Tiny BERT (hidden 64, 2 layers), 64-token sequences, 4 optimizer steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.runs import launch_as_sweep

from hfscale.measure.verify import check
from hfscale.records.row import TrialOutcome
from hfscale.strategy import FsdpSpec, Strategy

STEPS = 4
# First DeepSpeed use JIT-builds its CPU ops (about 2 minutes, cached under TORCH_EXTENSIONS_DIR).
LAUNCH_TIMEOUT_S = 600


def launch(tmp_path: Path, strategy: Strategy) -> TrialOutcome:
    """Run one trial as the sweep does and return its result; fail with the trial's stderr if it did not run."""
    outcome = launch_as_sweep(tmp_path, strategy, steps=STEPS)
    # The runner's own check agrees with a fresh one on the stored record.
    assert check(strategy, outcome.verification) == []
    return outcome


# -- one process ---------------------------------------------------------------------------------------------------


def _shared(tiny_sweep_run, trial: str) -> TrialOutcome:
    """One run of the session's shared tiny sweep (conftest), launched by the sweep as every trial is."""
    from hfscale.results.run_folder import RunFolder

    row = {r.key: r for r in RunFolder(tiny_sweep_run).rows()}[trial, 0]
    assert row.status == "ok", (row.reason, row.stderr_tail)
    return row.measured


def test_fp32(tiny_sweep_run):
    v = _shared(tiny_sweep_run, "fp32").verification
    assert v.distributed_type == "NO" and v.wrapper == "none"
    assert v.linear_output_dtype == "float32"
    assert v.params_local_per_rank == [v.params_total]


def test_bf16_autocast(tiny_sweep_run):
    v = _shared(tiny_sweep_run, "bf16").verification
    assert v.mixed_precision == "bf16" and v.linear_output_dtype == "bfloat16"
    assert v.optimizer_state_dtypes == ["float32"]  # master weights and states stay fp32


def test_gradient_checkpointing(tiny_sweep_run):
    assert _shared(tiny_sweep_run, "ckpt").verification.gradient_checkpointing is True


# -- several processes: DDP, ZeRO-3 and FSDP2 through the trial's own path run as 2 machines x 2 processes in
# test_multi_machine.py (the same launch code, verified per rank, their fp32 loss curves compared there), and as 1 x 2
# through a user's script in test_user_configs.py.


def _assert_same_curves(*outcomes: TrialOutcome) -> None:
    first, *rest = outcomes
    for other in rest:
        assert other.loss_curve == pytest.approx(first.loss_curve, rel=2e-3), f"{other.trial} vs {first.trial}"


def test_fp32_loss_curves_agree_across_strategies(tiny_sweep_run):
    """Same seed, same data, same global batch: fp32 strategies with the same world size train the same model, so
    their loss curves are the same to float tolerance (a loss scaled by the world size, a different seed or data
    order, or a strategy that changes the maths would show here)."""
    _assert_same_curves(_shared(tiny_sweep_run, "fp32"), _shared(tiny_sweep_run, "ckpt"))


# -- GPU only (collected everywhere, skipped without CUDA) ---------------------------------------------------------


def gpu(name: str, **fields) -> Strategy:
    return Strategy(name=name, device="cuda", per_device_batch_size=4, **fields)


@pytest.mark.gpu
def test_fp16_gpu(tmp_path):
    v = launch(tmp_path, gpu("fp16", precision="fp16")).verification
    assert v.device == "cuda"
    assert v.linear_output_dtype == "float16"


@pytest.mark.gpu
def test_fsdp1_gpu(tmp_path):
    v = launch(tmp_path, gpu("fsdp1", fsdp=FsdpSpec(version=1))).verification
    assert v.distributed_type == "FSDP" and v.wrapper == "FSDP1"


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_fsdp2_two_gpus(tmp_path):
    v = launch(tmp_path, gpu("fsdp2-gpu", num_processes=2, fsdp=FsdpSpec())).verification
    assert v.wrapper == "FSDP2"
    assert all(n <= 0.51 * v.params_total for n in v.params_local_per_rank)
