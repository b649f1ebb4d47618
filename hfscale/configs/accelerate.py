"""Strategy -> the config YAML that ``accelerate launch --config_file`` reads, and the command that launches it.

What the YAML decides is *how many processes start and with which launcher*; the Trainer decides the rest from
``TrainingArguments``. Launchers by ``distributed_type`` (accelerate 1.15, ``accelerate/commands/launch.py``):

==============  ===============================================  ============================================
strategy        distributed_type                                 launcher
==============  ===============================================  ============================================
1 process       ``NO``                                           the script in this process's interpreter
DDP             ``MULTI_GPU``                                    torchrun (``torch.distributed.run``)
DeepSpeed       ``DEEPSPEED``                                    torchrun; ``deepspeed_multinode_launcher:
                                                                 standard`` keeps it torchrun across machines
FSDP            ``FSDP``                                         torchrun, with ``FSDP_*`` variables set
DataParallel    ``NO`` (``num_processes: 1``)                    one plain process that sees the trial's GPUs
                                                                 (``CUDA_VISIBLE_DEVICES``: :func:`visible_devices`)
==============  ===============================================  ============================================

A device mesh (``strategy.parallelism``) is written as the ``parallelism_config`` section only with FSDP2: accelerate
1.15's launcher refuses that section otherwise, and the Trainer takes it as ``TrainingArguments.parallelism_config``
(:mod:`hfscale.techniques.mesh`). FSDP2 beside tensor parallel on transformers 5 is launched as DDP is: transformers
shards the model itself when it loads it (:func:`hfscale.configs.fsdp.fsdp_by_transformers`).

On a CPU-only machine ``MULTI_GPU`` is what starts N real ranks (gloo DDP once ``TrainingArguments.use_cpu`` is
set); ``MULTI_CPU`` / ``--cpu`` means mpirun and without it starts a single process. So ``use_cpu`` here is only
recorded for single-process runs; the Trainer's ``use_cpu`` is what keeps the ranks on the CPU.
"""

from __future__ import annotations

import sys
from typing import Any

from hfscale.configs.fsdp import (
    fsdp_by_accelerate,
    fsdp_plugin_kwargs,
    hybrid_shard_section,
    transformers_fsdp_refusal,
)
from hfscale.strategy import Strategy

pass


def _distributed_type(strategy: Strategy) -> str:
    if strategy.deepspeed is not None:
        return "DEEPSPEED"
    if fsdp_by_accelerate(strategy):
        return "FSDP"
    if strategy.world_size > 1 or strategy.num_machines > 1:
        return "MULTI_GPU"
    return "NO"  # one process, with data_parallel "dp" too (the Trainer wraps the model in nn.DataParallel)


def _deepspeed_section(strategy: Strategy, deepspeed_config_file: str | None) -> dict[str, Any]:
    spec = strategy.deepspeed
    if spec is None:
        raise ValueError("the strategy has no DeepSpeed section (strategy.deepspeed is None)")
    section: dict[str, Any] = {"zero3_init_flag": spec.zero_stage == 3}
    if strategy.num_machines > 1:
        # torchrun on every machine, like DDP; the default (pdsh) needs passwordless ssh and a hostfile.
        section["deepspeed_multinode_launcher"] = "standard"
    if deepspeed_config_file is not None:
        # accelerate refuses zero_stage/offload/mixed_precision next to a config file ("will be ignored"):
        # the JSON holds them.
        section["deepspeed_config_file"] = str(deepspeed_config_file)
        return section
    # No JSON: accelerate's own keys, which it turns into a DeepSpeed config itself.
    if "nvme" in (spec.offload_optimizer, spec.offload_param):
        # accelerate launch passes the offload devices to the processes but not the NVMe paths (only
        # ACCELERATE_DEEPSPEED_OFFLOAD_*_DEVICE are set), so DeepSpeed would get nvme_path "none".
        raise ValueError(
            "NVMe offload needs a DeepSpeed JSON (deepspeed_config_file): accelerate launch does not pass "
            "offload_*_nvme_path from its YAML to the processes"
        )
    section |= {
        "zero_stage": spec.zero_stage,
        "offload_optimizer_device": spec.offload_optimizer,
        "offload_param_device": spec.offload_param,
        "gradient_accumulation_steps": strategy.gradient_accumulation_steps,
        "gradient_clipping": 1.0,
        "zero3_save_16bit_model": spec.zero_stage == 3,
    }
    return section


def _check_machine(strategy: Strategy, machine_rank: int, main_process_ip: str | None) -> None:
    """Refuse a machine rank outside the strategy's machines, and several machines without machine 0's address."""
    if (
        isinstance(machine_rank, bool)
        or not isinstance(machine_rank, int)
        or not 0 <= machine_rank < strategy.num_machines
    ):
        raise ValueError(
            f"machine_rank={machine_rank!r} is out of range for strategy.num_machines={strategy.num_machines}"
        )
    if strategy.num_machines > 1 and not main_process_ip:
        raise ValueError(
            f"strategy.num_machines={strategy.num_machines} needs main_process_ip (the address of machine 0)"
        )


def accelerate_config(
    strategy: Strategy,
    *,
    deepspeed_config_file: str | None = None,
    transformer_layer_cls: str | None = None,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
) -> dict[str, Any]:
    """The accelerate config (``ClusterConfig``) for a strategy, as a dict ready for ``yaml.safe_dump``.

    Args:
        strategy: the strategy.
        deepspeed_config_file: path of the DeepSpeed JSON; with it the YAML only points at the file. Without it a
            DeepSpeed strategy is written with accelerate's own ``zero_stage``/``offload_*`` keys.
        transformer_layer_cls: FSDP block class to wrap, overriding ``strategy.fsdp.transformer_layer_cls``.
        machine_rank: this machine's rank, 0 .. num_machines - 1.
        main_process_ip: address of machine 0; required when ``strategy.num_machines > 1``.
        main_process_port: rendezvous port on machine 0; None lets accelerate use 29500 (or a free one when that
            is taken, on one machine).

    Raises:
        ValueError: on a machine rank out of range, a multi-machine strategy without ``main_process_ip``, or a
            DeepSpeed config file for a strategy without DeepSpeed, or NVMe offload without a DeepSpeed config
            file (accelerate does not pass NVMe paths from its YAML to the processes), or FSDP settings beside tp
            that transformers' own sharding does not take (:func:`~hfscale.configs.fsdp.transformers_fsdp_refusal`).
    """
    _check_machine(strategy, machine_rank, main_process_ip)
    if (refused := transformers_fsdp_refusal(strategy, transformer_layer_cls)) is not None:
        raise ValueError(f"{refused[0]}: {refused[1]}")
    if deepspeed_config_file is not None and strategy.deepspeed is None:
        raise ValueError("deepspeed_config_file given, but the strategy uses no DeepSpeed")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": _distributed_type(strategy),
        "debug": False,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": machine_rank,
        "main_training_function": "main",
        "num_machines": strategy.num_machines,
        "num_processes": strategy.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": strategy.device == "cpu",
    }
    if strategy.deepspeed is None or deepspeed_config_file is None:
        # With a DeepSpeed JSON, precision is its "auto" fp16/bf16 (filled from TrainingArguments); accelerate
        # refuses mixed_precision next to deepspeed_config_file.
        config["mixed_precision"] = "no" if strategy.precision == "fp32" else strategy.precision
    if main_process_ip is not None:
        config["main_process_ip"] = main_process_ip
    if main_process_port is not None:
        config["main_process_port"] = int(main_process_port)
    if strategy.deepspeed is not None:
        config["deepspeed_config"] = _deepspeed_section(strategy, deepspeed_config_file)
    if fsdp_by_accelerate(strategy):
        config["fsdp_config"] = fsdp_plugin_kwargs(strategy, transformer_layer_cls=transformer_layer_cls)
        mesh = accelerate_section(strategy) or hybrid_shard_section(strategy)
        if mesh:
            config["parallelism_config"] = mesh
    return config


def launch_command(
    config_file: str,
    target: list[str],
    *,
    main_process_port: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The argv that runs ``target`` under ``accelerate launch --config_file config_file``.

    ``target`` is a script and its arguments (``["train.py", "--epochs", "1"]``) or a module
    (``["-m", "hfscale.trial", "spec.json"]``; accelerate's ``-m``/``--module`` makes the script name a module).
    accelerate is run as ``python -m accelerate.commands.launch`` so the launcher is the one installed for
    ``python``, whatever is on PATH. Pass the list to ``subprocess`` as is (no shell).

    Raises:
        ValueError: when ``target`` is empty.
    """
    if not target:
        raise ValueError("launch_command: target is empty; give a script (and its arguments) or -m MODULE")
    cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    if main_process_port is not None:
        cmd += ["--main_process_port", str(int(main_process_port))]
    return cmd + [str(part) for part in target]


def visible_devices(strategy: Strategy, devices: tuple[str, ...]) -> dict[str, str]:
    """The environment that makes a ``data_parallel: dp`` trial's one process see exactly its GPUs: the Trainer
    wraps the model in ``nn.DataParallel`` over every GPU it sees (``torch.cuda.device_count()``), so without it a
    machine's other GPUs would join. ``devices`` are the lock names :func:`hfscale.launch.device_lock.trial_devices`
    picked (``cuda0``, ``cuda<UUID>``). Empty for every other strategy (each rank picks its GPU by local rank).
    Fewer devices than asked are passed as they are: the verification then sees the smaller batch that ran.
    """
    if strategy.data_parallel != "dp":
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(d.removeprefix("cuda") for d in devices[: strategy.num_processes])}


def user_command(strategy: Strategy, config_file: str, script: str = "your_script.py") -> list[str]:
    """What a user runs their script with under ``strategy``, as argv (``shlex.join`` it to print): ``accelerate
    launch --config_file ...``, or for ``data_parallel: dp`` a plain ``python`` with ``CUDA_VISIBLE_DEVICES`` (one
    process; no launcher, so none can start the DDP ranks that would replace nn.DataParallel)."""
    if strategy.data_parallel == "dp":
        gpus = ",".join(str(i) for i in range(strategy.num_processes))
        return ["env", f"CUDA_VISIBLE_DEVICES={gpus}", "python", script]
    return ["accelerate", "launch", "--config_file", str(config_file), script]


__all__ = ["accelerate_config", "launch_command", "user_command", "visible_devices"]


def accelerate_section(strategy: Strategy) -> dict[str, Any]:
    """The accelerate YAML ``parallelism_config`` section (the keys ``accelerate launch`` reads, named as its
    ``--parallelism_config_*`` options), or empty where the YAML cannot carry the mesh: ``accelerate launch`` 1.15
    refuses it without FSDP2, so DDP + tensor parallel and DeepSpeed + sequence parallel take it through
    ``TrainingArguments`` only (:func:`hfscale.techniques.mesh.accelerate_parallelism_config`)."""
    p = strategy.parallelism
    if p is None or strategy.fsdp is None or strategy.fsdp.version != 2:
        return {}
    section: dict[str, Any] = {
        "parallelism_config_dp_replicate_size": p.dp_replicate,
        "parallelism_config_dp_shard_size": p.dp_shard,
        "parallelism_config_tp_size": p.tp,
        "parallelism_config_cp_size": p.cp,
    }
    if p.cp > 1:
        section["parallelism_config_cp_backend"] = "torch"
    return section
