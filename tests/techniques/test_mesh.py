"""Device meshes: the strategy's mesh as accelerate takes it (YAML through its launcher, ``ParallelismConfig`` for the
Trainer), a model without a tensor-parallel plan refused at recipe load, the mesh and the DTensor placements checked
(a fallback to plain weights caught), and tensor parallel over 2 CPU processes through the Trainer proving from
inside the run that a Linear weight is ``Shard``-ed over a 1-D tp mesh of 2."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import types
from pathlib import Path

import pytest
from helpers.teardown import exited_or_aborted_at_teardown

from hfscale.configs import launch_command, write_configs
from hfscale.launch.process import free_port
from hfscale.measure.verify import check
from hfscale.recipes.recipe import parse_recipe
from hfscale.recipes.schema import RecipeError
from hfscale.records.measurements import VerificationRecord
from hfscale.strategy import FsdpSpec, ParallelismSpec, Strategy
from hfscale.techniques import mesh, mesh_limits
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=64,
)
TP2_CPU = Strategy(
    name="tp2", device="cpu", num_processes=2, per_device_batch_size=4, optimizer="adamw_torch",
    parallelism=ParallelismSpec(tp=2),
)  # fmt: skip
FSDP2_TP2 = Strategy(
    name="fsdp2-tp2", precision="bf16", num_processes=4, fsdp=FsdpSpec(), parallelism=ParallelismSpec(dp_shard=2, tp=2)
)


def tp_record(**changes) -> VerificationRecord:
    """What the tp=2 CPU trial records (measured, and the parameter counts derived, in
    test_tensor_parallel_over_two_cpu_processes): no wrapper, a tp mesh of 2, q_proj's weight split
    by rows, the batch counted once for the two ranks that share it."""
    base = VerificationRecord(
        distributed_type="MULTI_CPU",
        world_size=2,
        device="cpu",
        mixed_precision="no",
        wrapper="none",
        wrapper_class="transformers.models.llama.modeling_llama.LlamaForCausalLM",
        params_total=115_008,
        params_local_per_rank=[57_664, 57_664],
        linear_layer="model.layers.0.self_attn.q_proj",
        linear_output_dtype="float32",
        optimizer_class="torch.optim.adamw.AdamW",
        optimizer_implementation="foreach",
        global_batch_size=4,
        device_mesh={"tp": 2},
        linear_weight_placements="tp=Shard(dim=0)",
    )
    return dataclasses.replace(base, **changes)


# -- the mesh, as accelerate takes it ------------------------------------------------------------------------------


def test_parallelism_config_carries_the_strategy_sizes():
    pc = mesh.accelerate_parallelism_config(FSDP2_TP2)
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size, pc.sp_size) == (1, 2, 2, 1, 1)
    assert pc.total_size == FSDP2_TP2.num_processes
    assert mesh.accelerate_parallelism_config(Strategy()) is None


def test_yaml_section_only_where_accelerate_launch_takes_it(tmp_path: Path, monkeypatch):
    """accelerate launch refuses a parallelism_config section without FSDP2: DDP + tp gets none (the Trainer
    takes the mesh), nor does FSDP2 + tp where transformers shards the model itself; FSDP2 + cp gets one, which
    accelerate's launcher turns into PARALLELISM_CONFIG_* variables."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    assert mesh.accelerate_section(TP2_CPU) == {}
    assert "parallelism_config" not in write_configs(TP2_CPU, tmp_path / "ddp").accelerate_yaml.read_text()
    assert "parallelism_config" not in write_configs(FSDP2_TP2, tmp_path / "tp").accelerate_yaml.read_text()
    fsdp2_cp2 = FSDP2_TP2.replace(name="fsdp2-cp2", parallelism=ParallelismSpec(dp_shard=2, cp=2))
    configs = write_configs(fsdp2_cp2, tmp_path / "fsdp")
    args = launch_command_parser().parse_args(["--config_file", str(configs.accelerate_yaml), "x.py"])
    args, _, _ = _validate_launch_command(args)
    args.main_process_port = 0
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (env["PARALLELISM_CONFIG_DP_SHARD_SIZE"], env["PARALLELISM_CONFIG_CP_SIZE"]) == ("2", "2")
    # The variables build the same ParallelismConfig the Trainer is given.
    from accelerate import ParallelismConfig

    for key, value in env.items():
        if key.startswith("PARALLELISM_CONFIG_"):
            monkeypatch.setenv(key, value)
    from_env = ParallelismConfig()
    given = mesh.accelerate_parallelism_config(fsdp2_cp2)
    assert from_env._sizes == given._sizes


def test_accelerate_refuses_cp_beside_replication_alone():
    with pytest.raises(ValueError, match="cannot be used with pure data parallelism"):
        replicas_and_cp = ParallelismSpec(dp_replicate=2, cp=2)
        mesh.accelerate_parallelism_config(Strategy(num_processes=4, fsdp=FsdpSpec(), parallelism=replicas_and_cp))


def test_tp_beside_replicas_alone_is_refused_whatever_accelerate_takes():
    """accelerate 1.16 takes this mesh where 1.15 refused it, but skips the DDP wrap under tp: the replicas'
    gradients would never be averaged."""
    replicas_and_tp = Strategy(num_processes=4, parallelism=ParallelismSpec(dp_replicate=2, tp=2))
    assert "would not average the replicas' gradients" in mesh_limits.replicas_beside_tp(replicas_and_tp)
    hsdp_and_tp = ParallelismSpec(dp_replicate=2, dp_shard=2, tp=2)
    assert mesh_limits.replicas_beside_tp(Strategy(num_processes=8, fsdp=FsdpSpec(), parallelism=hsdp_and_tp)) is None
    assert mesh_limits.replicas_beside_tp(TP2_CPU) is None
    # Under FSDP2 there is no DDP wrap to skip: accelerate's own refusal of cp beside the replicas is the one to say.
    hsdp_cp = ParallelismSpec(dp_replicate=2, tp=2, cp=2)
    assert mesh_limits.replicas_beside_tp(Strategy(num_processes=8, fsdp=FsdpSpec(), parallelism=hsdp_cp)) is None


def test_script_lines_say_what_a_user_script_needs():
    lines = [line for _, line in mesh.script_lines(TP2_CPU)]
    assert lines[0] == mesh.SCRIPT_LINE
    assert "tp_plan='auto', tp_size=2" in lines[1]
    assert "ParallelismConfig(tp_size=2)" in lines[2]
    assert mesh.script_lines(Strategy()) == []


# -- a model without a tensor-parallel plan ------------------------------------------------------------------------


def test_tp_for_a_model_without_a_plan_is_refused_at_recipe_load():
    recipe = {
        "device": "cpu",
        "model": {"type": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}},
        "trials": [{"name": "tp2", "num_processes": 2, "parallelism": {"tp": 2}}],
    }
    with pytest.raises(RecipeError, match=r"trials\[0\]\.parallelism\.tp: .*model type 'bert' has none.*llama"):
        parse_recipe(recipe, source="x.yaml")
    recipe["model"] = {"type": "llama", "task": "causal_lm", "config": TINY_LLAMA}
    recipe["data"] = {"token_high": 256}
    assert parse_recipe(recipe, source="x.yaml").trials[0].spec.strategy.parallelism.tp == 2


def test_a_mesh_that_cannot_train_is_refused_at_recipe_load_and_by_the_cli(tmp_path: Path, capsys):
    from hfscale.commands.config import main as config_main

    recipe = {
        "model": {"type": "llama", "task": "causal_lm", "config": TINY_LLAMA},
        "data": {"token_high": 256},
        "trials": [{"name": "tp-ddp", "num_processes": 4, "parallelism": {"dp_replicate": 2, "tp": 2}}],
    }
    with pytest.raises(RecipeError, match=r"trials\[0\]\.parallelism: tp 2 beside 2 data-parallel replicas alone"):
        parse_recipe(recipe, source="x.yaml")
    recipe["trials"] = [
        {"name": "cp-ddp", "num_processes": 4, "fsdp": {"version": 2}, "parallelism": {"dp_replicate": 2, "cp": 2}}
    ]
    with pytest.raises(RecipeError, match=r"trials\[0\]\.parallelism: accelerate refuses this mesh: .*pure data"):
        parse_recipe(recipe, source="x.yaml")
    assert config_main(["--out", str(tmp_path), "--num-processes", "4", "--tp", "2"]) == 2
    assert "tp 2 beside 2 data-parallel replicas alone: the Trainer would not average" in (
        err := capsys.readouterr().err
    )
    assert err.rstrip().endswith("with FSDP2 instead (add --fsdp)")
    assert config_main(["--out", str(tmp_path), "--num-processes", "4", "--tp", "2", "--fsdp", "shard_grad_op"]) == 2
    assert "--fsdp with --tp 2: beside tp, transformers shards the model itself" in capsys.readouterr().err


def test_fsdp2_beside_tp_is_left_to_transformers_where_it_loads_tp_through_its_own_mesh(
    tmp_path: Path, capsys, monkeypatch
):
    """transformers 5 builds one mesh (pp x dp_replicate x fsdp x tp) from the DistributedConfig a tp model loads
    with, which must take every process: FSDP2 x tp through accelerate's FSDP2 was a crashed row per trial ("The
    parallel mesh requires 2 processes, but world_size is 4"). transformers shards the model itself there: the
    configs give accelerate no FSDP, the model loads with the FSDP size, and what transformers' own sharding does not
    take (other wrapping, shard_grad_op, other dimensions beside tp) is refused at recipe load."""
    from hfscale.commands.config import main as config_main
    from hfscale.configs import accelerate_config, training_args_kwargs
    from hfscale.configs.fsdp import fsdp_by_transformers, loads_with_distributed_config

    assert loads_with_distributed_config()  # the stack this suite runs on: transformers 5
    fsdp_tp = Strategy(num_processes=4, fsdp=FsdpSpec(), parallelism=ParallelismSpec(dp_shard=2, tp=2))
    assert fsdp_by_transformers(fsdp_tp) and not fsdp_by_transformers(TP2_CPU)
    yaml_config = accelerate_config(fsdp_tp)
    assert yaml_config["distributed_type"] == "MULTI_GPU"  # launched as DDP is: torchrun, no FSDP_* variables
    assert "fsdp_config" not in yaml_config and "parallelism_config" not in yaml_config
    assert "fsdp" not in training_args_kwargs(fsdp_tp)
    assert mesh.distributed_config_kwargs(fsdp_tp) == {"tp_plan": "auto", "tp_size": 2, "fsdp_size": 2}
    # bf16 gathers where bf16 is asked (without it transformers' FSDP gathered the fp32 weights); fp16 it has not.
    bf16 = mesh.distributed_config_kwargs(fsdp_tp.replace(precision="bf16"))
    assert bf16 == {"tp_plan": "auto", "tp_size": 2, "fsdp_size": 2, "fsdp_mixed_precision": True}
    assert (
        config_main(["--out", str(tmp_path), "--num-processes", "4", "--tp", "2", "--fsdp", "full_shard", "--fp16"])
        == 2
    )
    assert "--fp16 with --tp 2: beside tp, transformers shards the model itself" in capsys.readouterr().err
    assert config_main(["--out", str(tmp_path), "--num-processes", "4", "--tp", "2", "--fsdp", "full_shard"]) == 0
    printed = capsys.readouterr().out
    assert "DistributedConfig(tp_plan='auto', tp_size=2, fsdp_size=2)" in printed
    assert "--fsdp-layer-cls BertLayer" not in printed  # advice the tp check would refuse
    assert "set it false for a model whose loss ignores num_items_in_batch" in printed
    with pytest.raises(ValueError, match=r"fsdp\.transformer_layer_cls: beside tp, .* not LlamaDecoderLayer"):
        write_configs(fsdp_tp, tmp_path / "api", transformer_layer_cls="LlamaDecoderLayer")  # the API refuses too
    with pytest.raises(ValueError, match=r"^precision: beside tp, .*casts the parameters to bf16 only"):
        write_configs(fsdp_tp.replace(precision="fp16"), tmp_path / "fp16")

    def trial(name: str, **fields) -> dict:
        return {"name": name, "num_processes": 4, "fsdp": {"version": 2}, **fields}

    recipe = {
        "model": {"type": "llama", "task": "causal_lm", "config": TINY_LLAMA},
        "data": {"token_high": 256},
        "trials": [trial("fsdp-tp", parallelism={"dp_shard": 2, "tp": 2})],
    }
    assert parse_recipe(recipe, source="x.yaml").trials[0].spec.strategy.parallelism.mesh() == {"dp_shard": 2, "tp": 2}
    # HSDP x tp: transformers replicates too (dp_replicate_size); accelerate places the data over all 4 dp ranks (the
    # Trainer would set dp_shard to 4 beside a dp_replicate of 2: a mesh of 16 on 8 processes).
    hsdp = (
        parse_recipe(
            recipe | {"trials": [trial("h", num_processes=8, parallelism={"dp_replicate": 2, "dp_shard": 2, "tp": 2})]},
            source="x.yaml",
        )
        .trials[0]
        .spec.strategy
    )
    assert mesh.distributed_config_kwargs(hsdp) == {
        "tp_plan": "auto", "tp_size": 2, "fsdp_size": 2, "dp_replicate_size": 2
    }  # fmt: skip
    assert mesh.accelerate_mesh(hsdp) == {"dp_shard": 4, "tp": 2} and mesh.accelerate_mesh(fsdp_tp) == {
        "dp_shard": 2, "tp": 2
    }  # fmt: skip
    pc = mesh.accelerate_parallelism_config(hsdp)
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size) == (1, 4, 2)
    # hfscale config --fsdp hybrid_shard --tp: a replica on each machine, printed for a user's script.
    two_machines = ["--out", str(tmp_path / "h"), "--num-processes", "8", "--num-machines", "2", "--tp", "2"]
    assert config_main([*two_machines, "--main-process-ip", "10.0.0.1", "--fsdp", "hybrid_shard", "--bf16"]) == 0
    printed = capsys.readouterr().out
    assert "mesh dp_replicate 2 x dp_shard 2 x tp 2" in printed
    assert (
        "DistributedConfig(tp_plan='auto', tp_size=2, fsdp_size=2, dp_replicate_size=2, fsdp_mixed_precision=True)"
        in printed
    )
    assert "ParallelismConfig(dp_shard_size=4, tp_size=2)" in printed
    assert (
        config_main(["--out", str(tmp_path / "h1"), "--num-processes", "8", "--tp", "2", "--fsdp", "hybrid_shard"]) == 2
    )
    assert "--fsdp hybrid_shard replicates across machines: give --num-machines > 1" in capsys.readouterr().err
    one_each = ["--out", str(tmp_path / "h4"), "--num-processes", "8", "--num-machines", "4", "--tp", "2"]
    assert config_main([*one_each, "--main-process-ip", "10.0.0.1", "--fsdp", "hybrid_shard"]) == 2
    assert "FSDP2 needs processes left to shard over on each of 4 machines" in capsys.readouterr().err
    refused = [
        (trial("a", parallelism={"dp_shard": 2, "tp": 2}, fsdp={"version": 2, "sharding": "shard_grad_op"}),
         r"trials\[0\]\.fsdp\.sharding: beside tp, transformers shards the model itself .*got shard_grad_op"),
        (trial("b", parallelism={"dp_shard": 2, "tp": 2}, fsdp={"version": 2, "transformer_layer_cls": "X"}),
         r"trials\[0\]\.fsdp\.transformer_layer_cls: .*own plan: not X"),
        (trial("p", parallelism={"dp_shard": 2, "tp": 2}, precision="fp16"),
         r"trials\[0\]\.precision: beside tp, .*casts the parameters to bf16 only .*use bf16"),
        (trial("c", num_processes=8, parallelism={"dp_shard": 2, "cp": 2, "tp": 2}),
         r"trials\[0\]\.parallelism: tp 2 beside dp_shard 2 x cp 2: .*FSDP2's \(dp_shard, and dp_replicate"),
    ]  # fmt: skip
    for entry, message in refused:
        with pytest.raises(RecipeError, match=message):
            parse_recipe(recipe | {"trials": [entry]}, source="x.yaml")
    # Where transformers has no DistributedConfig of the mesh's sizes (4.x), accelerate's FSDP2 shards it as before.
    import hfscale.configs.fsdp

    monkeypatch.setattr(hfscale.configs.fsdp, "loads_with_distributed_config", lambda: False)
    assert not fsdp_by_transformers(fsdp_tp)
    assert accelerate_config(fsdp_tp)["distributed_type"] == "FSDP"
    assert parse_recipe(recipe, source="x.yaml").trials[0].spec.name == "fsdp-tp"


# -- verification ----------------------------------------------------------------------------------------------


def test_a_tensor_parallel_record_matches():
    assert check(TP2_CPU, tp_record()) == []
    assert mesh.check(Strategy(), tp_record(device_mesh=None, linear_weight_placements=None)) == []


def test_plain_weights_while_tp_was_asked_are_caught():
    """The silent fallback: the model trained whole on every rank (not loaded along its plan)."""
    fallback = tp_record(linear_weight_placements=None, device_mesh=None)
    problems = check(TP2_CPU, fallback)
    assert any("Linear weights are plain tensors, parallelism.tp=2" in p for p in problems)
    assert any("device mesh that ran is none, parallelism asks for tp 2" in p for p in problems)
    replicated = tp_record(linear_weight_placements="(Replicate(),)")  # an unnamed mesh
    assert any("(replicated)" in p for p in check(TP2_CPU, replicated))
    assert check(TP2_CPU, tp_record(linear_weight_placements="(Shard(dim=0),)")) == []
    named = tp_record(linear_weight_placements="tp=Replicate()")
    assert any("sharded over the 'tp' mesh dimension" in p for p in check(TP2_CPU, named))


def test_fsdp2_shard_alone_does_not_pass_for_tensor_parallel():
    """Under dp_shard x tp FSDP2 shards every weight over dp_shard itself: the record names each mesh dimension,
    and only a Shard on the tp dimension counts as tensor parallel."""
    both = "dp_shard=Shard(dim=0), tp=Shard(dim=0)"
    assert mesh.placements_by_dim(both) == {"dp_shard": "Shard(dim=0)", "tp": "Shard(dim=0)"}
    assert mesh.placements_by_dim("(Shard(dim=0),)") is None
    strided = "dp_shard=_StridedShard(dim=0, sf=2), tp=Shard(dim=0)"
    assert mesh.placements_by_dim(strided)["tp"] == "Shard(dim=0)"
    record = tp_record(world_size=4, device_mesh={"dp_shard": 2, "tp": 2})
    assert mesh.check(FSDP2_TP2, dataclasses.replace(record, linear_weight_placements=both)) == []
    assert mesh.check(FSDP2_TP2, dataclasses.replace(record, linear_weight_placements=strided)) == []
    for fsdp_only in ("dp_shard=Shard(dim=0), tp=Replicate()", "dp_shard=Shard(dim=0)"):
        problems = mesh.check(FSDP2_TP2, dataclasses.replace(record, linear_weight_placements=fsdp_only))
        assert problems == [
            f"a Linear weight is placed {fsdp_only}, parallelism.tp=2 asks for it sharded over the 'tp' mesh "
            "dimension: the model was not split along its tensor-parallel plan"
        ]


def test_placements_recorded_per_named_mesh_dimension(tmp_path: Path):
    """Read from a real DTensor on a named 2-D mesh (one gloo process, sizes 1 x 1)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
        linear = torch.nn.Linear(4, 4)
        linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.data, device_mesh, [Shard(0), Replicate()]))
        recorded = mesh._linear_weight_placements(torch.nn.Sequential(linear))
        assert recorded == "dp_shard=Shard(dim=0), tp=Replicate()"
        assert "'tp' mesh dimension" in mesh.check(FSDP2_TP2, tp_record(linear_weight_placements=recorded))[-1]
        unnamed = init_device_mesh("cpu", (1,))
        linear.weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), unnamed, [Shard(0)]))
        assert mesh._linear_weight_placements(torch.nn.Sequential(linear)) == "(Shard(dim=0),)"
    finally:
        dist.destroy_process_group()


def test_deepspeed_sequence_parallel_read_from_the_groups_deepspeed_built(monkeypatch):
    """With sp_backend="deepspeed" accelerate builds no torch mesh, so the config is all the state holds: that is
    what hfscale passed, not what ran. The sp size is read from DeepSpeed's groups; none built is sp 1, caught."""
    from types import SimpleNamespace

    import deepspeed.comm
    from deepspeed.utils import groups

    from hfscale.strategy import DeepSpeedSpec

    strategy = Strategy(
        name="sp2", num_processes=2, deepspeed=DeepSpeedSpec(zero_stage=1), parallelism=ParallelismSpec(sp=2)
    )
    state = SimpleNamespace(device_mesh=None, parallelism_config=mesh.accelerate_parallelism_config(strategy))
    not_built = mesh._mesh_sizes(state)  # no process group here: DeepSpeed built no sequence-parallel group
    assert not_built == {}
    problems = mesh.check(strategy, tp_record(device_mesh=not_built, linear_weight_placements=None))
    assert problems == ["the device mesh that ran is none, parallelism asks for sp 2"]

    class Mpu:
        @staticmethod
        def get_sequence_parallel_world_size() -> int:
            return 2

    monkeypatch.setattr(deepspeed.comm, "is_initialized", lambda: True)
    monkeypatch.setattr(groups, "mpu", Mpu())
    monkeypatch.setattr(groups, "mesh_device", None)
    built = mesh._mesh_sizes(state)
    assert built == {"sp": 2}
    assert mesh.check(strategy, tp_record(device_mesh=built, linear_weight_placements=None)) == []


def test_global_batch_counts_the_shared_batch_once():
    """Both tp ranks train on the same samples: 4 per step, not 8 (hfscale.techniques.mesh.shared_batch)."""
    assert TP2_CPU.global_batch_size == 4
    assert mesh.shared_batch() == (1, 1)  # no accelerate state in this process


def test_the_model_reloaded_for_tp_and_qlora_is_saved_in_bf16_and_loads_as_fp32(tmp_path: Path):
    """Each rank saves its own copy of the model to reload (tp, QLoRA): in bf16, half the bytes of fp32; loaded
    back as float32, the weights are the originals rounded to bf16, tied weights still tied."""
    import torch
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=True))
    mesh.save_for_reload(model, tmp_path / "half")
    model.save_pretrained(tmp_path / "full")
    with safe_open(tmp_path / "half" / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 (not iterable)
    half, full = ((tmp_path / d / "model.safetensors").stat().st_size for d in ("half", "full"))
    assert half < 0.55 * full
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, original[name].to(torch.bfloat16).float(), rtol=0, atol=0)
    assert model.dtype == torch.float32  # the trial's model is left as it was


# -- tensor parallel on 2 CPU processes, through the Trainer ---------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_over_two_cpu_processes(tmp_path: Path):
    """The trial runner loads the model along its plan and accelerate runs the mesh over gloo (with
    :func:`hfscale.techniques.mesh.enable_mesh_on_cpu`): from inside the run, q_proj's weight is a DTensor
    ``Shard(dim=0)`` over a 1-D tp mesh of 2, each rank holds half of every split Linear, and the loss is finite."""
    outcome = _tiny_llama_trial(TP2_CPU, tmp_path)
    v = outcome.verification
    assert v.device_mesh == {"tp": 2}
    assert v.linear_layer == "model.layers.0.self_attn.q_proj"
    assert v.linear_weight_placements == "tp=Shard(dim=0)"  # transformers names its 1-D mesh's dimension
    assert v.wrapper == "none" and v.distributed_type == "MULTI_CPU" and v.world_size == 2
    # TINY_LLAMA: embedding 256x64 + untied lm_head 256x64 + 2 layers x (4x64^2 + 3x64x128 + 2x64) + final norm 64
    # = 115,008. Only the norms (2x2x64 + 64 = 320) stay whole; the embedding, lm_head and every Linear are halved.
    assert v.params_total == 115_008
    assert v.params_local_per_rank == [(115_008 - 320) // 2 + 320] * 2
    assert v.global_batch_size == 4 and outcome.throughput.samples_per_step == 4
    assert abs(outcome.loss_curve[0] - math.log(256)) < 0.2, outcome.loss_curve  # a random model's, not tp times it
    assert check(TP2_CPU, v) == []


@pytest.mark.slow
def test_fsdp2_beside_tensor_parallel_over_four_cpu_processes(tmp_path: Path):
    """dp_shard 2 x tp 2 in bf16 with gradient checkpointing and accumulation, sharded by transformers when it loads
    the model (accelerate gets no FSDP): from inside the run the model is an FSDP2 module, q_proj's weight is split
    over both dimensions of transformers' mesh (``Shard`` on tp), each rank holds about a quarter of the split
    weights, FSDP gathers them in bf16 (before, fp32: autocast alone), the first loss is a random model's, and the
    verification finds what was asked."""
    strategy = Strategy(
        name="fsdp-tp", device="cpu", num_processes=4, per_device_batch_size=2, fsdp=FsdpSpec(), precision="bf16",
        parallelism=ParallelismSpec(dp_shard=2, tp=2), gradient_checkpointing=True, gradient_accumulation_steps=2,
    )  # fmt: skip
    outcome = _tiny_llama_trial(strategy, tmp_path)
    v = outcome.verification
    assert v.device_mesh == {"dp_shard": 2, "tp": 2}
    assert v.wrapper == "FSDP2" and v.distributed_type == "MULTI_CPU" and v.world_size == 4
    assert "tp=Shard(dim=0)" in v.linear_weight_placements, v.linear_weight_placements
    # TINY_LLAMA's 115,008 elements: the norms' 320 split over dp_shard alone, everything else over all four ranks.
    assert v.params_total == 115_008
    assert v.params_local_per_rank == [(115_008 - 320) // 4 + 320 // 2] * 4
    assert (
        v.global_batch_size == 8 and outcome.throughput.samples_per_step == 8
    )  # 2 a rank x 2 data-parallel ranks x 2 micro
    assert v.gradient_checkpointing  # the Trainer's, where transformers shards the model
    assert v.fsdp_param_dtype == "bfloat16" and v.linear_output_dtype == "bfloat16"
    assert check(strategy, dataclasses.replace(v, fsdp_param_dtype="float32")) == [
        "FSDP2 gathers the parameters in float32, not bfloat16: precision bf16 runs as autocast alone, with "
        "full-precision gathers"
    ]
    # A random model's loss, ln 256: with average_tokens_across_devices off the Trainer logged twice it (11.1).
    assert abs(outcome.loss_curve[0] - math.log(256)) < 0.2, outcome.loss_curve
    assert check(strategy, v) == []


@pytest.mark.slow
def test_hsdp_beside_tensor_parallel_over_eight_cpu_processes(tmp_path: Path):
    """dp_replicate 2 x dp_shard 2 x tp 2 in bf16 with gradient checkpointing and accumulation, sharded by
    transformers when it loads the model (accelerate gets no FSDP and places the data over the 4 data-parallel
    ranks): from inside the run the model is an FSDP2 module sharded hybrid (each weight split over a replica's 2
    dp_shard ranks, replicated across the 2 replicas), q_proj's weight is split over tp too (``Shard`` on tp), each
    rank holds a quarter of the split weights, FSDP gathers them in bf16 (before, fp32: autocast alone), the first
    loss is a random model's, and the verification finds what was asked. The paths replicas take apart from the test
    above: transformers' 2-D FSDP mesh, its all-reduce across replicas deferred under accumulation, accelerate's
    mesh with the replicas folded into dp_shard, the verification's hybrid sharding."""
    strategy = Strategy(
        name="hsdp-tp", device="cpu", num_processes=8, per_device_batch_size=2, fsdp=FsdpSpec(), precision="bf16",
        parallelism=ParallelismSpec(dp_replicate=2, dp_shard=2, tp=2), gradient_checkpointing=True,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    outcome = _tiny_llama_trial(strategy, tmp_path)
    v = outcome.verification
    assert v.device_mesh == {"dp_shard": 4, "tp": 2}  # accelerate's: the data over every data-parallel rank
    assert v.fsdp_mesh == {"dp_replicate": 2, "dp_shard": 2} and v.fsdp_sharding == "hybrid_shard"
    assert v.fsdp_shard_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]  # each tp rank's shard group within a replica
    assert v.wrapper == "FSDP2" and v.distributed_type == "MULTI_CPU" and v.world_size == 8
    assert "dp_replicate=Replicate()" in v.linear_weight_placements, v.linear_weight_placements
    assert "tp=Shard(dim=0)" in v.linear_weight_placements, v.linear_weight_placements
    # TINY_LLAMA's 115,008 elements: the norms' 320 split over dp_shard alone, everything else over dp_shard x tp.
    assert v.params_total == 115_008
    assert v.params_local_per_rank == [(115_008 - 320) // 4 + 320 // 2] * 8
    assert v.global_batch_size == 16 and outcome.throughput.samples_per_step == 16  # 2 x 4 dp ranks x 2 micro
    assert v.gradient_checkpointing  # the Trainer's, where transformers shards the model
    assert v.fsdp_param_dtype == "bfloat16" and v.linear_output_dtype == "bfloat16"
    # A random model's loss, ln 256: with average_tokens_across_devices off the Trainer logged twice it (11.1).
    assert abs(outcome.loss_curve[0] - math.log(256)) < 0.2, outcome.loss_curve
    assert check(strategy, v) == []
    assert check(strategy, dataclasses.replace(v, fsdp_param_dtype="float32")) == [
        "FSDP2 gathers the parameters in float32, not bfloat16: precision bf16 runs as autocast alone, with "
        "full-precision gathers"
    ]


def _tiny_llama_trial(strategy: Strategy, folder: Path):
    """One trial of tiny Llama under ``strategy``, launched as the sweep launches it; its ``ok`` outcome."""
    from hfscale.trial.train import read_outcome

    spec = TrialSpec(
        name=strategy.name,
        strategy=strategy,
        model=ModelSpec(type="llama", task="causal_lm", config=TINY_LLAMA),
        data=DataSpec(num_samples=64, seq_len=32, token_high=256),
        measure=MeasureSpec(max_steps=4, warmup_steps=1),
    )
    configs = write_configs(strategy, folder)
    spec.write(folder / "spec.json")
    target = ["-m", "hfscale.trial", str(folder / "spec.json"), "--result", str(folder / "result.json")]
    cmd = launch_command(str(configs.accelerate_yaml), target, main_process_port=free_port())
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert exited_or_aborted_at_teardown(proc.returncode, proc.stderr), proc.stderr[-4000:]
    outcome = read_outcome(folder / "result.json")
    assert outcome.status == "ok", outcome.mismatches
    return outcome


@pytest.mark.multi_gpu
def test_tensor_parallel_over_two_gpus(tmp_path: Path):
    """The same trial on 2 GPUs (NCCL; no adjustment): the weight is sharded over the tp mesh."""
    from hfscale.trial.train import read_outcome

    strategy = TP2_CPU.replace(name="tp2-gpu", device="cuda", precision="bf16")
    spec = TrialSpec(
        name=strategy.name,
        strategy=strategy,
        model=ModelSpec(type="llama", task="causal_lm", config=TINY_LLAMA),
        data=DataSpec(num_samples=64, seq_len=32, token_high=256),
        measure=MeasureSpec(max_steps=4, warmup_steps=1),
    )
    configs = write_configs(strategy, tmp_path)
    spec.write(tmp_path / "spec.json")
    target = ["-m", "hfscale.trial", str(tmp_path / "spec.json"), "--result", str(tmp_path / "result.json")]
    cmd = launch_command(str(configs.accelerate_yaml), target, main_process_port=free_port())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outcome = read_outcome(tmp_path / "result.json")
    assert outcome.status == "ok", outcome.mismatches
    assert outcome.verification.device_mesh == {"tp": 2}
    assert "Shard" in (outcome.verification.linear_weight_placements or "")


def test_a_batch_mismatch_names_the_data_parallel_replicas_not_the_processes():
    """Under tp=2 the two ranks share one batch: the message's factors multiply to the number it explains."""
    rec = tp_record(global_batch_size=8)
    problems = check(Strategy(name="tp", device="cpu", per_device_batch_size=4, num_processes=2,
                              parallelism=ParallelismSpec(tp=2)), rec)  # fmt: skip
    assert any("8 samples per optimizer step across ranks ran, 4 were asked for (batch 4 x accumulation 1 x 1 "
               "data-parallel replica(s))" in p for p in problems), problems  # fmt: skip


# -- hybrid sharding through the device mesh -----------------------------------------------------------------------

HSDP_MESH = Strategy(
    name="hsdp-mesh", device="cpu", num_processes=4, per_device_batch_size=4, optimizer="adamw_torch",
    fsdp=FsdpSpec(), parallelism=ParallelismSpec(dp_replicate=2, dp_shard=2),
)  # fmt: skip


def fsdp2_record_on_a_fake_world(dp_replicate: int, dp_shard: int) -> VerificationRecord:
    """Rank 0's record of an FSDP2 ``full_shard`` run of the tiny Llama on a ``dp_replicate x dp_shard`` mesh, read
    by the collectors a trial runs from a real ``fully_shard`` model. The mesh is built as accelerate builds it
    (``ParallelismConfig.build_device_mesh``) and FSDP2 is applied on its ``fsdp_dim_names`` sub-mesh, as
    accelerate's ``fsdp2_prepare_model`` does, in this one process over torch's fake process group (world 4, no
    communication: every rank holds the same share, so the gathered counts are rank 0's four times). No training
    step runs: the fields a step fills (dtype, batch) are what a correct run records."""
    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfscale.measure.readback import _fsdp_facts, _qualname, _wrapper_kind, count_parameters_held
    from hfscale.techniques import multi_machine

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp_replicate * dp_shard)
    try:
        pc = ParallelismConfig(dp_replicate_size=dp_replicate, dp_shard_size=dp_shard)
        device_mesh = pc.build_device_mesh("cpu")
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
        for layer in model.model.layers:
            fully_shard(layer, mesh=device_mesh[tuple(pc.fsdp_dim_names)])
        fully_shard(model, mesh=device_mesh[tuple(pc.fsdp_dim_names)])
        total, local = count_parameters_held(model)
        sharding, offload = _fsdp_facts(model, model, _wrapper_kind(model))
        fsdp_mesh, shard_ranks = multi_machine.fsdp_mesh_facts(model)
        device_mesh_sizes = mesh._mesh_sizes(types.SimpleNamespace(device_mesh=device_mesh))
        return VerificationRecord(
            distributed_type="FSDP", world_size=4, device="cpu", mixed_precision="no", wrapper=_wrapper_kind(model),
            wrapper_class=_qualname(model), params_total=total, params_local_per_rank=[local] * 4,
            linear_layer="model.layers.0.self_attn.q_proj", linear_output_dtype="float32",
            optimizer_class="torch.optim.adamw.AdamW", optimizer_implementation="foreach",
            fsdp_sharding=sharding, fsdp_cpu_offload=offload, global_batch_size=16,
            machine_rank_per_rank=[0] * 4, hostname_per_rank=["host-a"] * 4, fsdp_mesh=fsdp_mesh,
            fsdp_shard_groups=[shard_ranks], device_mesh=device_mesh_sizes,
            linear_weight_placements=mesh._linear_weight_placements(model),
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_full_shard_on_a_replicating_mesh_is_verified_as_hybrid_sharding():
    """FSDP2 ``full_shard`` with ``parallelism: {dp_replicate: 2, dp_shard: 2}`` runs hybrid-sharded: FSDP2 reads
    an HSDP mesh and each rank holds half the parameters. Verification expects what the mesh implies; it expected
    ``full_shard`` and a quarter (the row was ``not_applied``)."""
    record = fsdp2_record_on_a_fake_world(dp_replicate=2, dp_shard=2)
    assert record.fsdp_sharding == "hybrid_shard" and record.fsdp_mesh == {"dp_replicate": 2, "dp_shard": 2}
    assert record.params_local_max == record.params_total // 2
    assert record.device_mesh == {"dp_replicate": 2, "dp_shard": 2}
    assert check(HSDP_MESH, record) == []
    # The estimate divides the model states by the same group (hfscale.estimate.states.shard_group).
    assert HSDP_MESH.shard_group_size == 2 and HSDP_MESH.fsdp_mesh == {"dp_replicate": 2, "dp_shard": 2}


def test_a_flat_mesh_where_the_device_mesh_replicates_is_caught():
    """The fallback: a flat mesh of 4 where dp_replicate 2 x dp_shard 2 was asked (a quarter per rank, every
    all-gather across all ranks) is named by the sharding, the mesh and the share held."""
    flat = fsdp2_record_on_a_fake_world(dp_replicate=1, dp_shard=4)
    assert flat.fsdp_sharding == "full_shard" and flat.params_local_max == flat.params_total // 4
    problems = check(HSDP_MESH, flat)
    assert any("FSDP runs full_shard, expected hybrid_shard for fsdp.sharding='full_shard'" in p for p in problems)
    assert any("FSDP2 sharded on a mesh of dp_shard 4, expected dp_replicate 2 x dp_shard 2" in p for p in problems)
    assert any("sharded further than hybrid_shard asks" in p for p in problems), problems
    assert any("the device mesh that ran is dp_shard 4" in p for p in problems), problems


HSDP_TP = Strategy(
    name="hsdp-tp", device="cpu", num_processes=8, per_device_batch_size=2, fsdp=FsdpSpec(), precision="bf16",
    parallelism=ParallelismSpec(dp_replicate=2, dp_shard=2, tp=2), gradient_checkpointing=True,
    gradient_accumulation_steps=2,
)  # fmt: skip


def hsdp_tp_record(**changes) -> VerificationRecord:
    """What the HSDP x tp trial on 8 CPU processes records (measured in
    test_hsdp_beside_tensor_parallel_over_eight_cpu_processes)."""
    base = VerificationRecord(
        distributed_type="MULTI_CPU", world_size=8, device="cpu", mixed_precision="bf16", wrapper="FSDP2",
        wrapper_class="transformers.FSDPLlamaForCausalLM", params_total=115_008, params_local_per_rank=[28_832] * 8,
        linear_layer="model.layers.0.self_attn.q_proj", linear_output_dtype="bfloat16",
        optimizer_class="torch.optim.adamw.AdamW", optimizer_implementation="fused", fsdp_sharding="hybrid_shard",
        fsdp_cpu_offload=False, fsdp_param_dtype="bfloat16", global_batch_size=16, gradient_checkpointing=True,
        machine_rank_per_rank=[0] * 8, hostname_per_rank=["host-a"] * 8,
        fsdp_mesh={"dp_replicate": 2, "dp_shard": 2}, fsdp_shard_groups=[[0, 2], [1, 3], [4, 6], [5, 7]],
        device_mesh={"dp_shard": 4, "tp": 2},
        linear_weight_placements="dp_replicate=Replicate(), fsdp=_StridedShard(dim=0, sf=2), tp=Shard(dim=0)",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_hsdp_beside_tp_is_checked_against_the_mesh_accelerate_gets_and_the_share_tp_leaves():
    """A rank of HSDP x tp holds a quarter of the split weights (dp_shard x tp), not the half a replica's dp_shard
    ranks alone would leave; accelerate's mesh has the replicas folded into dp_shard. Over two machines, one a
    replica, a shard group must stay inside a machine."""
    assert check(HSDP_TP, hsdp_tp_record()) == []
    over_sharded = check(HSDP_TP, hsdp_tp_record(params_local_per_rank=[115_008 // 8] * 8))
    assert any("sharded further than hybrid_shard asks: 14,376 of 115,008 elements on the fullest rank, expected "
               "about 1/4 (the dp_shard x tp ranks of one replica, parallelism dp_replicate=2, dp_shard=2, cp=1, "
               "tp=2)" in p for p in over_sharded), over_sharded  # fmt: skip
    unfolded = check(HSDP_TP, hsdp_tp_record(device_mesh={"dp_replicate": 2, "dp_shard": 4, "tp": 2}))
    assert unfolded == [
        "the device mesh that ran is dp_replicate 2, dp_shard 4, tp 2, accelerate's mesh for parallelism "
        "dp_replicate 2, dp_shard 2, tp 2 is dp_shard 4, tp 2"
    ]
    two_machines = HSDP_TP.replace(num_machines=2)
    on_machines = {"machine_rank_per_rank": [0, 0, 0, 0, 1, 1, 1, 1], "hostname_per_rank": ["a"] * 4 + ["b"] * 4}
    assert check(two_machines, hsdp_tp_record(**on_machines)) == []
    spanning = check(two_machines, hsdp_tp_record(**on_machines, fsdp_shard_groups=[[0, 4], [1, 5], [2, 6], [3, 7]]))
    assert any("ranks [0, 4], which span machines [0, 1]: dp_replicate 2 over 2 machines keeps each shard group "
               "inside one machine" in p for p in spanning), spanning  # fmt: skip


def test_a_replicating_device_mesh_over_machines_keeps_each_shard_group_inside_one():
    """accelerate's own FSDP2 on ``parallelism: {dp_replicate: 2, dp_shard: 2}``: over 2 machines each replica is a
    machine, so a shard group across them is a fallback; over 4 machines a replica spans two, which is what was
    asked; ``fsdp.sharding: hybrid_shard`` beside the mesh is decided by the mesh, as it runs."""
    from hfscale.techniques import multi_machine

    record = fsdp2_record_on_a_fake_world(dp_replicate=2, dp_shard=2)

    def groups_check(strategy: Strategy, groups: list[list[int]]) -> list[str]:
        machines = [rank * strategy.num_machines // 4 for rank in range(4)]
        placed = dataclasses.replace(
            record,
            machine_rank_per_rank=machines,
            hostname_per_rank=[f"h{m}" for m in machines],
            fsdp_shard_groups=groups,
        )
        return multi_machine.check(strategy, placed)

    two = HSDP_MESH.replace(num_machines=2)
    assert groups_check(two, [[0, 1], [2, 3]]) == []
    assert any("ranks [0, 2], which span machines [0, 1]: dp_replicate 2 over 2 machines" in p
               for p in groups_check(two, [[0, 2], [1, 3]]))  # fmt: skip
    assert groups_check(HSDP_MESH.replace(num_machines=4, num_processes=4), [[0, 1], [2, 3]]) == []
    # hybrid_shard beside dp_replicate 2 x dp_shard 4 on 4 machines x 2: the mesh's replicas span two machines each.
    hybrid = HSDP_MESH.replace(
        fsdp=FsdpSpec(sharding="hybrid_shard"), num_processes=8, num_machines=4,
        parallelism=ParallelismSpec(dp_replicate=2, dp_shard=4),
    )  # fmt: skip
    eight = dataclasses.replace(
        record, world_size=8, params_local_per_rank=[record.params_total // 4] * 8,
        machine_rank_per_rank=[rank // 2 for rank in range(8)], hostname_per_rank=[f"h{r // 2}" for r in range(8)],
        fsdp_mesh={"dp_replicate": 2, "dp_shard": 4}, fsdp_shard_groups=[[0, 1, 2, 3], [4, 5, 6, 7]],
    )  # fmt: skip
    assert multi_machine.check(hybrid, eight) == []
