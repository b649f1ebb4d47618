"""What ran, verified: a record read from inside a training run, and a check of it against the strategy asked for.

Many misconfigurations raise nothing. On a CPU machine accelerate turns an FSDP request into DDP; fp16 stays
fp32; an optimizer name can be replaced by DeepSpeed's own. A sweep that trusted the exit code would report DDP
figures under an FSDP name. So every trial reads, after training and from the objects that trained:

============================  =====================================================================================
field                         read from
============================  =====================================================================================
``distributed_type``          ``AcceleratorState().distributed_type`` (``NO``, ``MULTI_CPU``, ``DEEPSPEED``, ...)
``world_size``, ``device``    ``AcceleratorState().num_processes`` / ``.device.type``
``wrapper``                   the model the Trainer stepped (``trainer.model_wrapped``): ``none``, ``DDP``,
                              ``DeepSpeedEngine``, ``FSDP2`` (a ``torch.distributed.fsdp.FSDPModule``) or ``FSDP1``
``zero_stage``                ``DeepSpeedEngine.zero_optimization_stage()``
``zero_offload_*``            the ZeRO optimizer's own offload flags (``cpu_offload`` / ``offload_optimizer``,
                              ``offload_param``)
``params_total``              elements of every parameter, unsharded (``ds_numel`` under ZeRO-3, the DTensor's
                              global shape under FSDP2)
``params_local_per_rank``     elements each rank holds (the ZeRO-3 partition ``ds_tensor``, the FSDP2 local shard),
                              gathered from every rank
``linear_output_dtype``       the dtype an ``nn.Linear`` produced in the first training forward (forward hook):
                              autocast or a half-precision engine happened
``optimizer_class``,          the innermost optimizer (unwrapping accelerate's and DeepSpeed's wrappers) and the
``optimizer_state_dtypes``    dtypes of its state tensors (``uint8``: 8-bit states happened)
``gradient_checkpointing``    ``model.is_activation_checkpointing`` or a ``CheckpointWrapper`` (FSDP's own
                              activation checkpointing)
============================  =====================================================================================

:func:`check` turns a record and a :class:`~hfscale.strategy.Strategy` into a list of mismatches in words; the
trial runner makes any mismatch a ``not_applied`` result, never a silent row.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hfscale.strategy import EIGHT_BIT_OPTIMIZERS, Strategy

if TYPE_CHECKING:
    import torch
    from transformers import Trainer

logger = logging.getLogger(__name__)

Wrapper = Literal["none", "DDP", "DeepSpeedEngine", "FSDP2", "FSDP1"]

_EXPECTED_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Parameters held per rank may exceed total / world by padding (each ZeRO-3 partition and each FSDP2 shard is
# rounded up); a quarter more than an even share is far below "everything" for two or more ranks.
_SHARD_SLACK = 1.25


@dataclass(kw_only=True)
class VerificationRecord:
    """What really ran in one trial, read from inside the run (see the module docstring for each source)."""

    distributed_type: str
    """accelerate's ``DistributedType`` name: ``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``DEEPSPEED``, ``FSDP``."""
    world_size: int
    """Processes in the process group."""
    device: str
    """Device type the model trained on (``cpu``, ``cuda``)."""
    mixed_precision: str
    """accelerate's ``mixed_precision`` (``no``, ``bf16``, ``fp16``); ``no`` under DeepSpeed, which casts itself."""
    wrapper: Wrapper
    """What wrapped the model the Trainer stepped."""
    wrapper_class: str
    """Qualified class name of that model object, for a human reading the record."""
    zero_stage: int | None = None
    """ZeRO stage the DeepSpeed engine runs; None without DeepSpeed."""
    zero_offload_optimizer: bool | None = None
    """Whether the ZeRO optimizer keeps its states (and steps) off the accelerator; None without DeepSpeed."""
    zero_offload_param: bool | None = None
    """Whether ZeRO-3 keeps parameters off the accelerator; None without ZeRO-3."""
    params_total: int
    """Parameter elements of the whole (unsharded) model, tied weights counted once."""
    params_local_per_rank: list[int] = field(default_factory=list)
    """Parameter elements each rank holds, in rank order."""
    linear_layer: str | None = None
    """Name of the ``nn.Linear`` whose output dtype was observed."""
    linear_output_dtype: str | None = None
    """dtype of that layer's output in the first training forward (``float32``, ``bfloat16``, ``float16``)."""
    optimizer_class: str | None = None
    """Qualified class name of the innermost optimizer (the one holding the states)."""
    optimizer_wrappers: list[str] = field(default_factory=list)
    """Class names from the Trainer's optimizer object inwards, ending with :attr:`optimizer_class`."""
    optimizer_state_dtypes: list[str] = field(default_factory=list)
    """Sorted dtypes of the optimizer's state tensors with more than one element (``uint8`` for 8-bit states)."""
    gradient_checkpointing: bool = False
    """Whether activations are recomputed in backward (the model's flag or FSDP's checkpoint wrappers)."""

    @property
    def params_local_max(self) -> int:
        """Most parameter elements any rank holds."""
        return max(self.params_local_per_rank, default=self.params_total)

    @property
    def sharded(self) -> bool:
        """Whether no rank holds every parameter element."""
        return self.params_local_max < self.params_total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerificationRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class LinearDtypeProbe:
    """Records the dtype one ``nn.Linear`` of the model outputs in the first training forward, then unhooks.

    Hooks the first ``nn.Linear`` in module order (a query projection, or a head). The hook is installed when the
    probe is built, before the Trainer wraps the model: DDP, DeepSpeed and FSDP2 all keep the inner modules, so
    the hook sees the forward the engine really runs, under its autocast or its cast weights. One observation,
    then the hook is removed, so it costs nothing after the first step.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        import torch

        self.layer_name: str | None = None
        self.output_dtype: str | None = None
        self._handle: Any = None
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.layer_name = name
                self._handle = module.register_forward_hook(self._hook)
                break
        if self._handle is None:
            logger.warning("no nn.Linear in %s: the compute dtype cannot be observed", type(model).__name__)

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        import torch

        if not module.training or not isinstance(output, torch.Tensor):
            return
        self.output_dtype = str(output.dtype).removeprefix("torch.")
        self.remove()

    def remove(self) -> None:
        """Unhook (also done by the first observation)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _wrapper_kind(model: Any) -> Wrapper:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "DDP"
    if type(model).__name__ == "DeepSpeedEngine":  # no deepspeed import where it is not installed
        return "DeepSpeedEngine"
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return "FSDP1"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has FSDP2 as a private module only
        return "none"
    return "FSDP2" if isinstance(model, FSDPModule) else "none"


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(total, local)`` parameter elements: the whole model's, and what this rank holds.

    ZeRO-3 parameters carry their full size in ``ds_numel`` and this rank's partition in ``ds_tensor``; FSDP2
    parameters are DTensors whose ``numel()`` is the global size and ``to_local()`` this rank's shard; any other
    parameter counts as held whole (FSDP1's views of its local shard: ``local`` is right, ``total`` is not).
    """
    from torch.distributed.tensor import DTensor

    total = local = 0
    for param in model.parameters():
        if hasattr(param, "ds_numel"):
            total += int(param.ds_numel)
            local += int(param.ds_tensor.numel())
        elif isinstance(param, DTensor):
            total += param.numel()
            local += param.to_local().numel()
        else:
            total += param.numel()
            local += param.numel()
    return total, local


def _unwrap_optimizer(optimizer: Any) -> list[Any]:
    chain = []
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        chain.append(optimizer)
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def _state_dtypes(optimizer: Any) -> list[str]:
    import torch

    dtypes: set[str] = set()
    for state in getattr(optimizer, "state", {}).values():
        if not isinstance(state, dict):
            continue
        for value in state.values():
            # One-element tensors are step counters and scalars; the states are the big ones.
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                dtypes.add(str(value.dtype).removeprefix("torch."))
    return sorted(dtypes)


def _zero_offload(optimizer_chain: list[Any]) -> tuple[bool | None, bool | None]:
    for opt in optimizer_chain:
        name = type(opt).__name__
        if name == "DeepSpeedZeroOptimizer_Stage3":
            return bool(opt.offload_optimizer), bool(opt.offload_param)
        if name == "DeepSpeedZeroOptimizer":
            return bool(opt.cpu_offload), None
    return None, None


def _gradient_checkpointing(model: Any) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:  # transformers < 5
        flag = getattr(model, "is_gradient_checkpointing", False)
    if flag:
        return True
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:
        return False
    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def _gather_ints(value: int, world_size: int) -> list[int]:
    import torch.distributed as dist

    if world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return [int(v) for v in values]


def collect(
    trainer: Trainer, probe: LinearDtypeProbe | None = None, *, params_total: int | None = None
) -> VerificationRecord:
    """Read what ran from a Trainer after ``train()``.

    Collective under several processes (parameters held per rank are gathered): call it on every rank.

    Args:
        trainer: a Trainer whose ``train()`` has returned.
        probe: the dtype probe added to its callbacks; None leaves the compute dtype unobserved.
        params_total: parameter elements counted before the Trainer wrapped the model. FSDP1 keeps only views of
            the local shard, so after wrapping the whole size cannot be read back; ZeRO-3 and FSDP2 still give it
            (``ds_numel``, the DTensor's global size). None counts after training.
    """
    from accelerate.state import AcceleratorState

    state = AcceleratorState()
    model_wrapped = trainer.model_wrapped
    model = trainer.model
    wrapper = _wrapper_kind(model_wrapped)
    if wrapper == "none":
        # FSDP2 turns the model itself into an FSDPModule; the Trainer may keep model_wrapped as the same object.
        wrapper = _wrapper_kind(model)
    zero_stage = None
    if wrapper == "DeepSpeedEngine":
        zero_stage = int(model_wrapped.zero_optimization_stage())
    optimizer_chain = _unwrap_optimizer(trainer.optimizer)
    offload_optimizer, offload_param = _zero_offload(optimizer_chain)
    total, local = count_parameters(model)
    if params_total is not None:
        total = params_total
    world_size = int(state.num_processes)
    return VerificationRecord(
        distributed_type=str(getattr(state.distributed_type, "name", state.distributed_type)),
        world_size=world_size,
        device=state.device.type,
        mixed_precision=str(state.mixed_precision),
        wrapper=wrapper,
        wrapper_class=_qualname(model_wrapped),
        zero_stage=zero_stage,
        zero_offload_optimizer=offload_optimizer,
        zero_offload_param=offload_param,
        params_total=total,
        params_local_per_rank=_gather_ints(local, world_size),
        linear_layer=probe.layer_name if probe else None,
        linear_output_dtype=probe.output_dtype if probe else None,
        optimizer_class=_qualname(optimizer_chain[-1]) if optimizer_chain else None,
        optimizer_wrappers=[type(o).__name__ for o in optimizer_chain],
        optimizer_state_dtypes=_state_dtypes(optimizer_chain[-1]) if optimizer_chain else [],
        gradient_checkpointing=_gradient_checkpointing(model),
    )


def _expected_wrapper(strategy: Strategy) -> Wrapper:
    if strategy.deepspeed is not None:
        return "DeepSpeedEngine"
    if strategy.fsdp is not None:
        return "FSDP2" if strategy.fsdp.version == 2 else "FSDP1"
    return "DDP" if strategy.distributed else "none"


def _expected_distributed_types(strategy: Strategy) -> tuple[str, ...]:
    if strategy.deepspeed is not None:
        return ("DEEPSPEED",)
    if strategy.fsdp is not None:
        return ("FSDP",)
    if strategy.distributed:
        return ("MULTI_CPU",) if strategy.device == "cpu" else ("MULTI_GPU",)
    return ("NO",)


def _expects_sharded_params(strategy: Strategy) -> bool:
    if not strategy.distributed:
        return False
    if strategy.deepspeed is not None:
        return strategy.deepspeed.zero_stage == 3
    # FSDP2 keeps every parameter as a sharded DTensor between uses, whatever reshard_after_forward says.
    return strategy.fsdp is not None and (strategy.fsdp.version == 2 or strategy.fsdp.sharding != "no_shard")


def _shard_group_size(strategy: Strategy) -> int:
    """Ranks one parameter is split over: all of them, or one machine's under hybrid sharding."""
    if strategy.fsdp is not None and strategy.fsdp.sharding == "hybrid_shard":
        return strategy.num_processes // strategy.num_machines
    return strategy.num_processes


def check(strategy: Strategy, record: VerificationRecord | dict[str, Any]) -> list[str]:
    """The ways ``record`` (what ran) differs from ``strategy`` (what was asked), one sentence each.

    An empty list means every verifiable part of the strategy took effect. A dict (``record.to_dict()``, as
    stored in a result row) is accepted as well.
    """
    rec = VerificationRecord.from_dict(record) if isinstance(record, dict) else record
    problems: list[str] = []
    asked = strategy.describe()

    if rec.world_size != strategy.num_processes:
        problems.append(f"{rec.world_size} process(es) ran, {strategy.num_processes} were asked for")
    if rec.device != strategy.device:
        problems.append(f"trained on {rec.device!r}, strategy.device is {strategy.device!r}")

    expected_types = _expected_distributed_types(strategy)
    if rec.distributed_type not in expected_types:
        problems.append(
            f"accelerate ran as {rec.distributed_type}, expected {' or '.join(expected_types)} for {asked!r}"
        )
    expected_wrapper = _expected_wrapper(strategy)
    if rec.wrapper != expected_wrapper:
        problems.append(
            f"the model was wrapped as {rec.wrapper} ({rec.wrapper_class}), expected {expected_wrapper} for {asked!r}"
        )

    if strategy.deepspeed is not None:
        ds = strategy.deepspeed
        if rec.zero_stage != ds.zero_stage:
            problems.append(f"the DeepSpeed engine runs ZeRO stage {rec.zero_stage}, {ds.zero_stage} was asked for")
        if ds.zero_stage > 0 and rec.zero_offload_optimizer != (ds.offload_optimizer != "none"):
            problems.append(
                f"ZeRO optimizer offload is {rec.zero_offload_optimizer}, "
                f"deepspeed.offload_optimizer={ds.offload_optimizer!r} was asked for"
            )
        if ds.zero_stage == 3 and rec.zero_offload_param != (ds.offload_param != "none"):
            problems.append(
                f"ZeRO-3 parameter offload is {rec.zero_offload_param}, "
                f"deepspeed.offload_param={ds.offload_param!r} was asked for"
            )

    held = f"{rec.params_local_max:,} of {rec.params_total:,} parameter elements on the fullest rank"
    if _expects_sharded_params(strategy):
        shards = _shard_group_size(strategy)
        if rec.params_local_max > _SHARD_SLACK * rec.params_total / shards:
            problems.append(f"parameters are not sharded: {held}, expected about 1/{shards}")
    elif rec.sharded:
        problems.append(f"parameters are sharded ({held}) but {asked!r} keeps them whole on every rank")

    expected_dtype = _EXPECTED_DTYPE[strategy.precision]
    if rec.linear_output_dtype is None:
        problems.append("no nn.Linear forward was observed, so the compute precision is unverified")
    elif rec.linear_output_dtype != expected_dtype:
        problems.append(
            f"{rec.linear_layer or 'an nn.Linear'} produced {rec.linear_output_dtype}, expected {expected_dtype} "
            f"for precision {strategy.precision!r}"
        )

    eight_bit_states = "uint8" in rec.optimizer_state_dtypes
    if strategy.optimizer in EIGHT_BIT_OPTIMIZERS and not eight_bit_states:
        problems.append(
            f"optimizer {rec.optimizer_class} holds {rec.optimizer_state_dtypes or 'no'} states, "
            f"expected uint8 states for {strategy.optimizer!r}"
        )
    elif strategy.optimizer not in EIGHT_BIT_OPTIMIZERS and eight_bit_states:
        problems.append(f"optimizer {rec.optimizer_class} holds uint8 states, {strategy.optimizer!r} was asked for")
    offloaded = strategy.deepspeed is not None and strategy.deepspeed.offload_optimizer != "none"
    if offloaded and not (rec.optimizer_class or "").endswith("DeepSpeedCPUAdam"):
        problems.append(f"optimizer offload runs {rec.optimizer_class}, expected DeepSpeed's CPU Adam")

    if rec.gradient_checkpointing != strategy.gradient_checkpointing:
        state = "active" if rec.gradient_checkpointing else "not active"
        problems.append(
            f"gradient checkpointing is {state}, strategy.gradient_checkpointing={strategy.gradient_checkpointing}"
        )
    return problems


__all__ = ["LinearDtypeProbe", "VerificationRecord", "Wrapper", "check", "collect", "count_parameters"]
