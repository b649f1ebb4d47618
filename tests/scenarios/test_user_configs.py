"""The configs ``hfscale config`` writes, run as printed in a user's own script (tests/scripts/user_script.py:
TrainingArguments first, then the model, then the Trainer), and proved by the VerificationCallback's record.

One launch per configuration (tiny BERT, 3 steps), with exactly the printed ``accelerate launch`` command and the
printed extra lines. The DeepSpeed cases reuse the ops already built under ``TORCH_EXTENSIONS_DIR`` (building
them takes minutes).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers.paths import GOLDEN, SCRIPTS
from helpers.teardown import exited_or_aborted_at_teardown

from hfscale.commands.config import main as config_main
from hfscale.launch.process import free_port
from hfscale.techniques import fsdp_cpu

SCRIPT = SCRIPTS / "user_script.py"
FSDP_FLAG = "--fsdp2-on-cpu"


@dataclass(frozen=True)
class UserCase:
    argv: list[str]
    """``hfscale config`` options (``--out`` and the port are added)."""
    expect: dict[str, Any]
    """``verify/...`` keys (without the prefix) and the values the record must hold on every rank."""
    golden: str | None = None
    """The tests/golden folder this configuration is (same options), if any."""
    extra: dict[str, Any] = field(default_factory=dict)


CASES: dict[str, UserCase] = {
    "bf16_ckpt_cpu": UserCase(
        ["--device", "cpu", "--bf16", "--gradient-checkpointing"],
        {"distributed_type": "NO", "wrapper": "none", "linear_output_dtype": "bfloat16", "gradient_checkpointing": 1},
        golden="bf16_ckpt_cpu",
    ),
    # bitsandbytes keeps tensors under 4096 elements (biases, LayerNorms) in 32-bit states, the rest in uint8. The
    # single-process path of a printed config is bf16_ckpt_cpu's; the 8-bit states are the same on one rank or two.
    "ddp_8bit_2proc": UserCase(
        ["--device", "cpu", "--num-processes", "2", "--optim", "adamw_bnb_8bit", "--batch-size", "4"],
        {
            "distributed_type": "MULTI_CPU",
            "wrapper": "DDP",
            "optimizer_state_dtypes": "float32,uint8",
            "global_batch_size": 8,
        },
    ),
    "zero1_2proc": UserCase(
        ["--device", "cpu", "--num-processes", "2", "--zero-stage", "1", "--batch-size", "4"],
        {"distributed_type": "DEEPSPEED", "zero_stage": 1, "params_sharded": 0, "global_batch_size": 8},
    ),
    "zero2_2proc_cpu": UserCase(
        ["--device", "cpu", "--num-processes", "2", "--grad-accum", "2", "--zero-stage", "2"],
        {"distributed_type": "DEEPSPEED", "zero_stage": 2, "params_sharded": 0, "global_batch_size": 32},
        golden="zero2_2proc_cpu",
    ),
    # tests/golden/zero3_offload_cpu's options on this machine: CPU, 2 processes. ZeRO-3 without offload is the same
    # path with two keys fewer. The model is built after TrainingArguments, so under zero.Init: that failed
    # DeepSpeed's batch check before (0.2).
    "zero3_offload_bf16_ckpt_2proc": UserCase(
        shlex.split(
            "--device cpu --bf16 --gradient-checkpointing --num-processes 2 --zero-stage 3 --offload-optimizer cpu "
            "--offload-param cpu --batch-size 4"
        ),
        {
            "distributed_type": "DEEPSPEED",
            "zero_stage": 3,
            "global_batch_size": 8,
            "zero_offload_optimizer": 1,
            "zero_offload_param": 1,
            "params_sharded": 1,
            "linear_output_dtype": "bfloat16",
            "optimizer_class": "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
            "gradient_checkpointing": 1,
        },
    ),
    # Ran as plain DDP before (accelerate does not take its FSDP path on CPU): now with the printed line.
    "fsdp2_full_shard_2proc_cpu": UserCase(
        shlex.split(
            "--device cpu --num-processes 2 --gradient-checkpointing --fsdp full_shard --fsdp-layer-cls BertLayer"
        ),
        {
            "distributed_type": "FSDP",
            "wrapper": "FSDP2",
            "fsdp_sharding": "full_shard",
            "params_sharded": 1,
            "gradient_checkpointing": 1,
            "global_batch_size": 16,
        },
        golden="fsdp2_full_shard_2proc_cpu",
    ),
}


@dataclass
class Printed:
    launch: list[str]
    """The printed launch command, ``your_script.py`` and what follows it left out."""
    lines: list[str]
    """The printed lines for the script (indented, after a line ending in ':'), launch and TrainingArguments aside."""


def write_configs(argv: list[str], cfg: Path, capsys: pytest.CaptureFixture) -> Printed:
    assert config_main([*argv, "--main-process-port", str(free_port()), "--out", str(cfg)]) == 0
    out = capsys.readouterr().out
    indented = [line.strip() for line in out.splitlines() if line.startswith("  ") and not line.startswith("  /")]
    (launch,) = [line for line in indented if line.startswith("accelerate launch ")]
    assert launch.endswith(" your_script.py")
    others = [line for line in indented if line != launch and not line.startswith("TrainingArguments(")]
    return Printed(launch=shlex.split(launch.removesuffix(" your_script.py")), lines=others)


def run_printed(printed: Printed, cfg: Path, out: Path) -> subprocess.CompletedProcess:
    """Launch the user's script with the printed command; ``--fsdp2-on-cpu`` when the FSDP line was printed."""
    out.mkdir(parents=True, exist_ok=True)
    accelerate = shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, *printed.launch[1:], str(SCRIPT), str(cfg), str(out)]
    if fsdp_cpu.SCRIPT_LINE in printed.lines:
        cmd.append(FSDP_FLAG)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)


def verify_records(out: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(out.glob("log_history_rank*.json")):
        (entry,) = [e for e in json.loads(path.read_text()) if "verify/ok" in e]
        records.append({k.removeprefix("verify/"): v for k, v in entry.items() if k.startswith("verify/")})
    return records


def test_the_script_holds_the_printed_lines_verbatim(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "cfg"
    printed = write_configs(CASES["fsdp2_full_shard_2proc_cpu"].argv, cfg, capsys)
    source = SCRIPT.read_text(encoding="utf-8")
    callback_line = (
        "from hfscale.callbacks import VerificationCallback, attach; "
        f"attach(trainer, VerificationCallback({str(cfg.resolve())!r}))"
    )
    assert printed.lines == [fsdp_cpu.SCRIPT_LINE, callback_line]
    assert fsdp_cpu.SCRIPT_LINE in source
    assert callback_line.replace(repr(str(cfg.resolve())), "cfg") in source
    # The golden configurations exercised here are the same options as the golden files.
    for case in CASES.values():
        if case.golden is not None:
            assert (GOLDEN / case.golden).is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_printed_config_runs_as_asked_in_a_user_script(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    case = CASES[name]
    cfg, out = tmp_path / "cfg", tmp_path / "out"
    printed = write_configs(case.argv, cfg, capsys)
    proc = run_printed(printed, cfg, out)
    # Every rank's records, checked below, are the evidence (the script writes them before its group ends).
    assert exited_or_aborted_at_teardown(proc.returncode, proc.stderr), proc.stderr[-4000:]
    records = verify_records(out)
    strategy = json.loads((cfg / "strategy.json").read_text())
    assert len(records) == strategy["num_processes"]
    for record in records:
        assert record["ok"] == 1, record.get("reason")
        assert record["world_size"] == strategy["num_processes"]
        assert {key: record.get(key) for key in case.expect} == case.expect


@pytest.mark.slow
def test_the_callback_fails_a_run_whose_strategy_did_not_take_effect(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The FSDP config on CPU without the printed line: accelerate runs DDP, and the callback stops the run."""
    cfg, out = tmp_path / "cfg", tmp_path / "out"
    printed = write_configs(CASES["fsdp2_full_shard_2proc_cpu"].argv, cfg, capsys)
    printed.lines.remove(fsdp_cpu.SCRIPT_LINE)
    proc = run_printed(printed, cfg, out)
    assert proc.returncode != 0
    assert "hfscale.measure.verify.VerificationError: what runs is not what was asked" in proc.stderr
    assert "accelerate ran as MULTI_CPU, expected FSDP" in proc.stderr
    assert "the model was wrapped as DDP" in proc.stderr
    assert not list(out.glob("log_history_rank*.json"))  # training stopped at the first step
