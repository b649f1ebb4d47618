"""nn.DataParallel against DDP: a ``data_parallel: dp`` trial is one plain process that sees exactly its GPUs (no
launcher), its configs say so, and the verification reads the wrapper class and one process. The GPU comparison of
the two runs where there are 2 GPUs."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.models import TINY_BERT

from hfscale.commands.config import main as config_main
from hfscale.configs import launch_command, write_configs
from hfscale.configs.accelerate import accelerate_config, user_command, visible_devices
from hfscale.launch.group import direct_command
from hfscale.launch.process import clean_environment
from hfscale.measure.verify import _wrapper_kind, check
from hfscale.records.measurements import VerificationRecord
from hfscale.strategy import Strategy

DP = Strategy(name="dp", precision="bf16", num_processes=2, per_device_batch_size=8, data_parallel="dp")
DDP = DP.replace(name="ddp", data_parallel="ddp")


def dp_record(**changes) -> VerificationRecord:
    """What a DataParallel run over 2 GPUs records: one process, no process group, the wrapper class, and the
    Trainer's batch of per-device batch x GPUs."""
    base = VerificationRecord(
        distributed_type="NO",
        world_size=1,
        device="cuda",
        mixed_precision="bf16",
        wrapper="DataParallel",
        wrapper_class="torch.nn.parallel.data_parallel.DataParallel",
        params_total=1000,
        params_local_per_rank=[1000],
        linear_layer="bert.encoder.layer.0.attention.self.query",
        linear_output_dtype="bfloat16",
        optimizer_class="torch.optim.adamw.AdamW",
        optimizer_implementation="fused",
        global_batch_size=16,
    )
    return dataclasses.replace(base, **changes)


# -- the launch: one process, its GPUs ---------------------------------------------------------------------------


def test_dp_config_starts_one_process_without_a_launcher():
    config = accelerate_config(DP)
    assert config["distributed_type"] == "NO"
    assert config["num_processes"] == 1
    assert accelerate_config(DDP)["num_processes"] == 2
    assert DP.world_size == 1 and not DP.distributed


def test_the_sweep_runs_a_dp_trial_as_one_plain_python(tmp_path: Path):
    """What the sweep starts: accelerate's simple launcher replaced by the plain command it would run."""
    configs = write_configs(DP, tmp_path)
    target = ["-m", "hfscale.trial", "spec.json"]
    cmd = configs.launch_command(target)
    direct = direct_command(cmd, clean_environment())
    assert direct is not None, "a dp trial must not go through torchrun"
    argv, _ = direct
    assert argv[0] == sys.executable and argv[1:] == target
    # DDP of the same size keeps its launcher (torchrun).
    assert direct_command(write_configs(DDP, tmp_path / "ddp").launch_command(target), clean_environment()) is None


def test_a_dp_trial_sees_exactly_its_gpus():
    assert visible_devices(DP, ("cuda0", "cuda1")) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert visible_devices(DP, ("cuda2", "cuda3", "cuda4")) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert visible_devices(DP, ("cudaGPU-1a2b", "cudaGPU-3c4d")) == {"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}
    # DDP's ranks pick their GPU by local rank: nothing set.
    assert visible_devices(DDP, ("cuda0", "cuda1")) == {}


def test_user_command_is_a_plain_python_with_the_gpus(tmp_path: Path, capsys):
    assert user_command(DP, "a.yaml", "train.py") == ["env", "CUDA_VISIBLE_DEVICES=0,1", "python", "train.py"]
    assert user_command(DDP, "a.yaml", "train.py")[:2] == ["accelerate", "launch"]
    assert config_main(["--out", str(tmp_path), "--bf16", "--num-processes", "2", "--data-parallel", "dp"]) == 0
    out = capsys.readouterr().out
    assert "env CUDA_VISIBLE_DEVICES=0,1 python your_script.py" in out
    assert "accelerate launch" not in out
    loaded = yaml.safe_load((tmp_path / "accelerate.yaml").read_text())
    assert loaded["distributed_type"] == "NO" and loaded["num_processes"] == 1


def test_dp_refused_on_cpu_from_the_command_line(tmp_path: Path, capsys):
    argv = ["--out", str(tmp_path), "--device", "cpu", "--num-processes", "2", "--data-parallel", "dp"]
    assert config_main(argv) == 2
    assert "strategy.data_parallel='dp' with strategy.device='cpu'" in capsys.readouterr().err


# -- verification ------------------------------------------------------------------------------------------------


def test_wrapper_kind_recognises_data_parallel():
    # Without GPUs nn.DataParallel keeps the module and runs it as is: the class is what is read.
    wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    assert _wrapper_kind(wrapped) == "DataParallel"
    assert _wrapper_kind(torch.nn.Linear(2, 2)) == "none"


def test_a_dp_record_matches_and_ddp_or_one_gpu_does_not():
    assert check(DP, dp_record()) == []
    # Launched by torchrun instead: two processes and DDP.
    ddp_ran = dp_record(distributed_type="MULTI_GPU", world_size=2, wrapper="DDP", params_local_per_rank=[1000] * 2)
    problems = check(DP, ddp_ran)
    assert any("2 process(es) ran, 1 were asked for" in p for p in problems)
    assert any("wrapped as DDP" in p and "expected DataParallel" in p for p in problems)
    # One GPU visible: the Trainer does not wrap and the batch is half.
    one_gpu = dp_record(wrapper="none", wrapper_class="BertForSequenceClassification", global_batch_size=8)
    problems = check(DP, one_gpu)
    assert any("expected DataParallel" in p for p in problems)
    assert any("8 samples per optimizer step" in p for p in problems)
    # And a DDP strategy is not satisfied by DataParallel.
    assert any("wrapped as DataParallel" in p for p in check(DDP, dp_record()))


# -- on 2 GPUs: the single process beside DDP ----------------------------------------------------------------------


def _launch(tmp_path: Path, strategy: Strategy):
    from hfscale.launch.process import free_port
    from hfscale.trial.train import read_outcome
    from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

    spec = TrialSpec(
        name=strategy.name,
        strategy=strategy,
        model=ModelSpec(type="bert", config=TINY_BERT),
        data=DataSpec(num_samples=256, seq_len=64),
        measure=MeasureSpec(max_steps=10, warmup_steps=2),
    )
    configs = write_configs(strategy, tmp_path)
    spec.write(tmp_path / "spec.json")
    target = ["-m", "hfscale.trial", str(tmp_path / "spec.json"), "--result", str(tmp_path / "result.json")]
    cmd = launch_command(str(configs.accelerate_yaml), target, main_process_port=free_port())
    env = os.environ | visible_devices(strategy, ("cuda0", "cuda1"))  # as the sweep sets it
    proc = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_outcome(tmp_path / "result.json")


@pytest.mark.multi_gpu
def test_dataparallel_beside_ddp_on_two_gpus(tmp_path: Path):
    """The same job as one process over 2 GPUs (nn.DataParallel) and as 2 DDP ranks: both verified from inside
    the run (wrapper class, process count, the global batch), and both measured, so the row shows the cost."""
    dp = _launch(tmp_path / "dp", DP)
    ddp = _launch(tmp_path / "ddp", DDP)
    assert dp.status == "ok", dp.mismatches
    assert ddp.status == "ok", ddp.mismatches
    assert dp.verification.wrapper == "DataParallel" and dp.verification.world_size == 1
    assert ddp.verification.wrapper == "DDP" and ddp.verification.world_size == 2
    assert dp.verification.global_batch_size == ddp.verification.global_batch_size == 16
    for outcome in (dp, ddp):
        assert outcome.throughput.samples_per_s > 0
        assert all(math.isfinite(x) for x in outcome.loss_curve)
