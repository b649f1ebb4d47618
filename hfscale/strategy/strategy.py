"""What a training strategy is: one frozen, validated description that every config generator reads.

A :class:`Strategy` says *how* a model is trained (precision, checkpointing, optimizer, batch, sharding, process
count), never *what* is trained. It is checked when it is built, so a contradiction (DeepSpeed and FSDP together,
parameter offload below ZeRO-3, fp16 on a CPU run, ...) fails before a single process is launched, with a message
that names the fields involved. Checks that involve two fields live on the dataclass that owns both.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal, get_args

from hfscale.strategy.specs import (
    CompileMode,
    CompileSpec,
    DeepSpeedSpec,
    FsdpSharding,
    FsdpSpec,
    LoraSpec,
    OffloadDevice,
    ParallelismSpec,
    StrategyError,
    _check_choice,
    _check_positive_int,
)

Precision = Literal["fp32", "fp16", "bf16"]
Optimizer = Literal["adamw_torch", "adamw_torch_fused", "adafactor", "adamw_bnb_8bit", "paged_adamw_8bit", "sgd"]
Device = Literal["cuda", "cpu"]
AttnImplementation = Literal["eager", "sdpa", "flash_attention_2", "flex_attention"]
DataParallel = Literal["ddp", "dp"]

EIGHT_BIT_OPTIMIZERS: frozenset[str] = frozenset({"adamw_bnb_8bit", "paged_adamw_8bit"})
NON_ADAM_OPTIMIZERS: frozenset[str] = frozenset({"adafactor", "sgd"})


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way of training a model: the unit a sweep compares.

    Raises:
        StrategyError: when the fields contradict each other or a library would refuse them at run time.
    """

    name: str = "baseline"
    """Short label used in reports and run folders (letters, digits, ``-``, ``_``, ``.``)."""
    device: Device = "cuda"
    """Where training runs. ``cpu`` makes the generators set ``use_cpu`` and rules out fp16 and FSDP1."""
    precision: Precision = "fp32"
    """fp32, or mixed precision with fp16 (loss scaling) or bf16 autocast."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them."""
    optimizer: Optimizer | None = None
    """The Trainer's ``optim`` name; None leaves it to the installed transformers' default (``adamw_torch_fused``
    in transformers 5), so the baseline is what a Trainer user gets without naming one. A recipe that reproduces
    an older table pins it (``adamw_torch``). :attr:`resolved_optimizer` says which one that is."""
    per_device_batch_size: int = 8
    """Samples per process per forward pass."""
    gradient_accumulation_steps: int = 1
    """Forward/backward passes per optimizer step."""
    deepspeed: DeepSpeedSpec | None = None
    """DeepSpeed ZeRO, or None."""
    fsdp: FsdpSpec | None = None
    """PyTorch FSDP, or None."""
    num_processes: int = 1
    """Processes in all, across every machine (accelerate's ``num_processes``)."""
    num_machines: int = 1
    """Machines taking part (accelerate's ``num_machines``)."""
    torch_compile: CompileSpec | None = None
    """Compile the model with ``torch.compile``; the first steps pay the compilation (reported apart)."""
    attn_implementation: AttnImplementation | None = None
    """Attention kernel the model is built with; None keeps transformers' default (``sdpa`` where available).
    ``eager`` materialises the seq x seq scores, which the memory estimate counts."""
    tf32: bool = False
    """Let fp32 matmuls run on TF32 tensor cores (Ampere or newer); MFU then divides by the TF32 peak."""
    lora: LoraSpec | None = None
    """Train LoRA adapters only (peft), optionally on a 4-bit base (QLoRA)."""
    activation_offload: bool = False
    """Keep the activations saved for backward in CPU memory during forward (torch saved-tensor hooks)."""
    use_liger_kernel: bool = False
    """Replace the model's norm, MLP and loss modules with Liger's Triton kernels (the Trainer's
    ``use_liger_kernel``); CUDA only, for the model types Liger supports."""
    data_parallel: DataParallel = "ddp"
    """How several GPUs of one machine train one model: ``ddp``, one process per GPU under a launcher, or
    ``dp``, one process driving ``num_processes`` GPUs through ``nn.DataParallel`` (what a plain ``python
    train.py`` on a multi-GPU machine gets from the Trainer). Under ``dp``, ``num_processes`` counts GPUs."""
    parallelism: ParallelismSpec | None = None
    """A device mesh (tensor, context, sequence parallel, HSDP) through accelerate's ``ParallelismConfig``."""

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_sharding()
        self._check_device()
        self._check_optimizer()
        self._check_techniques()
        self._check_parallelism()

    def _check_fields(self) -> None:
        if not self.name or any(not (c.isalnum() or c in "-_.") for c in self.name) or not self.name.strip("."):
            raise StrategyError(
                f"strategy.name: {self.name!r} must be non-empty letters, digits, '-', '_' or '.', and not only dots "
                "(it names a folder: '.' and '..' would be the run folder or its parent)"
            )
        _check_choice("strategy", "device", self.device, get_args(Device))
        _check_choice("strategy", "precision", self.precision, get_args(Precision))
        if self.optimizer is not None:
            _check_choice("strategy", "optimizer", self.optimizer, get_args(Optimizer))
        if not isinstance(self.gradient_checkpointing, bool):
            raise StrategyError(
                f"strategy.gradient_checkpointing: expected true or false, got {self.gradient_checkpointing!r}"
            )
        for name in ("per_device_batch_size", "gradient_accumulation_steps", "num_processes", "num_machines"):
            _check_positive_int("strategy", name, getattr(self, name))
        if self.num_processes % self.num_machines:
            raise StrategyError(
                f"strategy.num_processes={self.num_processes} is not a multiple of "
                f"strategy.num_machines={self.num_machines}: every machine runs the same number of processes"
            )

    def _check_sharding(self) -> None:
        if self.deepspeed is not None and self.fsdp is not None:
            raise StrategyError(
                "strategy.deepspeed and strategy.fsdp are both set: a model is wrapped by one engine, pick one"
            )
        if self.fsdp is not None and self.fsdp.sharding == "hybrid_shard" and self.num_machines < 2:
            raise StrategyError(
                "fsdp.sharding='hybrid_shard' needs strategy.num_machines >= 2: it shards within a machine and "
                "replicates across machines; on one machine use 'full_shard'"
            )
        if self.fsdp is not None and self.fsdp.sharding == "hybrid_shard" and self.num_processes == self.num_machines:
            raise StrategyError(
                f"fsdp.sharding='hybrid_shard' with strategy.num_processes={self.num_processes} on "
                f"strategy.num_machines={self.num_machines}: one process per machine leaves nothing to shard within "
                "a machine (a 1-wide shard dimension); use more processes per machine or plain DDP"
            )

    def _check_device(self) -> None:
        if self.device != "cpu":
            return
        if self.precision == "fp16":
            raise StrategyError(
                "strategy.precision='fp16' with strategy.device='cpu': fp16 mixed precision needs a GPU (on CPU "
                "it silently stays fp32); use 'bf16' or 'fp32'"
            )
        if self.fsdp is not None and self.fsdp.version == 1:
            raise StrategyError(
                "fsdp.version=1 with strategy.device='cpu': FSDP1 needs an accelerator device; use fsdp.version=2"
            )
        if self.fsdp is not None and self.fsdp.cpu_offload:
            # accelerate builds CPUOffloadPolicy() (pin_memory=True); pinning without an accelerator raises
            # "Cannot access accelerator device when none is available" (measured, torch 2.13 CPU).
            raise StrategyError(
                "fsdp.cpu_offload=True with strategy.device='cpu': the parameters already live in CPU memory, and "
                "FSDP2's offload pins host memory, which fails without an accelerator; drop fsdp.cpu_offload"
            )

    def _check_optimizer(self) -> None:
        if (
            self.optimizer in EIGHT_BIT_OPTIMIZERS
            and self.deepspeed is not None
            and self.deepspeed.offload_optimizer != "none"
        ):
            raise StrategyError(
                f"strategy.optimizer={self.optimizer!r} with deepspeed.offload_optimizer="
                f"{self.deepspeed.offload_optimizer!r}: ZeRO-Offload replaces the optimizer with DeepSpeed's own "
                "CPU Adam, so the 8-bit states would never exist; drop the offload or use 'adamw_torch'"
            )
        if (
            self.optimizer in NON_ADAM_OPTIMIZERS
            and self.deepspeed is not None
            and self.deepspeed.offload_optimizer != "none"
        ):
            # DeepSpeed refuses a client optimizer under ZeRO-Offload ("You are using ZeRO-Offload with a client
            # provided optimizer"), so the generated config names its AdamW, which would replace this one.
            raise StrategyError(
                f"strategy.optimizer={self.optimizer!r} with deepspeed.offload_optimizer="
                f"{self.deepspeed.offload_optimizer!r}: ZeRO-Offload runs DeepSpeed's own CPU AdamW and refuses "
                "other optimizers; drop the offload or use 'adamw_torch'"
            )

    def _check_techniques(self) -> None:
        if self.attn_implementation is not None:
            _check_choice("strategy", "attn_implementation", self.attn_implementation, get_args(AttnImplementation))
        for name in ("tf32", "activation_offload", "use_liger_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise StrategyError(f"strategy.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.device == "cpu":
            for name, why in (
                ("tf32", "TF32 is a mode of NVIDIA tensor cores (the Trainer refuses tf32 without CUDA)"),
                ("use_liger_kernel", "Liger's kernels are Triton GPU kernels"),
            ):
                if getattr(self, name):
                    raise StrategyError(f"strategy.{name}=True with strategy.device='cpu': {why}; drop it")
            if self.attn_implementation == "flash_attention_2":
                raise StrategyError(
                    "strategy.attn_implementation='flash_attention_2' with strategy.device='cpu': FlashAttention "
                    "kernels run on CUDA only; use 'sdpa' or 'eager'"
                )
        if self.tf32 and self.precision == "fp16":
            raise StrategyError(
                "strategy.tf32=True with strategy.precision='fp16': fp16 autocast runs the matmuls in half "
                "precision, so TF32 would change nothing measurable; use tf32 with 'fp32' (or 'bf16')"
            )
        if self.attn_implementation == "flash_attention_2" and self.precision == "fp32":
            raise StrategyError(
                "strategy.attn_implementation='flash_attention_2' with strategy.precision='fp32': FlashAttention "
                "takes fp16/bf16 inputs only; use precision 'bf16' or attention 'sdpa'"
            )
        ds = self.deepspeed
        if ds is not None and (ds.partition_activations or ds.cpu_checkpointing) and not self.gradient_checkpointing:
            raise StrategyError(
                "deepspeed.partition_activations/cpu_checkpointing need strategy.gradient_checkpointing=True: they "
                "say how DeepSpeed keeps checkpointed activations, and without checkpointing there are none"
            )
        if self.activation_offload and self.data_parallel == "dp":
            raise StrategyError(
                "strategy.activation_offload=True with strategy.data_parallel='dp': saved-tensor hooks are "
                "thread-local and nn.DataParallel runs each replica in its own thread; use 'ddp'"
            )
        if ds is not None and ds.cpu_checkpointing and not ds.partition_activations and self.device == "cpu":
            raise StrategyError(
                "deepspeed.cpu_checkpointing without deepspeed.partition_activations on strategy.device='cpu': "
                "DeepSpeed 0.19.8's copy to the CPU is a no-op there and it then empties the input it meant to "
                "keep (measured); add partition_activations (on one model-parallel rank it keeps the whole input)"
            )
        if self.lora is not None and self.lora.quantize_base == "4bit" and (ds is not None or self.fsdp is not None):
            raise StrategyError(
                "lora.quantize_base='4bit' with strategy.deepspeed/fsdp: sharding 4-bit base weights needs a "
                "quantised storage type hfscale does not set up; train QLoRA with plain DDP or one process"
            )

    def _check_parallelism(self) -> None:
        _check_choice("strategy", "data_parallel", self.data_parallel, get_args(DataParallel))
        if self.data_parallel == "dp":
            if self.device != "cuda":
                raise StrategyError(
                    "strategy.data_parallel='dp' with strategy.device='cpu': nn.DataParallel splits a batch over "
                    "several GPUs of one process; on CPU use 'ddp'"
                )
            if self.deepspeed is not None or self.fsdp is not None or self.parallelism is not None:
                raise StrategyError(
                    "strategy.data_parallel='dp' with deepspeed/fsdp/parallelism: those engines run one process per "
                    "device; nn.DataParallel is the single-process alternative to DDP only"
                )
            if self.num_machines != 1 or self.num_processes < 2:
                raise StrategyError(
                    f"strategy.data_parallel='dp' needs strategy.num_processes >= 2 GPUs on num_machines=1, got "
                    f"{self.num_processes} on {self.num_machines}: it is one process driving several GPUs"
                )
            if self.lora is not None and self.lora.quantize_base == "4bit":
                # transformers' Trainer._wrap_model skips nn.DataParallel for a model loaded in 4 bits.
                raise StrategyError(
                    "strategy.data_parallel='dp' with lora.quantize_base='4bit': the Trainer never wraps a 4-bit "
                    "model in nn.DataParallel, so one GPU would train the whole batch; use 'ddp'"
                )
        p = self.parallelism
        if p is None:
            return
        if p.size != self.num_processes:
            raise StrategyError(
                f"parallelism: dp_replicate x dp_shard x tp x cp x sp = {p.dp_replicate} x {p.dp_shard} x {p.tp} x "
                f"{p.cp} x {p.sp} = {p.size}, but strategy.num_processes={self.num_processes}: the mesh must cover "
                "every process exactly once"
            )
        if p.sp > 1 and self.deepspeed is None:
            raise StrategyError(
                "parallelism.sp > 1 needs strategy.deepspeed: sequence parallel here is DeepSpeed's Ulysses"
            )
        if (p.dp_shard > 1 or p.cp > 1) and (self.fsdp is None or self.fsdp.version != 2):
            raise StrategyError(
                "parallelism.dp_shard/cp > 1 need strategy.fsdp with version 2: accelerate shards and splits the "
                "context over the mesh with FSDP2 only"
            )
        # accelerate 1.15's ParallelismConfig._validate_accelerator refuses these at launch; refuse them at load.
        if self.fsdp is not None and p.size > 1 and self.fsdp.version != 2:
            raise StrategyError("parallelism with fsdp.version=1: accelerate takes a mesh with FSDP2 only")
        if self.fsdp is not None and p.size > 1 and p.dp_shard == 1 and p.cp == 1:
            raise StrategyError(
                "parallelism with strategy.fsdp needs dp_shard or cp > 1: FSDP2 shards over dp_shard x cp, and "
                "accelerate refuses a mesh with neither; drop fsdp or give dp_shard the other processes"
            )
        if self.deepspeed is not None and (p.tp > 1 or p.cp > 1):
            raise StrategyError(
                "parallelism.tp/cp > 1 with strategy.deepspeed: accelerate applies tensor and context parallel with "
                "FSDP2 or without an engine, not under DeepSpeed"
            )

    # -- derived views -------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes in the process group: one under ``data_parallel='dp'``, else :attr:`num_processes`."""
        return 1 if self.data_parallel == "dp" else self.num_processes

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across every process. The ranks of one tensor, context or sequence parallel
        group train on the same samples, so they count once (``num_processes / (tp x cp x sp)`` batches)."""
        p = self.parallelism
        shared = p.tp * p.cp * p.sp if p is not None else 1
        return self.per_device_batch_size * self.gradient_accumulation_steps * self.num_processes // shared

    @property
    def distributed(self) -> bool:
        """Whether several processes train (a launcher is needed); ``dp`` runs in one."""
        return self.world_size > 1

    @property
    def fsdp_mesh(self) -> dict[str, int] | None:
        """The mesh FSDP2 shards parameters on, dimension -> size: each parameter is split over ``dp_shard`` ranks,
        and under hybrid sharding ``dp_replicate`` such groups each hold a replica. ``hybrid_shard`` replicates
        across machines and shards within each; a device mesh (``parallelism``) shards over ``dp_shard x cp`` and
        replicates over ``dp_replicate`` (accelerate's ``ParallelismConfig.fsdp_dim_names``), so ``full_shard``
        there is hybrid sharding whenever ``dp_replicate > 1``; else one dimension over every process. None
        without FSDP2."""
        fsdp = self.fsdp
        if fsdp is None or fsdp.version != 2:
            return None
        p = self.parallelism
        if p is not None and p.size > 1:
            replicate = {"dp_replicate": p.dp_replicate} if p.dp_replicate > 1 else {}
            return replicate | {"dp_shard": p.dp_shard * p.cp}
        if fsdp.sharding == "hybrid_shard":
            return {"dp_replicate": self.num_machines, "dp_shard": self.num_processes // self.num_machines}
        return {"dp_shard": self.num_processes}

    @property
    def shard_group_size(self) -> int:
        """Processes that split one copy of the model states between them (what the estimate divides by and the
        verification expects each rank to hold a share of): every process under DeepSpeed and FSDP ``full_shard`` /
        ``shard_grad_op``, one machine's under ``hybrid_shard``, FSDP2's ``dp_shard`` dimension under a device mesh
        (:attr:`fsdp_mesh`), one under ``no_shard``."""
        if self.fsdp is None:
            return self.num_processes
        if self.fsdp.sharding == "no_shard":
            return 1
        mesh = self.fsdp_mesh
        if mesh is not None:
            return mesh["dp_shard"]
        if self.fsdp.sharding == "hybrid_shard":  # FSDP1
            return self.num_processes // self.num_machines
        return self.num_processes

    @property
    def ds_activation_checkpointing(self) -> list[str]:
        """The DeepSpeed activation-checkpointing options turned on (empty without DeepSpeed)."""
        ds = self.deepspeed
        if ds is None:
            return []
        return [n for n in ("partition_activations", "cpu_checkpointing") if getattr(ds, n)]

    @property
    def resolved_optimizer(self) -> str:
        """The ``optim`` the Trainer runs: :attr:`optimizer`, or the installed transformers' default when unset.

        Raises:
            ImportError: when the optimizer is unset and transformers is not installed.
        """
        return self.optimizer if self.optimizer is not None else default_optimizer()

    def describe(self) -> str:
        """The strategy in words, as a report row shows it."""
        parts = [self.precision]
        if self.gradient_checkpointing:
            parts.append("grad-ckpt")
        parts.append(self.optimizer or "default optimizer")
        if self.deepspeed is not None:
            ds = self.deepspeed
            zero = f"ZeRO-{ds.zero_stage}"
            offload = [
                f"{what}->{dev}"
                for what, dev in (("opt", ds.offload_optimizer), ("param", ds.offload_param))
                if dev != "none"
            ]
            parts.append(zero + (f" offload({', '.join(offload)})" if offload else ""))
        elif self.fsdp is not None:
            f = self.fsdp
            parts.append(f"FSDP{f.version} {f.sharding}" + (" cpu-offload" if f.cpu_offload else ""))
        elif self.distributed and (self.parallelism is None or self.parallelism.tp == 1):  # tp runs unwrapped
            parts.append("DDP")
        elif self.data_parallel == "dp":
            parts.append(f"DataParallel x {self.num_processes} GPU")
        if self.parallelism is not None:
            mesh = self.parallelism.mesh()
            parts.append("mesh " + (" x ".join(f"{k} {v}" for k, v in mesh.items()) or "1"))
        if self.ds_activation_checkpointing:
            parts.append("DS act-ckpt(" + ", ".join(self.ds_activation_checkpointing) + ")")
        if self.attn_implementation is not None:
            parts.append(f"attn {self.attn_implementation}")
        if self.torch_compile is not None:
            c = self.torch_compile
            parts.append(f"compile {c.backend}" + (f"/{c.mode}" if c.mode != "default" else ""))
        if self.tf32:
            parts.append("tf32")
        if self.use_liger_kernel:
            parts.append("liger")
        if self.activation_offload:
            parts.append("act-offload")
        if self.lora is not None:
            q = "Q" if self.lora.quantize_base == "4bit" else ""
            parts.append(f"{q}LoRA r{self.lora.rank}")
        batch = f"bs {self.per_device_batch_size} x acc {self.gradient_accumulation_steps}"
        if self.num_processes > 1:
            batch += f" x {self.num_processes} proc"
        if self.num_machines > 1:
            batch += f" on {self.num_machines} machines"
        parts.append(batch)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Strategy:
        """Inverse of :meth:`to_dict`. Unknown keys are rejected by name (recipes go through
        ``hfscale.recipes.recipe``)."""
        data = dict(data)
        _reject_unknown("strategy", data, cls)
        for key, spec_cls in (
            ("deepspeed", DeepSpeedSpec),
            ("fsdp", FsdpSpec),
            ("torch_compile", CompileSpec),
            ("lora", LoraSpec),
            ("parallelism", ParallelismSpec),
        ):
            if isinstance(data.get(key), dict):
                _reject_unknown(key, data[key], spec_cls)
                data[key] = spec_cls(**data[key])
        return cls(**data)

    def replace(self, **changes: Any) -> Strategy:
        return dataclasses.replace(self, **changes)


@functools.cache
def default_optimizer() -> str:
    """The ``optim`` that ``transformers.TrainingArguments`` uses when none is given, read from the installed
    version's field default (``adamw_torch_fused`` in transformers 5, ``adamw_torch`` in 4.x), never assumed.

    Raises:
        ImportError: when transformers is not installed.
    """
    try:
        from transformers import TrainingArguments
    except ImportError as exc:
        raise ImportError(
            "strategy.optimizer is unset, which means the Trainer's default optimizer, and transformers is not "
            "installed to say which that is: pip install transformers, or set strategy.optimizer"
        ) from exc
    default = TrainingArguments.__dataclass_fields__["optim"].default
    return str(getattr(default, "value", default))


def precision_from_flags(*, fp16: bool = False, bf16: bool = False) -> Precision:
    """Map Trainer-style ``fp16``/``bf16`` flags to one precision.

    Raises:
        StrategyError: when both are set.
    """
    if fp16 and bf16:
        raise StrategyError("fp16 and bf16 are both set: mixed precision uses one half-precision type, pick one")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def _reject_unknown(owner: str, data: dict[str, Any], cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise StrategyError(f"{owner}: unknown key(s) {', '.join(unknown)}; valid keys are {', '.join(sorted(known))}")


__all__ = [
    "EIGHT_BIT_OPTIMIZERS",
    "NON_ADAM_OPTIMIZERS",
    "AttnImplementation",
    "CompileMode",
    "CompileSpec",
    "DataParallel",
    "DeepSpeedSpec",
    "Device",
    "FsdpSharding",
    "FsdpSpec",
    "LoraSpec",
    "OffloadDevice",
    "Optimizer",
    "ParallelismSpec",
    "Precision",
    "Strategy",
    "StrategyError",
    "default_optimizer",
    "precision_from_flags",
]
