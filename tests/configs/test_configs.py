"""Config generators: golden files for review, and every generated file loaded by the tool that consumes it.

* accelerate YAML -> ``load_config_from_file`` (rejects unknown keys), then accelerate's own launch validation and
  launcher environment, from which the FSDP / DeepSpeed plugins are built exactly as in a launched process.
* DeepSpeed JSON -> ``TrainingArguments(deepspeed=...)`` fills the "auto" values (``HfTrainerDeepSpeedConfig``),
  then DeepSpeed's ``DeepSpeedConfig`` / ``DeepSpeedZeroConfig`` validate the result.
* training_args.json -> ``transformers.TrainingArguments(output_dir=..., **kwargs)``.

Regenerate the golden files after an intended change with
``HFSCALE_UPDATE_GOLDEN=1 pytest tests/configs/test_configs.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from helpers.paths import GOLDEN

from hfscale.commands.config import main as config_main
from hfscale.configs import (
    ACCELERATE_FILE,
    DEEPSPEED_FILE,
    STRATEGY_FILE,
    TRAINING_ARGS_FILE,
    accelerate_config,
    deepspeed_config,
    fsdp_plugin_kwargs,
    launch_command,
    training_args_kwargs,
    write_configs,
)
from hfscale.configs.fsdp import fsdp_by_accelerate
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, ParallelismSpec, Strategy

GOLDEN_DIR = GOLDEN
UPDATE_GOLDEN = os.environ.get("HFSCALE_UPDATE_GOLDEN") == "1"
OUT_PLACEHOLDER = "<OUT>"


@dataclass(frozen=True)
class Case:
    strategy: Strategy
    write: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for write_configs (machine rank, address, layer class)."""


CASES: dict[str, Case] = {
    "fp32_single": Case(Strategy(name="fp32_single")),
    "bf16_ckpt_cpu": Case(Strategy(name="bf16_ckpt_cpu", device="cpu", precision="bf16", gradient_checkpointing=True)),
    "zero2_2proc_cpu": Case(
        Strategy(
            name="zero2_2proc_cpu",
            device="cpu",
            num_processes=2,
            gradient_accumulation_steps=2,
            deepspeed=DeepSpeedSpec(zero_stage=2),
        )
    ),
    "zero3_offload_cpu": Case(
        Strategy(
            name="zero3_offload_cpu",
            precision="bf16",
            gradient_checkpointing=True,
            num_processes=4,
            deepspeed=DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
        )
    ),
    "zero3_nvme": Case(
        Strategy(
            name="zero3_nvme",
            precision="fp16",
            num_processes=2,
            deepspeed=DeepSpeedSpec(zero_stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/nvme"),
        )
    ),
    "fsdp2_full_shard_2proc_cpu": Case(
        Strategy(
            name="fsdp2_full_shard_2proc_cpu",
            device="cpu",
            num_processes=2,
            gradient_checkpointing=True,
            fsdp=FsdpSpec(sharding="full_shard"),
        ),
        {"transformer_layer_cls": "BertLayer"},
    ),
    "fsdp2_hybrid_2machines": Case(
        Strategy(
            name="fsdp2_hybrid_2machines",
            precision="bf16",
            num_processes=8,
            num_machines=2,
            fsdp=FsdpSpec(sharding="hybrid_shard", transformer_layer_cls="LlamaDecoderLayer"),
        ),
        {"machine_rank": 1, "main_process_ip": "10.0.0.1", "main_process_port": 29500},
    ),
    "fsdp1_shard_grad_op_offload": Case(
        Strategy(
            name="fsdp1_shard_grad_op_offload",
            precision="fp16",
            num_processes=2,
            fsdp=FsdpSpec(sharding="shard_grad_op", version=1, cpu_offload=True),
        ),
    ),
    "zero2_2machines": Case(
        Strategy(
            name="zero2_2machines",
            precision="bf16",
            num_processes=16,
            num_machines=2,
            deepspeed=DeepSpeedSpec(zero_stage=2, offload_optimizer="cpu"),
        ),
        {"machine_rank": 0, "main_process_ip": "10.0.0.1", "main_process_port": 29500},
    ),
    "ddp_2machines": Case(
        Strategy(name="ddp_2machines", precision="bf16", num_processes=8, num_machines=2),
        {"machine_rank": 1, "main_process_ip": "10.0.0.1", "main_process_port": 29500},
    ),
    "zero1_ds_act_ckpt_cpu": Case(
        Strategy(
            name="zero1_ds_act_ckpt_cpu",
            device="cpu",
            gradient_checkpointing=True,
            deepspeed=DeepSpeedSpec(zero_stage=1, partition_activations=True, cpu_checkpointing=True),
        )
    ),
    "bf16_act_offload": Case(Strategy(name="bf16_act_offload", precision="bf16", activation_offload=True)),
    # One process driving 2 GPUs through nn.DataParallel: no launcher (distributed_type NO, num_processes 1).
    "dataparallel_2gpu": Case(
        Strategy(name="dataparallel_2gpu", precision="bf16", num_processes=2, data_parallel="dp")
    ),
    # Tensor parallel over 2 ranks under DDP's launcher: the mesh goes through TrainingArguments, not the YAML.
    "tp2_2proc_cpu": Case(
        Strategy(name="tp2_2proc_cpu", device="cpu", num_processes=2, parallelism=ParallelismSpec(tp=2))
    ),
    # FSDP2 x tensor parallel (2 x 2): on transformers 5 the model is sharded by transformers when it loads it, so
    # the YAML launches it as DDP and carries no FSDP (configs.fsdp.fsdp_by_transformers).
    "fsdp2_tp2_4proc": Case(
        Strategy(
            name="fsdp2_tp2_4proc",
            precision="bf16",
            num_processes=4,
            fsdp=FsdpSpec(),
            parallelism=ParallelismSpec(dp_shard=2, tp=2),
        )
    ),
}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def isolated_state():
    """TrainingArguments sets process-wide state (accelerate's PartialState, the global DeepSpeed config, FSDP
    environment variables): undo it so no other test sees a DeepSpeed or FSDP setup it did not ask for."""
    saved_env = dict(os.environ)
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(saved_env)


def training_arguments(kwargs: dict[str, Any], out: Path):
    """``TrainingArguments`` from generated keywords. transformers refuses bf16 on a machine without a GPU unless
    ``use_cpu`` is set, so a CUDA strategy is checked here with ``use_cpu`` when there is no GPU."""
    from transformers import TrainingArguments

    kwargs = dict(kwargs)
    if kwargs.get("bf16") and not _has_cuda():
        kwargs["use_cpu"] = True
    return TrainingArguments(output_dir=str(out / "trainer"), report_to=[], **kwargs)


def launcher_env(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str]]:
    """What ``accelerate launch --config_file F script.py`` would run: its launcher and the environment it gives
    every process, computed by accelerate's own argument validation and launcher preparation (no process started).
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    # Port 0 = "pick a free one": no dependence on what else listens on this machine.
    args = launch_command_parser().parse_args(["--config_file", str(config_file), "script.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.main_process_port is None or defaults.num_machines == 1:
        args.main_process_port = 0
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config)
        if mp_from_config:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = launch_utils.prepare_deepspeed_cmd_env(args)
        return "deepspeed", env
    if args.use_fsdp or args.multi_gpu:
        return ("fsdp" if args.use_fsdp else "multi_gpu"), launch_utils.prepare_multi_gpu_env(args)
    _, env = launch_utils.prepare_simple_launcher_cmd_env(args)
    return "simple", env


def normalized(text: str, out: Path) -> str:
    return text.replace(str(out), OUT_PLACEHOLDER)


# -- golden files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_golden_files(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    out = tmp_path / name
    generated = write_configs(case.strategy, out, **case.write)
    written = sorted(p.name for p in out.iterdir())
    expected_files = [ACCELERATE_FILE, TRAINING_ARGS_FILE, STRATEGY_FILE]
    expected_files += [DEEPSPEED_FILE] if case.strategy.deepspeed else []
    assert written == sorted(expected_files)
    assert (generated.deepspeed_json is not None) == (case.strategy.deepspeed is not None)
    golden = GOLDEN_DIR / name
    if UPDATE_GOLDEN:
        golden.mkdir(parents=True, exist_ok=True)
        for old in golden.iterdir():
            old.unlink()
        for fname in written:
            (golden / fname).write_text(normalized((out / fname).read_text(encoding="utf-8"), out), encoding="utf-8")
    assert golden.is_dir(), f"no golden files for {name}: run HFSCALE_UPDATE_GOLDEN=1 pytest {__file__}"
    assert sorted(p.name for p in golden.iterdir()) == written
    for fname in written:
        got = normalized((out / fname).read_text(encoding="utf-8"), out)
        assert got == (golden / fname).read_text(encoding="utf-8"), f"{name}/{fname} differs from the golden file"


def test_every_golden_folder_has_a_case() -> None:
    stale = sorted(p.name for p in GOLDEN_DIR.iterdir() if p.is_dir()) if GOLDEN_DIR.is_dir() else []
    assert set(stale) <= set(CASES), f"golden folders without a case: {sorted(set(stale) - set(CASES))}"


# -- accelerate: the YAML loader and the launcher ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_accelerate_yaml_loads_and_launches_as_intended(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    case = CASES[name]
    s = case.strategy
    generated = write_configs(s, tmp_path, **case.write)
    loaded = load_config_from_file(str(generated.accelerate_yaml))
    assert isinstance(loaded, ClusterConfig)
    assert loaded.num_processes == s.world_size  # one under data_parallel "dp"
    assert loaded.num_machines == s.num_machines
    assert loaded.machine_rank == case.write.get("machine_rank", 0)
    assert loaded.use_cpu == (s.device == "cpu")

    launcher, env = launcher_env(generated.accelerate_yaml, monkeypatch)
    accelerate_fsdp = fsdp_by_accelerate(s)
    expected_launcher = (
        "deepspeed" if s.deepspeed else "fsdp" if accelerate_fsdp else "multi_gpu" if s.world_size > 1 else "simple"
    )
    assert launcher == expected_launcher
    if s.deepspeed is None:
        want = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}[s.precision]
        assert env["ACCELERATE_MIXED_PRECISION"] == want
    assert (env.get("ACCELERATE_USE_FSDP") == "true") == accelerate_fsdp
    if accelerate_fsdp:
        assert env["ACCELERATE_USE_FSDP"] == "true"
        assert env["FSDP_VERSION"] == str(s.fsdp.version)
        assert env["FSDP_OFFLOAD_PARAMS"] == str(s.fsdp.cpu_offload).lower()
        assert env["FSDP_ACTIVATION_CHECKPOINTING"] == str(s.gradient_checkpointing).lower()
        hybrid = s.fsdp.sharding == "hybrid_shard" and s.fsdp.version == 2
        meshed = hybrid or s.parallelism is not None
        assert env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == ("true" if meshed else None)
        if hybrid:
            assert int(env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"]) == s.num_machines
            assert int(env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) * s.num_machines == s.num_processes


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if fsdp_by_accelerate(c.strategy)])
def test_fsdp_launcher_and_trainer_build_the_same_plugin(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_state: None
) -> None:
    """The FSDP plugin a launched process builds from ``FSDP_*`` variables equals the one the Trainer builds
    from ``TrainingArguments.fsdp_config``."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    case = CASES[name]
    if case.strategy.fsdp.version == 1 and not _has_cuda():
        pytest.skip("FSDP1's plugin needs an accelerator device to be built")
    generated = write_configs(case.strategy, tmp_path, **case.write)
    args = training_arguments(generated.training_args(), tmp_path)
    from_trainer = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    _, env = launcher_env(generated.accelerate_yaml, monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from_launcher = FullyShardedDataParallelPlugin()
    for attr in (
        "fsdp_version",
        "reshard_after_forward",
        "auto_wrap_policy",
        "transformer_cls_names_to_wrap",
        "activation_checkpointing",
        "state_dict_type",
        "cpu_ram_efficient_loading",
    ):
        assert getattr(from_trainer, attr) == getattr(from_launcher, attr), attr
    assert type(from_trainer.cpu_offload) is type(from_launcher.cpu_offload)
    spec = case.strategy.fsdp
    if spec.version == 2:
        assert from_launcher.reshard_after_forward is (spec.sharding != "shard_grad_op")
    assert from_launcher.activation_checkpointing is case.strategy.gradient_checkpointing
    layer = case.write.get("transformer_layer_cls") or spec.transformer_layer_cls
    assert from_launcher.transformer_cls_names_to_wrap == ([layer] if layer else None)


# -- DeepSpeed ----------------------------------------------------------------------------------------------------


def _device(section: Any) -> str:
    """An offload section's device as text (DeepSpeed's pydantic model may keep the enum or its value)."""
    if section is None:
        return "none"
    return str(getattr(section.device, "value", section.device))


DS_VARIANTS: list[Case] = [
    *(Case(Strategy(device="cpu", deepspeed=DeepSpeedSpec(zero_stage=stage))) for stage in (0, 1, 2, 3)),
    Case(Strategy(device="cpu", precision="bf16", deepspeed=DeepSpeedSpec(zero_stage=1, offload_optimizer="cpu"))),
    Case(Strategy(precision="fp16", optimizer="adafactor", deepspeed=DeepSpeedSpec(zero_stage=3, offload_param="cpu"))),
    *(c for c in CASES.values() if c.strategy.deepspeed is not None),
]


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", DS_VARIANTS, ids=lambda c: c.strategy.describe())
def test_deepspeed_json_is_filled_by_the_trainer_and_accepted_by_deepspeed(
    case: Case, tmp_path: Path, isolated_state: None
) -> None:
    strategy = case.strategy
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    generated = write_configs(strategy, tmp_path, **case.write)
    args = training_arguments(generated.training_args(), tmp_path)
    hf_config = args.hf_deepspeed_config  # TrainingArguments already ran trainer_config_process
    # The Trainer finalises once the model and step count are known; only the hidden size is read.
    hf_config.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 10)
    filled = hf_config.config
    assert "auto" not in json.dumps(filled), filled

    spec = strategy.deepspeed
    zero = DeepSpeedZeroConfig(**filled["zero_optimization"])  # pydantic: rejects unknown keys
    assert int(zero.stage) == spec.zero_stage
    ds = DeepSpeedConfig(filled)  # checks train_batch = micro x accumulation x world
    assert ds.zero_optimization_stage == spec.zero_stage
    assert ds.train_micro_batch_size_per_gpu == strategy.per_device_batch_size
    assert ds.gradient_accumulation_steps == strategy.gradient_accumulation_steps
    assert (
        ds.train_batch_size == strategy.per_device_batch_size * strategy.gradient_accumulation_steps * args.world_size
    )
    assert ds.float16_config.enabled is (strategy.precision == "fp16")
    assert ds.bfloat16_config.enabled is (strategy.precision == "bf16")
    assert ds.gradient_clipping == args.max_grad_norm
    offload_opt = _device(zero.offload_optimizer)
    offload_param = _device(zero.offload_param)
    assert (offload_opt, offload_param) == (spec.offload_optimizer, spec.offload_param)
    for section in (zero.offload_optimizer, zero.offload_param):
        if section is not None:
            assert section.pin_memory is (strategy.device == "cuda")
            if _device(section) == "nvme":
                assert str(section.nvme_path) == spec.nvme_path
    # Under ZeRO-Offload DeepSpeed runs its own (CPU) AdamW; otherwise the Trainer's `optim` is used.
    assert (ds.optimizer_name is not None) == (spec.offload_optimizer != "none")


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.strategy.deepspeed is not None])
def test_deepspeed_launcher_accepts_json_next_to_yaml(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_state: None
) -> None:
    """accelerate refuses some YAML keys next to a DeepSpeed JSON (mixed_precision, zero_stage, ...): build the
    plugin a launched process builds, with the launcher's environment."""
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin

    case = CASES[name]
    generated = write_configs(case.strategy, tmp_path, **case.write)
    _, env = launcher_env(generated.accelerate_yaml, monkeypatch)
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(generated.deepspeed_json)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == case.strategy.deepspeed.zero_stage
    assert plugin.zero3_init_flag is (case.strategy.deepspeed.zero_stage == 3)


@pytest.mark.deepspeed
def test_deepspeed_yaml_without_json_uses_accelerate_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_state: None
) -> None:
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin

    s = Strategy(device="cpu", deepspeed=DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"))
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(accelerate_config(s)), encoding="utf-8")
    _, env = launcher_env(path, monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3
    assert (zero["offload_optimizer"]["device"], zero["offload_param"]["device"]) == ("cpu", "cpu")
    assert plugin.zero3_init_flag is True


def test_nvme_offload_needs_the_deepspeed_json() -> None:
    s = Strategy(deepspeed=DeepSpeedSpec(zero_stage=3, offload_param="nvme", nvme_path="/nvme"))
    with pytest.raises(ValueError, match="NVMe offload needs a DeepSpeed JSON"):
        accelerate_config(s)
    assert accelerate_config(s, deepspeed_config_file="/x/ds.json")["deepspeed_config"] == {
        "deepspeed_config_file": "/x/ds.json",
        "zero3_init_flag": True,
    }


def test_deepspeed_config_is_none_without_deepspeed() -> None:
    assert deepspeed_config(Strategy()) is None


# -- TrainingArguments -------------------------------------------------------------------------------------------

TA_VARIANTS: list[Case] = [
    *CASES.values(),
    Case(Strategy(device="cpu", optimizer="adamw_bnb_8bit", per_device_batch_size=2, gradient_accumulation_steps=4)),
    Case(Strategy(device="cpu", optimizer="adafactor", gradient_checkpointing=True, num_processes=2)),
    Case(Strategy(device="cpu", num_processes=2, fsdp=FsdpSpec(sharding="shard_grad_op", auto_wrap="none"))),
]


@pytest.mark.parametrize("case", TA_VARIANTS, ids=lambda c: c.strategy.describe())
def test_training_args_are_accepted_by_transformers(case: Case, tmp_path: Path, isolated_state: None) -> None:
    strategy = case.strategy
    if strategy.deepspeed is not None:
        pytest.importorskip("deepspeed")
    if strategy.fsdp is not None and strategy.fsdp.version == 1:
        pytest.importorskip("torch.distributed.fsdp")
    generated = write_configs(strategy, tmp_path, **case.write)
    kwargs = generated.training_args()
    args = training_arguments(kwargs, tmp_path)
    assert args.fp16 is (strategy.precision == "fp16")
    assert args.bf16 is (strategy.precision == "bf16")
    # Unset, `optim` is left out of the generated arguments and the Trainer's own default runs.
    assert ("optim" in kwargs) == (strategy.optimizer is not None)
    assert args.optim.value == strategy.resolved_optimizer
    assert args.per_device_train_batch_size == strategy.per_device_batch_size
    assert args.gradient_accumulation_steps == strategy.gradient_accumulation_steps
    if strategy.device == "cpu":
        assert args.use_cpu and args.device.type == "cpu"
    accelerate_fsdp = fsdp_by_accelerate(strategy)
    assert args.gradient_checkpointing is (strategy.gradient_checkpointing and not accelerate_fsdp)
    if args.gradient_checkpointing:
        assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert (args.deepspeed is not None) == (strategy.deepspeed is not None)
    if not accelerate_fsdp:
        assert not args.fsdp
    else:
        plugin = args.fsdp_plugin_args
        assert plugin["fsdp_version"] == strategy.fsdp.version
        assert plugin.get("activation_checkpointing", False) is strategy.gradient_checkpointing
        assert plugin.get("cpu_offload", False) is strategy.fsdp.cpu_offload
        wrap = "TRANSFORMER_BASED_WRAP" if strategy.fsdp.auto_wrap == "transformer_layer" else "NO_WRAP"
        assert plugin["auto_wrap_policy"] == wrap
    if strategy.distributed:  # on only under tp, for the causal LM the generated files assume
        tp = strategy.parallelism is not None and strategy.parallelism.tp > 1
        assert args.average_tokens_across_devices is tp


def test_training_args_need_the_deepspeed_path() -> None:
    s = Strategy(deepspeed=DeepSpeedSpec(zero_stage=2))
    with pytest.raises(ValueError, match="uses DeepSpeed, pass deepspeed_config_path"):
        training_args_kwargs(s)
    with pytest.raises(ValueError, match="deepspeed_config_path given, but the strategy uses no DeepSpeed"):
        training_args_kwargs(Strategy(), deepspeed_config_path="ds.json")
    assert training_args_kwargs(s, deepspeed_config_path="/x/ds.json")["deepspeed"] == "/x/ds.json"


# -- accelerate_config arguments, FSDP sections, launch command ----------------------------------------------------


def test_accelerate_config_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"machine_rank=2 is out of range for strategy\.num_machines=2"):
        accelerate_config(Strategy(num_processes=4, num_machines=2), machine_rank=2, main_process_ip="h")
    with pytest.raises(ValueError, match=r"num_machines=2 needs main_process_ip"):
        accelerate_config(Strategy(num_processes=4, num_machines=2))
    with pytest.raises(ValueError, match="deepspeed_config_file given, but the strategy uses no DeepSpeed"):
        accelerate_config(Strategy(), deepspeed_config_file="ds.json")


def test_fsdp_layer_class_argument_overrides_the_strategy() -> None:
    s = Strategy(num_processes=2, fsdp=FsdpSpec(transformer_layer_cls="BertLayer"))
    assert fsdp_plugin_kwargs(s)["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer"
    assert fsdp_plugin_kwargs(s, transformer_layer_cls="GPT2Block")["fsdp_transformer_layer_cls_to_wrap"] == "GPT2Block"
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp_plugin_kwargs(Strategy(num_processes=2, fsdp=FsdpSpec()))
    with pytest.raises(ValueError, match=r"strategy\.fsdp is None"):
        fsdp_plugin_kwargs(Strategy())


def test_launch_command_is_parsed_by_accelerate_as_intended() -> None:
    from accelerate.commands.launch import launch_command_parser

    target = ["-m", "hfscale.trial", "spec.json", "--result", "r.json"]
    cmd = launch_command("cfg.yaml", target, main_process_port=29555, python="/py")
    assert cmd[:3] == ["/py", "-m", "accelerate.commands.launch"]
    args = launch_command_parser().parse_args(cmd[3:])
    assert args.config_file == "cfg.yaml"
    assert args.main_process_port == 29555
    assert args.module is True
    assert args.training_script == "hfscale.trial"
    assert args.training_script_args == ["spec.json", "--result", "r.json"]
    script = launch_command_parser().parse_args(launch_command("c.yaml", ["train.py", "--lr", "1"])[3:])
    assert not script.module
    assert (script.training_script, script.training_script_args) == ("train.py", ["--lr", "1"])
    with pytest.raises(ValueError, match="target is empty"):
        launch_command("c.yaml", [])


def test_write_configs_removes_a_stale_deepspeed_json(tmp_path: Path) -> None:
    first = write_configs(Strategy(deepspeed=DeepSpeedSpec(zero_stage=2)), tmp_path)
    assert first.deepspeed_json is not None and first.deepspeed_json.is_file()
    second = write_configs(Strategy(), tmp_path)
    assert second.deepspeed_json is None
    assert not (tmp_path / DEEPSPEED_FILE).exists()
    assert second.launch_command(["t.py"], python="/py") == [
        "/py",
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path.resolve() / ACCELERATE_FILE),
        "t.py",
    ]


# -- the `hfscale config` command ----------------------------------------------------------------------------------


def test_cli_writes_configs_and_prints_the_launch_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hfscale.commands.main import main as hfscale_main

    out = tmp_path / "zero3"
    argv = [
        "config",
        "--bf16",
        "--gradient-checkpointing",
        "--zero-stage",
        "3",
        "--offload-optimizer",
        "cpu",
        "--num-processes",
        "8",
        "--batch-size",
        "4",
        "--out",
        str(out),
    ]
    assert hfscale_main(argv) == 0
    printed = capsys.readouterr().out
    assert f"accelerate launch --config_file {out.resolve() / ACCELERATE_FILE} your_script.py" in printed
    ds = json.loads((out / DEEPSPEED_FILE).read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    ta = json.loads((out / TRAINING_ARGS_FILE).read_text())
    assert (ta["bf16"], ta["per_device_train_batch_size"], ta["deepspeed"]) == (
        True,
        4,
        str(out.resolve() / DEEPSPEED_FILE),
    )
    acc = yaml.safe_load((out / ACCELERATE_FILE).read_text())
    assert (acc["distributed_type"], acc["num_processes"]) == ("DEEPSPEED", 8)


def test_cli_multi_machine_and_fsdp(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = [
        "--fsdp",
        "--fsdp-layer-cls",
        "BertLayer",
        "--device",
        "cpu",
        "--num-processes",
        "4",
        "--num-machines",
        "2",
        "--main-process-ip",
        "10.0.0.1",
        "--main-process-port",
        "29500",
        "--machine-rank",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert config_main(argv) == 0
    assert "--machine_rank R your_script.py" in capsys.readouterr().out
    acc = yaml.safe_load((tmp_path / ACCELERATE_FILE).read_text())
    assert acc["machine_rank"] == 1 and acc["main_process_ip"] == "10.0.0.1" and acc["main_process_port"] == 29500
    assert acc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer"
    assert acc["fsdp_config"]["fsdp_reshard_after_forward"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fp16", "--bf16"], "fp16 and bf16 are both set"),
        (["--offload-param", "cpu"], "--offload-param configure DeepSpeed ZeRO: add --zero-stage"),
        (["--fsdp-cpu-offload"], "--fsdp-cpu-offload and --fsdp-layer-cls configure FSDP: add --fsdp"),
        (["--zero-stage", "2", "--offload-param", "cpu"], "needs deepspeed.zero_stage=3, got 2"),
        (["--zero-stage", "2", "--fsdp"], "strategy.deepspeed and strategy.fsdp are both set"),
        (["--device", "cpu", "--fp16"], "strategy.precision='fp16' with strategy.device='cpu'"),
        (["--num-machines", "2", "--num-processes", "2"], "needs main_process_ip"),
        (["--num-processes", "3", "--num-machines", "2", "--main-process-ip", "h"], "not a multiple"),
    ],
)
def test_cli_errors_exit_2_with_the_reason(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert config_main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hfscale config: error: ")
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_cli_usage_errors_and_help(capsys: pytest.CaptureFixture) -> None:
    assert config_main(["--zero-stage", "4", "--out", "x"]) == 2
    assert "invalid choice: 4" in capsys.readouterr().err
    assert config_main(["--help"]) == 0
    assert "--offload-optimizer" in capsys.readouterr().out


# -- a real launch --------------------------------------------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)  # proves the ranks are connected, not just started
    out = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json")
    with open(out, "w") as f:
        json.dump({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": int(total),
                   "local_rank": int(os.environ["LOCAL_RANK"]), "pid": os.getpid()}, f)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _read_ranks(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


@pytest.mark.slow
def test_generated_two_process_cpu_config_starts_two_connected_ranks(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT, encoding="utf-8")
    generated = write_configs(Strategy(device="cpu", num_processes=2), tmp_path / "cfg", main_process_port=_free_port())
    cmd = generated.launch_command([str(script), str(tmp_path)])
    proc = subprocess.run(cmd, env=_launch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _read_ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["world_size"] for r in ranks} == {2}
    assert {r["sum"] for r in ranks} == {3}
    assert len({r["pid"] for r in ranks}) == 2


@pytest.mark.slow
def test_generated_two_machine_config_joins_ranks_across_machines(tmp_path: Path) -> None:
    """Two "machines" on localhost: the same YAML launched with machine rank 0 and 1 forms one world of 2."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT, encoding="utf-8")
    s = Strategy(device="cpu", num_processes=2, num_machines=2)
    port = _free_port()
    procs = []
    for rank in (0, 1):
        generated = write_configs(
            s, tmp_path / f"m{rank}", machine_rank=rank, main_process_ip="127.0.0.1", main_process_port=port
        )
        cmd = generated.launch_command([str(script), str(tmp_path)])
        procs.append(
            subprocess.Popen(cmd, env=_launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    ranks = _read_ranks(tmp_path)
    assert [(r["rank"], r["local_rank"], r["world_size"], r["sum"]) for r in ranks] == [(0, 0, 2, 3), (1, 0, 2, 3)]


def test_python_in_launch_command_defaults_to_this_interpreter() -> None:
    assert launch_command("c.yaml", ["t.py"])[0] == sys.executable


# -- what a user's own script needs ----------------------------------------------------------------------------


def test_strategy_json_reads_back_the_strategy(tmp_path: Path) -> None:
    from hfscale.configs import read_strategy

    s = Strategy(name="z3", device="cpu", num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=3, offload_param="cpu"))
    generated = write_configs(s, tmp_path)
    assert generated.strategy_json == tmp_path.resolve() / STRATEGY_FILE
    assert read_strategy(tmp_path) == s == read_strategy(generated.strategy_json)
    (tmp_path / STRATEGY_FILE).write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_strategy(tmp_path)


def test_zero3_on_cpu_leaves_the_global_batch_to_deepspeed() -> None:
    """A model built after TrainingArguments is built under zero.Init, which on CPU reads the JSON in a world of one:
    a filled-in train_batch_size (batch x processes) then fails DeepSpeed's batch check."""
    cpu = deepspeed_config(Strategy(device="cpu", num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=3)))
    assert "train_batch_size" not in cpu and cpu["train_micro_batch_size_per_gpu"] == "auto"
    for s in (
        Strategy(num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=3)),
        Strategy(device="cpu", num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=2)),
    ):
        assert deepspeed_config(s)["train_batch_size"] == "auto"


@pytest.mark.parametrize(
    ("argv", "fsdp_line"),
    [
        (["--device", "cpu", "--fsdp", "--num-processes", "2"], True),
        (["--device", "cpu", "--fsdp", "--fsdp-layer-cls", "BertLayer"], True),
        (["--fsdp", "--num-processes", "2", "--fsdp-layer-cls", "LlamaDecoderLayer"], False),
        (["--device", "cpu", "--zero-stage", "3", "--num-processes", "2"], False),
    ],
)
def test_cli_prints_the_lines_a_user_script_needs(
    argv: list[str], fsdp_line: bool, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from hfscale.techniques import fsdp_cpu

    assert config_main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert (f"\n  {fsdp_cpu.SCRIPT_LINE}\n" in printed) is fsdp_line
    assert f"attach(trainer, VerificationCallback({str(tmp_path.resolve())!r}))" in printed
    assert str(tmp_path.resolve() / STRATEGY_FILE) in printed
    assert ("no --fsdp-layer-cls" in printed) is ("--fsdp" in argv and "--fsdp-layer-cls" not in argv)
