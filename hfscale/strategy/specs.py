"""The nested parts of a :class:`~hfscale.strategy.Strategy`: one frozen, validated dataclass per engine or
technique (DeepSpeed ZeRO, FSDP, torch.compile, LoRA, a device mesh).

Each checks its own fields when it is built; checks that involve a part and the rest of the strategy live on
``Strategy``. ``hfscale.strategy`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

OffloadDevice = Literal["none", "cpu", "nvme"]
FsdpSharding = Literal["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


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
    partition_activations: bool = False
    """DeepSpeed activation checkpointing: split each checkpointed activation across the model-parallel ranks.
    Needs ``strategy.gradient_checkpointing`` (it changes how checkpoints are kept, not whether)."""
    cpu_checkpointing: bool = False
    """DeepSpeed activation checkpointing: keep the checkpointed activations in CPU memory between forward and
    backward. Needs ``strategy.gradient_checkpointing``."""

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
        for name in ("partition_activations", "cpu_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise StrategyError(f"deepspeed.{name}: expected true or false, got {getattr(self, name)!r}")
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
class CompileSpec:
    """``torch.compile`` of the model, as the Trainer's ``torch_compile*`` arguments take it."""

    backend: str = "inductor"
    """A ``torch._dynamo`` backend name (``inductor``; ``aot_eager`` and ``eager`` trace without generating
    kernels, which keeps a CPU test fast)."""
    mode: CompileMode = "default"
    """inductor's mode: ``reduce-overhead`` adds CUDA graphs, ``max-autotune`` searches kernels (long compile)."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise StrategyError(f"torch_compile.backend: expected a dynamo backend name, got {self.backend!r}")
        _check_choice("torch_compile", "mode", self.mode, get_args(CompileMode))
        if self.mode != "default" and self.backend != "inductor":
            raise StrategyError(
                f"torch_compile.mode={self.mode!r} with torch_compile.backend={self.backend!r}: modes are "
                "inductor's; other backends ignore them"
            )


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """LoRA adapters through ``peft``; with ``quantize_base: 4bit`` the frozen base weights are stored in 4 bits
    by bitsandbytes (QLoRA)."""

    rank: int = 8
    """Rank ``r`` of each adapter's two low-rank matrices."""
    alpha: int = 16
    """Scaling numerator: the adapter's output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    target_modules: tuple[str, ...] | None = None
    """Module names (suffixes) that get adapters; None takes peft's default for the model type."""
    quantize_base: Literal["none", "4bit"] = "none"
    """``4bit``: the base model's Linear weights stored as NF4 (QLoRA)."""

    def __post_init__(self) -> None:
        _check_positive_int("lora", "rank", self.rank)
        _check_positive_int("lora", "alpha", self.alpha)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise StrategyError(f"lora.dropout: expected a number in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None:
            if isinstance(self.target_modules, list):
                object.__setattr__(self, "target_modules", tuple(self.target_modules))
            if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
                raise StrategyError(
                    f"lora.target_modules: expected a non-empty list of module names, got {self.target_modules!r}"
                )
        _check_choice("lora", "quantize_base", self.quantize_base, ("none", "4bit"))


@dataclass(frozen=True, kw_only=True)
class ParallelismSpec:
    """A device mesh through accelerate's ``ParallelismConfig``: data parallel replicated x sharded, tensor,
    context and (DeepSpeed) sequence parallel. The sizes multiply to the process count."""

    dp_replicate: int = 1
    """Replicas of the model (DDP-like; across machines under HSDP)."""
    dp_shard: int = 1
    """Ranks each replica's parameters are sharded over (FSDP2)."""
    tp: int = 1
    """Ranks each Linear weight is split over (the model's tensor-parallel plan)."""
    cp: int = 1
    """Ranks the sequence is split over in attention (context parallel, FSDP2)."""
    sp: int = 1
    """Ranks the sequence is split over by DeepSpeed's Ulysses sequence parallel."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            _check_positive_int("parallelism", name, getattr(self, name))

    @property
    def size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp * self.sp

    def mesh(self) -> dict[str, int]:
        """The dimensions wider than one, name -> size (what a verification compares with)."""
        return {n: getattr(self, n) for n in ("dp_replicate", "dp_shard", "tp", "cp", "sp") if getattr(self, n) > 1}


__all__ = [
    "CompileMode",
    "CompileSpec",
    "DeepSpeedSpec",
    "FsdpSharding",
    "FsdpSpec",
    "LoraSpec",
    "OffloadDevice",
    "ParallelismSpec",
    "StrategyError",
]
