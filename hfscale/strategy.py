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

Precision = Literal["fp32", "fp16", "bf16"]
Optimizer = Literal["adamw_torch", "adamw_torch_fused", "adafactor", "adamw_bnb_8bit", "paged_adamw_8bit", "sgd"]
OffloadDevice = Literal["none", "cpu", "nvme"]
FsdpSharding = Literal["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"]
Device = Literal["cuda", "cpu"]

EIGHT_BIT_OPTIMIZERS: frozenset[str] = frozenset({"adamw_bnb_8bit", "paged_adamw_8bit"})
NON_ADAM_OPTIMIZERS: frozenset[str] = frozenset({"adafactor", "sgd"})


class StrategyError(ValueError):
    """A strategy that cannot run as described; the message names the fields and says why."""


def _check_choice(owner: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise StrategyError(f"{owner}.{name}: expected one of {valid}, got {value!r}")


def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyError(f"{owner}.{name}: expected a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class DeepSpeedSpec:
    """DeepSpeed ZeRO settings. Values the Trainer knows (batch, lr, precision) are left to it as "auto"."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """ZeRO stage: 0 plain data parallel, 1 optimizer states, 2 + gradients, 3 + parameters sharded."""
    offload_optimizer: OffloadDevice = "none"
    """Where optimizer states (and the step) live: DeepSpeed swaps in its CPU Adam when offloaded."""
    offload_param: OffloadDevice = "none"
    """Where parameters live between uses; ZeRO-3 only."""
    nvme_path: str | None = None
    """Folder for NVMe offload; required when either offload is "nvme"."""

    def __post_init__(self) -> None:
        _check_choice("deepspeed", "zero_stage", self.zero_stage, (0, 1, 2, 3))
        _check_choice("deepspeed", "offload_optimizer", self.offload_optimizer, get_args(OffloadDevice))
        _check_choice("deepspeed", "offload_param", self.offload_param, get_args(OffloadDevice))
        if self.offload_param != "none" and self.zero_stage != 3:
            raise StrategyError(
                f"deepspeed.offload_param={self.offload_param!r} needs deepspeed.zero_stage=3, got "
                f"{self.zero_stage}: only ZeRO-3 partitions parameters, so only it can offload them"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise StrategyError(
                f"deepspeed.offload_optimizer={self.offload_optimizer!r} needs deepspeed.zero_stage 1, 2 or 3, "
                "got 0: ZeRO-Offload moves the partitioned optimizer states, and stage 0 partitions none"
            )
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_param)
        if uses_nvme and not self.nvme_path:
            raise StrategyError("deepspeed.nvme_path is required when an offload device is 'nvme'")
        if self.offload_optimizer == "nvme" and self.zero_stage != 3:
            # ZeRO-1/2 take any offload device as "cpu" (stage_1_and_2.py); only ZeRO-3 swaps to NVMe.
            raise StrategyError(
                f"deepspeed.offload_optimizer='nvme' needs deepspeed.zero_stage=3, got {self.zero_stage}: ZeRO-1/2 "
                "silently keep the optimizer states in CPU memory instead; use 'cpu' or stage 3"
            )

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_param != "none"


@dataclass(frozen=True, kw_only=True)
class FsdpSpec:
    """PyTorch FSDP settings, as accelerate's FullyShardedDataParallelPlugin takes them."""

    sharding: FsdpSharding = "full_shard"
    """full_shard (ZeRO-3-like), shard_grad_op (ZeRO-2-like), hybrid_shard (shard within a machine,
    replicate across machines), no_shard (DDP)."""
    version: Literal[1, 2] = 2
    """FSDP2 (``fully_shard``, per-parameter DTensor sharding) by default; FSDP1 needs an accelerator."""
    auto_wrap: Literal["transformer_layer", "none"] = "transformer_layer"
    """Wrap each transformer block as its own FSDP unit (the model's ``_no_split_modules``), or only the root."""
    transformer_layer_cls: str | None = None
    """Class name of the block to wrap; None takes it from the model's ``_no_split_modules``."""
    cpu_offload: bool = False
    """Keep sharded parameters (and their gradients and optimizer states) in CPU memory."""

    def __post_init__(self) -> None:
        _check_choice("fsdp", "sharding", self.sharding, get_args(FsdpSharding))
        _check_choice("fsdp", "version", self.version, (1, 2))
        _check_choice("fsdp", "auto_wrap", self.auto_wrap, ("transformer_layer", "none"))
        if self.version == 2 and self.sharding == "no_shard":
            raise StrategyError(
                "fsdp.sharding='no_shard' with fsdp.version=2: FSDP2 has no unsharded mode (accelerate and "
                "transformers accept only full_shard/shard_grad_op/hybrid_shard); leave fsdp unset for plain DDP"
            )
        if self.transformer_layer_cls is not None and self.auto_wrap != "transformer_layer":
            raise StrategyError(
                "fsdp.transformer_layer_cls is set but fsdp.auto_wrap is 'none': the class is only used by "
                "transformer-layer auto-wrapping"
            )


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

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_sharding()
        self._check_device()
        self._check_optimizer()

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

    # -- derived views -------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.num_processes

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across every process."""
        return self.per_device_batch_size * self.gradient_accumulation_steps * self.num_processes

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

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
        elif self.distributed:
            parts.append("DDP")
        batch = f"bs {self.per_device_batch_size} x acc {self.gradient_accumulation_steps}"
        if self.num_processes > 1:
            batch += f" x {self.num_processes} proc"
        parts.append(batch)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Strategy:
        """Inverse of :meth:`to_dict`. Unknown keys are rejected by name (recipes go through ``hfscale.recipe``)."""
        data = dict(data)
        _reject_unknown("strategy", data, cls)
        if isinstance(data.get("deepspeed"), dict):
            _reject_unknown("deepspeed", data["deepspeed"], DeepSpeedSpec)
            data["deepspeed"] = DeepSpeedSpec(**data["deepspeed"])
        if isinstance(data.get("fsdp"), dict):
            _reject_unknown("fsdp", data["fsdp"], FsdpSpec)
            data["fsdp"] = FsdpSpec(**data["fsdp"])
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
    "DeepSpeedSpec",
    "FsdpSpec",
    "Strategy",
    "StrategyError",
    "default_optimizer",
    "precision_from_flags",
]
