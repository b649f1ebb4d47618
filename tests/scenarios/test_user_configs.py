"""The configs ``hfscale config`` writes, run as printed in a user's own script (tests/scripts/user_script.py:
TrainingArguments first, then the model, then the Trainer with the MemoryCallback and ThroughputCallback added),
proved by the VerificationCallback's record and measured by the user's callbacks on every rank.

One launch per configuration (tiny BERT, 6 steps), with exactly the printed ``accelerate launch`` command and the
printed extra lines, made once per module and read by every test that needs its evidence: the configuration ran as
asked, and the callbacks' figures hold under it (two DDP processes: per-rank memory and global throughput; ZeRO-2
with gradient accumulation: the optimizer step inside backward). The DeepSpeed cases reuse the ops already built
under ``TORCH_EXTENSIONS_DIR`` (building them takes minutes).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers.paths import GOLDEN, SCRIPTS
from helpers.teardown import exited_or_aborted_at_teardown

from hfscale.callbacks import MEMORY_PHASES
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


@dataclass
class Launch:
    """One printed configuration run in the user's script: what was printed, and what the run left."""

    cfg: Path
    out: Path
    printed: Printed
    proc: subprocess.CompletedProcess

    def strategy(self) -> dict[str, Any]:
        return json.loads((self.cfg / "strategy.json").read_text())

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank's record (tests/scripts/user_script.py), in rank order."""
        return [json.loads(path.read_text()) for path in sorted(self.out.glob("rank*.json"))]

    def verification(self) -> list[dict[str, Any]]:
        """Each rank's ``verify/`` record from its log history, the prefix left out."""
        records = []
        for rank in self.ranks():
            (entry,) = [e for e in rank["log_history"] if "verify/ok" in e]
            records.append({k.removeprefix("verify/"): v for k, v in entry.items() if k.startswith("verify/")})
        return records

    def summary(self, name: str) -> dict[str, Any]:
        """A callback's own JSON (``memory`` or ``throughput``), written by the main process."""
        return json.loads((self.out / f"{name}.json").read_text())

    def assert_ran_as_asked(self, case: UserCase) -> list[dict[str, Any]]:
        """Every rank wrote its record and verified what ran as ``case`` asks (a rank may abort at exit after it:
        helpers.teardown); returns the verification records."""
        assert exited_or_aborted_at_teardown(self.proc.returncode, self.proc.stderr), self.proc.stderr[-4000:]
        records = self.verification()
        world_size = self.strategy()["num_processes"]
        assert len(records) == world_size, self.proc.stderr[-4000:]
        for record in records:
            assert record["ok"] == 1, record.get("reason")
            assert record["world_size"] == world_size
            assert {key: record.get(key) for key in case.expect} == case.expect
        return records


def write_configs(argv: list[str], cfg: Path) -> Printed:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert config_main([*argv, "--main-process-port", str(free_port()), "--out", str(cfg)]) == 0
    indented = [
        line.strip() for line in printed.getvalue().splitlines() if line.startswith("  ") and not line.startswith("  /")
    ]
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


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Launch]:
    """Each configuration of :data:`CASES` launched once for the module, when a test first asks for it."""
    done: dict[str, Launch | BaseException] = {}

    def launch(name: str) -> Launch:
        if name not in done:  # a launch that raised (a timeout) is not tried again by the next test that asks
            root = tmp_path_factory.mktemp(name)
            cfg, out = root / "cfg", root / "out"
            try:
                printed = write_configs(CASES[name].argv, cfg)
                done[name] = Launch(cfg=cfg, out=out, printed=printed, proc=run_printed(printed, cfg, out))
            except Exception as exc:
                done[name] = exc
        result = done[name]
        if isinstance(result, BaseException):
            pytest.fail(f"{name}: the launch raised {type(result).__name__}: {result}")
        return result

    return launch


def test_the_script_holds_the_printed_lines_verbatim(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg"
    printed = write_configs(CASES["fsdp2_full_shard_2proc_cpu"].argv, cfg)
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
def test_printed_config_runs_as_asked_in_a_user_script(name: str, launched: Callable[[str], Launch]) -> None:
    case, run = CASES[name], launched(name)
    records = run.assert_ran_as_asked(case)
    # The user's callbacks measured the run under it: every memory phase, the global batch of every step.
    memory, throughput = run.summary("memory"), run.summary("throughput")
    assert memory["world_size"] == throughput["world_size"] == len(records)
    assert all(memory["phases_gib"][phase] is not None for phase in MEMORY_PHASES), memory
    global_batch = records[0]["global_batch_size"]
    assert throughput["samples_per_step"] == throughput["samples_per_step_configured"] == global_batch
    (rank0, *_) = run.ranks()
    measured = rank0["max_steps"] - rank0["warmup_steps"]
    assert throughput["measured_steps"] == measured
    assert throughput["measured_samples"] == measured * throughput["samples_per_step"]


@pytest.mark.slow
@pytest.mark.bnb
def test_two_processes_report_max_memory_and_global_throughput(launched: Callable[[str], Launch]) -> None:
    """DDP over two processes (the 8-bit optimizer's printed configuration): each rank's memory is its own, the
    summary the largest; throughput counts both ranks."""
    pytest.importorskip("bitsandbytes")
    run = launched("ddp_8bit_2proc")
    run.assert_ran_as_asked(CASES["ddp_8bit_2proc"])  # a DDP group of two ranks, as printed
    ranks = run.ranks()
    # Two real ranks of one DDP group ran (not two independent processes).
    assert [rank["rank"] for rank in ranks] == [0, 1] and [rank["dist_world_size"] for rank in ranks] == [2, 2]
    mem = run.summary("memory")
    assert [row["rank"] for row in mem["per_rank"]] == [0, 1]
    assert mem["peak_gib"] == max(row["peak_gib"] for row in mem["per_rank"])
    for row, rank in zip(mem["per_rank"], ranks, strict=True):
        # Each rank's training peak is its own: positive, and within that process's high-water mark.
        assert 0 < row["peak_gib"] <= rank["vmhwm_after_gib"] + 1 / 1024
    for phase in MEMORY_PHASES:
        assert mem["phases_gib"][phase] == max(row["phases_gib"][phase] for row in mem["per_rank"])
    tp = run.summary("throughput")
    assert tp["world_size"] == 2 and tp["samples_per_step"] == tp["samples_per_step_configured"] == 2 * 4  # both ranks
    assert tp["measured_samples"] == tp["measured_steps"] * tp["samples_per_step"]
    assert tp["samples_per_s"] == pytest.approx(tp["samples_per_step"] / tp["step_time_mean_s"])
    # Every rank ends with the same gathered summaries; the log carries each rank's peak.
    assert ranks[1]["memory"] == ranks[0]["memory"] == mem
    assert ranks[1]["throughput"] == ranks[0]["throughput"] == tp
    (entry,) = [e for e in ranks[0]["log_history"] if any(k.startswith("memory/") for k in e)]
    assert entry["memory/rank_1/peak_gib"] == mem["per_rank"][1]["peak_gib"]


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_zero2_with_accumulation_is_measured(launched: Callable[[str], Launch]) -> None:
    """ZeRO-2 with two micro-batches a step: DeepSpeed steps the optimizer inside backward, and the memory summary
    still finds every phase and says so; a step's samples are both micro-batches of both ranks."""
    pytest.importorskip("deepspeed")
    run = launched("zero2_2proc_cpu")
    run.assert_ran_as_asked(CASES["zero2_2proc_cpu"])  # DeepSpeed ZeRO-2 over two ranks, as printed
    mem, tp = run.summary("memory"), run.summary("throughput")
    assert all(mem["phases_gib"][phase] is not None for phase in MEMORY_PHASES), mem
    assert any(note.startswith("DeepSpeed") for note in mem["notes"])
    assert tp["samples_per_step"] == 8 * 2 * 2  # per-device batch x accumulation x processes
    keys = {k for entry in run.ranks()[0]["log_history"] for k in entry}
    assert {"memory/peak_gib", "throughput/samples_per_s", "loss"} <= keys


@pytest.mark.slow
def test_the_callback_fails_a_run_whose_strategy_did_not_take_effect(tmp_path: Path) -> None:
    """The FSDP config on CPU without the printed line: accelerate runs DDP, and the callback stops the run."""
    cfg, out = tmp_path / "cfg", tmp_path / "out"
    printed = write_configs(CASES["fsdp2_full_shard_2proc_cpu"].argv, cfg)
    printed.lines.remove(fsdp_cpu.SCRIPT_LINE)
    proc = run_printed(printed, cfg, out)
    assert proc.returncode != 0
    assert "hfscale.measure.verify.VerificationError: what runs is not what was asked" in proc.stderr
    assert "accelerate ran as MULTI_CPU, expected FSDP" in proc.stderr
    assert "the model was wrapped as DDP" in proc.stderr
    # Training stopped at the first step: no rank's record, neither callback's summary.
    assert not list(out.glob("*.json"))
