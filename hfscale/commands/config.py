"""``hfscale config``: write the accelerate YAML, DeepSpeed JSON and TrainingArguments for one strategy.

Example::

    hfscale config --bf16 --gradient-checkpointing --zero-stage 3 --offload-optimizer cpu \\
        --num-processes 8 --out configs/zero3

writes ``configs/zero3/{accelerate.yaml,deepspeed.json,training_args.json}`` and prints the
``accelerate launch`` command that uses them. A contradictory strategy exits with status 2 and the reason.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, get_args

from hfscale.configs.accelerate import user_command
from hfscale.configs.fsdp import fsdp_by_accelerate, transformers_fsdp_refusal
from hfscale.core.files import os_error_text
from hfscale.strategy import (
    AttnImplementation,
    CompileMode,
    CompileSpec,
    DeepSpeedSpec,
    FsdpSharding,
    FsdpSpec,
    LoraSpec,
    OffloadDevice,
    Optimizer,
    ParallelismSpec,
    Strategy,
    StrategyError,
    precision_from_flags,
)
from hfscale.techniques.mesh_limits import replicas_beside_tp, tp_beside_other_dims

PROG = "hfscale config"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Write accelerate.yaml, deepspeed.json (with --zero-stage) and training_args.json for a training "
            "strategy, and print the accelerate launch command that uses them."
        ),
    )
    parser.add_argument("--out", required=True, type=Path, help="folder to write the configs into (created)")
    parser.add_argument("--name", default="baseline", help="strategy label (default: %(default)s)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default: %(default)s")
    groups = (_training_options, _deepspeed_options, _fsdp_options, _lora_options, _kernel_options, _process_options)
    for add_group in groups:  # one option group each, in the order --help lists them
        add_group(parser)
    return parser


def _training_options(parser: argparse.ArgumentParser) -> None:
    train = parser.add_argument_group("precision, memory and optimizer")
    train.add_argument("--fp16", action="store_true", help="fp16 mixed precision (GPU only)")
    train.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    train.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward (FSDP: its own)"
    )
    train.add_argument(
        "--optim",
        choices=get_args(Optimizer),
        default=None,
        help="the Trainer's optim (default: left out, so the installed transformers' default runs)",
    )
    train.add_argument("--batch-size", type=int, default=8, help="per-device batch size (default: %(default)s)")
    train.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: %(default)s)")
    train.add_argument(
        "--activation-offload",
        action="store_true",
        help="keep the activations saved for backward in CPU memory (one line in your script, printed below)",
    )


def _deepspeed_options(parser: argparse.ArgumentParser) -> None:
    ds = parser.add_argument_group("DeepSpeed ZeRO (on when --zero-stage is given)")
    ds.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    offload_choices = [c for c in get_args(OffloadDevice) if c != "none"]
    ds.add_argument("--offload-optimizer", choices=offload_choices, help="offload optimizer states (stage 1-3)")
    ds.add_argument("--offload-param", choices=offload_choices, help="offload parameters (stage 3)")
    ds.add_argument("--nvme-path", help="folder for NVMe offload")
    ds.add_argument(
        "--ds-partition-activations",
        action="store_true",
        help="DeepSpeed activation checkpointing: split checkpoints over model-parallel ranks (needs "
        "--gradient-checkpointing)",
    )
    ds.add_argument(
        "--ds-cpu-checkpointing",
        action="store_true",
        help="DeepSpeed activation checkpointing: keep checkpoints in CPU memory (needs --gradient-checkpointing)",
    )


def _fsdp_options(parser: argparse.ArgumentParser) -> None:
    fsdp = parser.add_argument_group("PyTorch FSDP (on when --fsdp is given)")
    fsdp.add_argument(
        "--fsdp",
        nargs="?",
        const="full_shard",
        choices=get_args(FsdpSharding),
        help="FSDP with this sharding (default when given without a value: full_shard)",
    )
    fsdp.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2, help="default: %(default)s")
    fsdp.add_argument("--fsdp-cpu-offload", action="store_true", help="keep sharded parameters in CPU memory")
    fsdp.add_argument(
        "--fsdp-layer-cls", help="transformer block class to wrap, e.g. LlamaDecoderLayer (default: the model's)"
    )


def _tcp_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port between 1 and 65535, got {port}")
    return port


def _lora_options(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA / QLoRA through peft (on when --lora-rank is given)")
    lora.add_argument("--lora-rank", type=int, help="rank of the adapters")
    lora.add_argument("--lora-alpha", type=int, help="scaling numerator (default: 16)")
    lora.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (default: 0)")
    lora.add_argument("--lora-target", nargs="+", help="module names to adapt (default: peft's for the model type)")
    lora.add_argument("--qlora", action="store_true", help="store the frozen base's Linear weights in 4-bit NF4")


def _kernel_options(parser: argparse.ArgumentParser) -> None:
    kern = parser.add_argument_group("compilation and kernels")
    kern.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="torch.compile the model (backend, default inductor; eager/aot_eager trace without codegen)",
    )
    kern.add_argument("--compile-mode", choices=get_args(CompileMode), help="inductor's mode (default: default)")
    kern.add_argument("--attn", choices=get_args(AttnImplementation), help="attention kernel the model is built with")
    kern.add_argument("--tf32", action="store_true", help="TF32 matmuls for fp32 (Ampere or newer GPUs)")
    kern.add_argument("--liger", action="store_true", help="Liger's Triton kernels (GPU, supported model types)")


def _process_options(parser: argparse.ArgumentParser) -> None:
    dist = parser.add_argument_group("processes and machines")
    dist.add_argument("--num-processes", type=int, default=1, help="processes on all machines (default: 1)")
    dist.add_argument("--num-machines", type=int, default=1, help="default: %(default)s")
    dist.add_argument("--machine-rank", type=int, default=0, help="this machine's rank (default: %(default)s)")
    dist.add_argument("--main-process-ip", help="address of machine 0 (needed with --num-machines > 1)")
    dist.add_argument("--main-process-port", type=_tcp_port, help="rendezvous port on machine 0 (1-65535)")
    dist.add_argument(
        "--data-parallel",
        choices=("ddp", "dp"),
        default="ddp",
        help="ddp: one process per GPU under a launcher; dp: one process driving --num-processes GPUs through "
        "nn.DataParallel (default: %(default)s)",
    )
    dist.add_argument(
        "--tp",
        type=int,
        help="tensor parallel over this many processes (a device mesh); with --fsdp, FSDP2 shards over the rest "
        "(with transformers 5, by transformers itself when it loads the model: full_shard and its own wrapping; "
        "--fsdp hybrid_shard: a replica on each machine)",
    )


def strategy_from_args(args: argparse.Namespace) -> Strategy:
    """The :class:`Strategy` the command-line options describe.

    Raises:
        StrategyError: on contradictory options.
    """
    ds_only = {
        "--offload-optimizer": args.offload_optimizer,
        "--offload-param": args.offload_param,
        "--nvme-path": args.nvme_path,
        "--ds-partition-activations": args.ds_partition_activations or None,
        "--ds-cpu-checkpointing": args.ds_cpu_checkpointing or None,
    }
    deepspeed = None
    if args.zero_stage is not None:
        deepspeed = DeepSpeedSpec(
            zero_stage=args.zero_stage,
            offload_optimizer=args.offload_optimizer or "none",
            offload_param=args.offload_param or "none",
            nvme_path=args.nvme_path,
            partition_activations=args.ds_partition_activations,
            cpu_checkpointing=args.ds_cpu_checkpointing,
        )
    elif given := [flag for flag, value in ds_only.items() if value is not None]:
        raise StrategyError(f"{', '.join(given)} configure DeepSpeed ZeRO: add --zero-stage 1, 2 or 3")
    fsdp = None
    if args.fsdp is not None:
        fsdp = FsdpSpec(
            sharding="full_shard" if args.tp is not None and args.fsdp == "hybrid_shard" else args.fsdp,  # the mesh's
            version=args.fsdp_version,
            cpu_offload=args.fsdp_cpu_offload,
            transformer_layer_cls=args.fsdp_layer_cls,
        )
    elif args.fsdp_cpu_offload or args.fsdp_layer_cls:
        raise StrategyError("--fsdp-cpu-offload and --fsdp-layer-cls configure FSDP: add --fsdp")
    lora = None
    if args.lora_rank is not None:
        given = {"alpha": args.lora_alpha, "dropout": args.lora_dropout}
        lora = LoraSpec(
            rank=args.lora_rank,
            target_modules=tuple(args.lora_target) if args.lora_target else None,
            quantize_base="4bit" if args.qlora else "none",
            **{key: value for key, value in given.items() if value is not None},
        )
    elif args.lora_target or args.qlora or args.lora_alpha is not None or args.lora_dropout is not None:
        raise StrategyError("--lora-target, --lora-alpha, --lora-dropout and --qlora configure LoRA: add --lora-rank")
    strategy = Strategy(
        name=args.name,
        device=args.device,
        precision=precision_from_flags(fp16=args.fp16, bf16=args.bf16),
        gradient_checkpointing=args.gradient_checkpointing,
        optimizer=args.optim,
        per_device_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        activation_offload=args.activation_offload,
        deepspeed=deepspeed,
        fsdp=fsdp,
        num_processes=args.num_processes,
        num_machines=args.num_machines,
        lora=lora,
        data_parallel=args.data_parallel,
        parallelism=_mesh_from_args(args),
        **_kernels_from_args(args),
    )
    _refuse_what_cannot_train(strategy, args)
    return strategy


def _refuse_what_cannot_train(strategy: Strategy, args: argparse.Namespace) -> None:
    """The recipe's rules for a mesh (:mod:`hfscale.techniques.mesh_limits`,
    :func:`~hfscale.configs.fsdp.transformers_fsdp_refusal`), in the options' names."""
    mesh = f"--tp {args.tp} with --num-processes {args.num_processes}"
    for why in (replicas_beside_tp(strategy, fsdp_option="(add --fsdp)"), tp_beside_other_dims(strategy)):
        if why is not None:
            raise StrategyError(f"{mesh}: {why}")
    if (setting := transformers_fsdp_refusal(strategy)) is not None:
        option = {"fsdp.transformer_layer_cls": "--fsdp-layer-cls", "precision": "--fp16"}.get(setting[0], "--fsdp")
        raise StrategyError(f"{option} with --tp {args.tp}: {setting[1]}")


def _kernels_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--compile [BACKEND]``, ``--compile-mode``, ``--attn``, ``--tf32``, ``--liger`` as strategy fields."""
    if args.compile_mode is not None and args.compile is None:
        raise StrategyError("--compile-mode configures torch.compile: add --compile")
    compile_spec = None
    if args.compile is not None:
        compile_spec = CompileSpec(backend=args.compile, mode=args.compile_mode or "default")
    return {
        "torch_compile": compile_spec,
        "attn_implementation": args.attn,
        "tf32": args.tf32,
        "use_liger_kernel": args.liger,
    }


def _mesh_from_args(args: argparse.Namespace) -> ParallelismSpec | None:
    """``--tp N``: a mesh of tp N, with FSDP2 sharding over the remaining processes (``--fsdp``; ``--fsdp
    hybrid_shard``: a replica on each machine, sharded over its processes, HSDP x tp), else replicas (refused with
    the rest of the strategy: :func:`_refuse_what_cannot_train`)."""
    if args.tp is None:
        return None
    if args.tp < 1 or args.num_processes % args.tp:
        raise StrategyError(f"--tp {args.tp}: expected a positive divisor of --num-processes {args.num_processes}")
    rest = args.num_processes // args.tp
    if args.fsdp is None:
        return ParallelismSpec(tp=args.tp, dp_replicate=rest)
    replicas = args.num_machines if args.fsdp == "hybrid_shard" else 1
    if args.fsdp == "hybrid_shard" and replicas == 1:
        raise StrategyError(
            f"--tp {args.tp} --fsdp hybrid_shard replicates across machines: give --num-machines > 1 (on one "
            "machine, --fsdp full_shard)"
        )
    if rest % replicas or rest // replicas == 1:
        where = f" on each of {replicas} machines" if replicas > 1 else ""
        raise StrategyError(
            f"--tp {args.tp} --fsdp {args.fsdp} with --num-processes {args.num_processes}: FSDP2 needs processes "
            f"left to shard over{where} (the processes besides tp, {rest}, split evenly, at least 2 a replica)"
        )
    return ParallelismSpec(tp=args.tp, dp_shard=rest // replicas, dp_replicate=replicas)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): return it instead of exiting the caller
        return int(exc.code or 0)
    from hfscale.configs import write_configs

    try:
        strategy = strategy_from_args(args)
        generated = write_configs(
            strategy,
            args.out,
            transformer_layer_cls=args.fsdp_layer_cls,
            machine_rank=args.machine_rank,
            main_process_ip=args.main_process_ip,
            main_process_port=args.main_process_port,
        )
    except (StrategyError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: argument --out: cannot write the configs: {os_error_text(exc)}", file=sys.stderr)
        return 2

    print(f"strategy: {strategy.describe()}")
    print("wrote:")
    written = (
        generated.accelerate_yaml,
        generated.deepspeed_json,
        generated.training_args_json,
        generated.strategy_json,
    )
    for path in written:
        if path is not None:
            print(f"  {path}")
    launch = user_command(strategy, str(generated.accelerate_yaml))[:-1]  # "dp": a plain python, no launcher
    print("\nlaunch your training script with:")
    if strategy.num_machines > 1:
        print(f"  (on machine R of {strategy.num_machines}, R = 0 .. {strategy.num_machines - 1})")
        launch += ["--machine_rank", "R"]
    print(f"  {shlex.join(launch)} your_script.py")
    print(
        "\nand build its TrainingArguments from training_args.json:\n"
        f"  TrainingArguments(output_dir=..., **json.load(open({str(generated.training_args_json)!r})))"
    )
    for why, line in script_lines(strategy, generated.strategy_json.parent if generated.strategy_json else args.out):
        print(f"\n{why}:\n  {line}")
    for note in _notes(strategy, args):
        print(f"\nnote: {note}")
    return 0


def _notes(strategy: Strategy, args: argparse.Namespace) -> list[str]:
    """What the printed configs leave to the user's judgement."""
    notes = []
    if fsdp_by_accelerate(strategy) and strategy.fsdp.auto_wrap == "transformer_layer" and not args.fsdp_layer_cls:  # type: ignore[union-attr]
        notes.append(
            "no --fsdp-layer-cls, so FSDP wraps the classes in the model's _no_split_modules; where one of them holds "
            "the input embedding (BERT's BertEmbeddings) FSDP2 fails ('Invariant encountered'): name the block "
            "class (--fsdp-layer-cls BertLayer)"
        )
    if strategy.parallelism is not None and strategy.parallelism.tp > 1:
        notes.append(
            "training_args.json sets average_tokens_across_devices true for a causal LM under tp (its loss divides by "
            "the token count, which the Trainer divides by tp); set it false for a model whose loss ignores "
            "num_items_in_batch (sequence classification), which it would multiply by the data-parallel size"
        )
    return notes


def script_lines(strategy: Strategy, config_dir: Path) -> list[tuple[str, str]]:
    """``(why, line)`` for each line a user's own training script needs beside the generated files, in the order
    they go in the script.

    A strategy that no generated file can make take effect gets its line here, never a silent fallback: FSDP on
    several CPU processes needs :data:`hfscale.techniques.fsdp_cpu.SCRIPT_LINE` (without it accelerate runs DDP). The
    last line
    adds :class:`hfscale.callbacks.VerificationCallback`, which fails the run when what runs is not ``strategy``.
    """
    from hfscale.techniques import SCRIPT_ORDER

    lines = [line for technique in SCRIPT_ORDER for line in technique.script_lines(strategy)]
    lines.append(
        (
            "and after building the Trainer, this line checks at the first step that what runs is what was asked "
            "(it raises on a mismatch)",
            f"from hfscale.callbacks import VerificationCallback, attach; "
            f"attach(trainer, VerificationCallback({str(config_dir)!r}))",
        )
    )
    return lines


if __name__ == "__main__":
    sys.exit(main())
