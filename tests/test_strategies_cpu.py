"""Every strategy that can run on CPU really trains, launched as the sweep launches it, and its verification record
shows that the strategy took effect (GPU-only strategies are written here too and skipped without a GPU).

Each test is one trial in a fresh process group: ``write_configs`` writes accelerate.yaml, deepspeed.json and
training_args.json, and ``accelerate launch --config_file accelerate.yaml -m hfscale.trial spec.json --result
result.json`` runs it. Tiny BERT (hidden 64, 2 layers), 64-token sequences, 4 optimizer steps.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import TINY_BERT

from hfscale.configs import launch_command, write_configs
from hfscale.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy
from hfscale.trial import TrialOutcome
from hfscale.verify import check

STEPS = 4
# fp32 loss curves by world size, filled as the trials run, compared by the last test of this file.
FP32_CURVES: dict[int, dict[str, list[float]]] = {}
# First DeepSpeed use JIT-builds its CPU ops (about 2 minutes, cached under TORCH_EXTENSIONS_DIR).
LAUNCH_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(tmp_path: Path, strategy: Strategy) -> TrialOutcome:
    """Run one trial as the sweep does and return its result; fail with the trial's stderr if it did not run."""
    spec = TrialSpec(
        name=strategy.name,
        strategy=strategy,
        model=ModelSpec(type="bert", config=TINY_BERT),
        data=DataSpec(num_samples=64, seq_len=64),
        measure=MeasureSpec(max_steps=STEPS, warmup_steps=1),
    )
    configs = write_configs(strategy, tmp_path)  # as the sweep does: FSDP's block class is the runner's to find
    spec.write(tmp_path / "spec.json")
    result = tmp_path / "result.json"
    target = ["-m", "hfscale.trial", str(tmp_path / "spec.json"), "--result", str(result)]
    cmd = launch_command(str(configs.accelerate_yaml), target, main_process_port=_free_port())
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    outcome = TrialOutcome.read(result)
    assert outcome.status == "ok", outcome.mismatches
    # The runner's own check agrees with a fresh one on the stored record.
    assert check(strategy, outcome.verification) == []
    assert len(outcome.loss_curve) == STEPS
    assert all(math.isfinite(x) and 0 < x < 5 for x in outcome.loss_curve), outcome.loss_curve
    assert outcome.world_size == strategy.num_processes
    if strategy.precision == "fp32":
        FP32_CURVES.setdefault(strategy.num_processes, {})[strategy.name] = outcome.loss_curve
    return outcome


def cpu(name: str, **fields) -> Strategy:
    return Strategy(name=name, device="cpu", per_device_batch_size=4, **fields)


# -- one process ---------------------------------------------------------------------------------------------------


def test_fp32(tmp_path):
    v = launch(tmp_path, cpu("fp32")).verification
    assert v["distributed_type"] == "NO" and v["wrapper"] == "none"
    assert v["linear_output_dtype"] == "float32"
    assert v["params_local_per_rank"] == [v["params_total"]]


def test_bf16_autocast(tmp_path):
    v = launch(tmp_path, cpu("bf16", precision="bf16")).verification
    assert v["mixed_precision"] == "bf16"
    assert v["linear_output_dtype"] == "bfloat16"
    assert v["optimizer_state_dtypes"] == ["float32"]  # master weights and states stay fp32


def test_gradient_checkpointing(tmp_path):
    v = launch(tmp_path, cpu("ckpt", gradient_checkpointing=True)).verification
    assert v["gradient_checkpointing"] is True


@pytest.mark.bnb
def test_adamw_bnb_8bit(tmp_path):
    pytest.importorskip("bitsandbytes")
    v = launch(tmp_path, cpu("adam8bit", optimizer="adamw_bnb_8bit")).verification
    assert v["optimizer_class"].startswith("bitsandbytes.")
    assert "uint8" in v["optimizer_state_dtypes"]


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_offload_one_process(tmp_path):
    pytest.importorskip("deepspeed")
    spec = DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    v = launch(tmp_path, cpu("zero3-offload", deepspeed=spec)).verification
    assert v["wrapper"] == "DeepSpeedEngine" and v["zero_stage"] == 3
    assert v["zero_offload_optimizer"] is True and v["zero_offload_param"] is True
    assert v["optimizer_class"] == "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"


# -- two processes -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_two_processes(tmp_path):
    v = launch(tmp_path, cpu("ddp", num_processes=2)).verification
    assert v["distributed_type"] == "MULTI_CPU" and v["wrapper"] == "DDP"
    assert v["world_size"] == 2
    assert v["params_local_per_rank"] == [v["params_total"]] * 2  # replicated


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_two_processes(tmp_path, stage):
    pytest.importorskip("deepspeed")
    v = launch(tmp_path, cpu(f"zero{stage}", num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=stage))).verification
    assert v["distributed_type"] == "DEEPSPEED" and v["wrapper"] == "DeepSpeedEngine"
    assert v["zero_stage"] == stage
    if stage == 3:
        # Each rank holds its partition: half of the parameters, plus at most a little padding.
        assert all(n <= 0.51 * v["params_total"] for n in v["params_local_per_rank"]), v["params_local_per_rank"]
    else:
        assert v["params_local_per_rank"] == [v["params_total"]] * 2


@pytest.mark.slow
def test_fsdp2_two_processes(tmp_path):
    """accelerate alone would run DDP here; hfscale.fsdp_cpu makes it take the FSDP2 path, and the record shows it."""
    outcome = launch(tmp_path, cpu("fsdp2", num_processes=2, fsdp=FsdpSpec()))
    v = outcome.verification
    assert v["distributed_type"] == "FSDP"
    assert v["wrapper"] == "FSDP2" and "FSDPBertForSequenceClassification" in v["wrapper_class"]
    assert all(n <= 0.51 * v["params_total"] for n in v["params_local_per_rank"]), v["params_local_per_rank"]


def test_fp32_loss_curves_agree_across_strategies():
    """Same seed, same data, same global batch: every fp32 strategy with the same world size trains the same model,
    so its loss curve is the same to float tolerance (a loss scaled by the world size, a different seed or data
    order, or a strategy that changes the maths would show here)."""
    groups = {n: curves for n, curves in FP32_CURVES.items() if len(curves) >= 2}
    if not groups:
        pytest.skip("needs two fp32 trials of the same world size from this module (run the whole file)")
    for world_size, curves in groups.items():
        (first_name, first), *rest = curves.items()
        for name, curve in rest:
            assert curve == pytest.approx(first, rel=2e-3), f"{world_size} proc: {name} vs {first_name}"


# -- GPU only (collected everywhere, skipped without CUDA) ---------------------------------------------------------


def gpu(name: str, **fields) -> Strategy:
    return Strategy(name=name, device="cuda", per_device_batch_size=4, **fields)


@pytest.mark.gpu
def test_fp16_gpu(tmp_path):
    v = launch(tmp_path, gpu("fp16", precision="fp16")).verification
    assert v["device"] == "cuda"
    assert v["linear_output_dtype"] == "float16"


@pytest.mark.gpu
def test_fsdp1_gpu(tmp_path):
    v = launch(tmp_path, gpu("fsdp1", fsdp=FsdpSpec(version=1))).verification
    assert v["distributed_type"] == "FSDP" and v["wrapper"] == "FSDP1"


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_fsdp2_two_gpus(tmp_path):
    v = launch(tmp_path, gpu("fsdp2-gpu", num_processes=2, fsdp=FsdpSpec())).verification
    assert v["wrapper"] == "FSDP2"
    assert all(n <= 0.51 * v["params_total"] for n in v["params_local_per_rank"])
