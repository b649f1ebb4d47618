"""Reading what ran back from the objects that trained: the wrapper, the parameters each rank holds, the optimizer
and its states, FSDP's settings, the batch, checkpointing, and the dtype a Linear produced.

Each reader takes the Trainer's objects after (or during) training and answers from them, never from the arguments
that asked; one that cannot read a fact (a library whose internals moved) answers None.
:func:`hfscale.measure.verify.collect` assembles them into a :class:`~hfscale.records.measurements.VerificationRecord`
(its module docstring lists what each field is read from).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hfscale.core.params import fsdp2_param_groups
from hfscale.records.measurements import Wrapper
from hfscale.strategy import FsdpSharding

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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
            # bitsandbytes' Linear4bit (QLoRA's base) computes in its compute dtype but casts its output back to
            # the input's dtype, so it cannot show autocast: the next Linear (a LoRA adapter's) is observed instead.
            if isinstance(module, torch.nn.Linear) and type(module).__name__ != "Linear4bit":
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
        if not torch.compiler.is_compiling():  # unhooking inside a traced region breaks the compiled graph
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
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "DDP"
    if isinstance(model, DataParallel):  # one process driving several GPUs (strategy.data_parallel "dp")
        return "DataParallel"
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


def count_parameters_held(model: torch.nn.Module) -> tuple[int, int]:
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


def _optimizer_implementation(optimizer: Any) -> str | None:
    """``fused``, ``foreach`` or ``for-loop`` for a torch optimizer (an unset option resolved as torch's own
    ``step`` resolves it), None for any other optimizer."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer) or not type(optimizer).__module__.startswith("torch.optim"):
        return None
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    foreach = defaults.get("foreach")
    if foreach is None and "foreach" in defaults:
        try:
            from torch.optim.optimizer import _default_to_fused_or_foreach

            params = [p for group in optimizer.param_groups for p in group["params"]]
            _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
        except (ImportError, TypeError):  # a private helper; its absence leaves the kernel unread
            return None
    return "foreach" if foreach else "for-loop"


def _fsdp_facts(model_wrapped: Any, model: Any, wrapper: Wrapper) -> tuple[FsdpSharding | None, bool | None]:
    """``(sharding, cpu_offload)`` of an FSDP-wrapped model, or ``(None, None)`` where it cannot be read."""
    if wrapper == "FSDP1":
        strategy = getattr(getattr(model_wrapped, "sharding_strategy", None), "name", None)
        sharding = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard"}.get(
            strategy or "", "hybrid_shard" if strategy and "HYBRID" in strategy else None
        )
        offload = getattr(getattr(model_wrapped, "cpu_offload", None), "offload_params", None)
        return sharding, None if offload is None else bool(offload)  # type: ignore[return-value]
    if wrapper != "FSDP2":
        return None, None
    # FSDP2 keeps its settings in each unit's parameter group (private attributes: read defensively). The root
    # unit may stop resharding after forward whatever was asked (backward comes next), so the other units decide.
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

        groups = [(module is model, group) for module, group in fsdp2_param_groups(model)]
        if not groups:
            return None, None
        inner = [g for is_root, g in groups if not is_root] or [g for _, g in groups]
        offload = any(isinstance(g.offload_policy, CPUOffloadPolicy) for _, g in groups)
        reshards = any(g.post_forward_mesh_info is not None for g in inner)
        if reshards and any(isinstance(g.mesh_info, HSDPMeshInfo) for g in inner):
            return "hybrid_shard", offload  # the mesh itself is compared by multi_machine.check (fsdp_mesh)
        return ("full_shard" if reshards else "shard_grad_op"), offload
    except (ImportError, AttributeError) as exc:
        logger.warning("FSDP2's sharding and offload could not be read (torch internals moved?): %s", exc)
        return None, None


def _fsdp2_param_dtype(model: Any, wrapper: Wrapper) -> str | None:
    """The dtype(s) FSDP2 gathers the floating-point parameters in (:attr:`VerificationRecord.fsdp_param_dtype`),
    read from each unit's parameters after training: the policy's ``param_dtype``, else the stored dtype."""
    if wrapper != "FSDP2":
        return None
    try:
        dtypes = {
            str(fsdp_param.param_dtype or fsdp_param.orig_dtype).removeprefix("torch.")
            for _, group in fsdp2_param_groups(model)
            for fsdp_param in group.fsdp_params
            if fsdp_param.orig_dtype.is_floating_point
        }
    except AttributeError as exc:
        # FSDP2 sets its dtypes up at the first forward: a run that never took a step has none yet.
        logger.warning("FSDP2's parameter dtype could not be read (no forward yet, or torch internals moved): %s", exc)
        return None
    return ",".join(sorted(dtypes)) or None


def _global_batch_size(trainer: Any, model_wrapped: Any, wrapper: Wrapper, world_size: int) -> int | None:
    if wrapper == "DeepSpeedEngine":
        return int(model_wrapped.train_batch_size())
    # The batch the Trainer's data loader really used (auto_find_batch_size lowers it), not the argument. The
    # Trainer's loop accumulates over args.gradient_accumulation_steps itself (accelerate's count stays 1).
    batch = getattr(trainer, "_train_batch_size", None) or getattr(trainer.args, "train_batch_size", None)
    if batch is None:
        return None
    return int(batch) * int(trainer.args.gradient_accumulation_steps) * world_size


__all__ = ["LinearDtypeProbe", "count_parameters_held"]
