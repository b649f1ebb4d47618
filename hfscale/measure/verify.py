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
``mixed_precision``           ``AcceleratorState().mixed_precision`` (``no``, ``bf16``, ``fp16``)
``optimizer_class``,          the innermost optimizer (unwrapping accelerate's and DeepSpeed's wrappers) and the
``optimizer_state_dtypes``    dtypes of its state tensors (``uint8``: 8-bit states happened)
``optimizer_implementation``  a torch optimizer's kernel: ``fused``, ``foreach`` or ``for-loop`` (its ``fused`` and
                              ``foreach`` options, an unset one resolved as torch resolves it)
``fsdp_sharding``,            FSDP2: whether the wrapped blocks reshard after forward (``full_shard``, on a 2-D
``fsdp_cpu_offload``          mesh ``hybrid_shard``) or not (``shard_grad_op``) and the ``CPUOffloadPolicy``;
                              FSDP1: the wrapper's ``sharding_strategy`` and ``cpu_offload.offload_params``
``global_batch_size``         samples per optimizer step across ranks: as the trial counted them in the batches,
                              else the DeepSpeed engine's ``train_batch_size()``, else the Trainer's batch (after any
                              change it made) x accumulation steps x processes
``gradient_checkpointing``    ``model.is_activation_checkpointing`` or a ``CheckpointWrapper`` (FSDP's own
                              activation checkpointing)
============================  =====================================================================================

:func:`check` turns a record and a :class:`~hfscale.strategy.Strategy` into a list of mismatches in words; the
trial runner makes any mismatch a ``not_applied`` result, never a silent row. Every field of the strategy is
compared with what ran: processes and device, the engine (distributed type and wrapper), ZeRO stage and offloads,
FSDP sharding and offload, whether parameters are sharded, precision (accelerate's setting and the dtype a Linear
produced), the optimizer (class, kernel, 8-bit states, DeepSpeed's CPU Adam under offload), gradient checkpointing
and the global batch (per-device batch x accumulation x processes). A field the record could not read (None:
an older record, or a library whose internals moved) is left out of the comparison rather than guessed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hfscale.records.measurements import VerificationRecord, Wrapper
from hfscale.strategy import EIGHT_BIT_OPTIMIZERS, FsdpSharding, Strategy
from hfscale.techniques import activation_offload, kernels, lora, mesh, multi_machine

if TYPE_CHECKING:
    import torch
    from transformers import Trainer

logger = logging.getLogger(__name__)


_EXPECTED_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_EXPECTED_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
# The Trainer's `optim` name -> the class it builds (transformers.trainer_optimizer) and, for torch's AdamW, the
# kernel. 8-bit optimizers are recognised by their uint8 states and their bitsandbytes class.
_EXPECTED_OPTIMIZER: dict[str, tuple[str, str | None]] = {
    "adamw_torch": ("torch.optim.adamw.AdamW", None),
    "adamw_torch_fused": ("torch.optim.adamw.AdamW", "fused"),
    "adafactor": ("transformers.optimization.Adafactor", None),
    "sgd": ("torch.optim.sgd.SGD", None),
    "adamw_bnb_8bit": ("bitsandbytes.", None),
    "paged_adamw_8bit": ("bitsandbytes.", None),
}
# Parameters held per rank may exceed total / world by padding (each ZeRO-3 partition and each FSDP2 shard is
# rounded up); a quarter more than an even share is far below "everything" for two or more ranks.
_SHARD_SLACK = 1.25


class VerificationError(RuntimeError):
    """What ran is not the strategy that was asked for (raised by ``hfscale.callbacks.VerificationCallback``)."""

    def __init__(self, message: str, mismatches: list[str]) -> None:
        super().__init__(message)
        self.mismatches = mismatches
        """The mismatches, one sentence each (:func:`check`)."""


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
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

        groups = []
        for module in model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    groups.append((module is model, group))
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


def _global_batch_size(trainer: Any, model_wrapped: Any, wrapper: Wrapper, world_size: int) -> int | None:
    if wrapper == "DeepSpeedEngine":
        return int(model_wrapped.train_batch_size())
    # The batch the Trainer's data loader really used (auto_find_batch_size lowers it), not the argument. The
    # Trainer's loop accumulates over args.gradient_accumulation_steps itself (accelerate's count stays 1).
    batch = getattr(trainer, "_train_batch_size", None) or getattr(trainer.args, "train_batch_size", None)
    if batch is None:
        return None
    return int(batch) * int(trainer.args.gradient_accumulation_steps) * world_size


def collect(
    trainer: Trainer,
    probe: LinearDtypeProbe | None = None,
    *,
    params_total: int | None = None,
    samples_per_step: int | None = None,
    attention_probe: kernels.AttentionProbe | None = None,
) -> VerificationRecord:
    """Read what ran from a Trainer after ``train()``.

    Collective under several processes (parameters held per rank are gathered): call it on every rank.

    Args:
        trainer: a Trainer whose ``train()`` has returned.
        probe: the dtype probe added to its callbacks; None leaves the compute dtype unobserved.
        params_total: parameter elements counted before the Trainer wrapped the model. FSDP1 keeps only views of
            the local shard, so after wrapping the whole size cannot be read back; ZeRO-3 and FSDP2 still give it
            (``ds_numel``, the DTensor's global size). None counts after training.
        samples_per_step: samples per optimizer step across ranks as counted in the batches the model received
            (``ThroughputCallback.summary.samples_per_step``); None reads the engine's and the Trainer's batch.
        attention_probe: the attention probe installed at train begin
        (:class:`hfscale.techniques.kernels.AttentionProbe`);
            None leaves ``attention_scores_kept`` unread.
    """
    from accelerate.state import AcceleratorState

    state = AcceleratorState()
    model_wrapped = trainer.model_wrapped
    model = trainer.model
    wrapper = _wrapper_kind(kernels.uncompiled(model_wrapped))  # accelerate compiles after wrapping in DDP
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
    fsdp_sharding, fsdp_offload = _fsdp_facts(model_wrapped, model, wrapper)
    if samples_per_step is None:
        samples_per_step = _global_batch_size(trainer, model_wrapped, wrapper, world_size)
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
        optimizer_implementation=_optimizer_implementation(optimizer_chain[-1]) if optimizer_chain else None,
        fsdp_sharding=fsdp_sharding,
        fsdp_cpu_offload=fsdp_offload,
        global_batch_size=samples_per_step,
        gradient_checkpointing=_gradient_checkpointing(model),
        **activation_offload.collect(trainer),
        **lora.collect(model),
        **multi_machine.collect(model, world_size),
        **mesh.collect(trainer),
        **kernels.collect(trainer, model, attention_probe),
    )


def _expected_wrapper(strategy: Strategy) -> Wrapper:
    if strategy.deepspeed is not None:
        return "DeepSpeedEngine"
    if strategy.fsdp is not None:
        return "FSDP2" if strategy.fsdp.version == 2 else "FSDP1"
    if strategy.data_parallel == "dp":
        return "DataParallel"
    if mesh.tensor_parallel(strategy):  # accelerate leaves a tensor-parallel model unwrapped (no DDP)
        return "none"
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


def _expected_fsdp_sharding(strategy: Strategy) -> FsdpSharding:
    """The sharding FSDP reports running for ``strategy``: what was asked, except that ``full_shard`` on a mesh that
    replicates (``parallelism.dp_replicate > 1``) is hybrid sharding (accelerate hands FSDP2 the 2-D mesh)."""
    asked = strategy.fsdp.sharding  # type: ignore[union-attr]
    fsdp_mesh = strategy.fsdp_mesh
    if asked == "full_shard" and fsdp_mesh is not None and "dp_replicate" in fsdp_mesh:
        return "hybrid_shard"
    return asked


def check(strategy: Strategy, record: VerificationRecord | dict[str, Any]) -> list[str]:
    """The ways ``record`` (what ran) differs from ``strategy`` (what was asked), one sentence each.

    An empty list means every part of the strategy took effect, as far as the record could read it (see the
    module docstring for what is compared; a field the record holds as None is not). A dict (``record.to_dict()``,
    as stored in a result row) is accepted as well. An unset ``strategy.optimizer`` is compared as the installed
    transformers' default (:attr:`~hfscale.strategy.Strategy.resolved_optimizer`).
    """
    rec = VerificationRecord.from_dict(record) if isinstance(record, dict) else record
    problems: list[str] = []
    asked = strategy.describe()

    if rec.world_size != strategy.world_size:  # one process under data_parallel "dp"
        problems.append(f"{rec.world_size} process(es) ran, {strategy.world_size} were asked for")
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

    if strategy.fsdp is not None:
        expected_sharding = _expected_fsdp_sharding(strategy)
        if rec.fsdp_sharding is not None and rec.fsdp_sharding != expected_sharding:
            asked_sharding = f"fsdp.sharding={strategy.fsdp.sharding!r} was asked for"
            if expected_sharding != strategy.fsdp.sharding:
                layout = " x ".join(f"{k} {v}" for k, v in (strategy.fsdp_mesh or {}).items())
                asked_sharding = f"expected {expected_sharding} for {asked_sharding} on a mesh of {layout}"
            problems.append(f"FSDP runs {rec.fsdp_sharding}, {asked_sharding}")
        if rec.fsdp_cpu_offload is not None and rec.fsdp_cpu_offload != strategy.fsdp.cpu_offload:
            problems.append(
                f"FSDP CPU offload is {rec.fsdp_cpu_offload}, "
                f"fsdp.cpu_offload={strategy.fsdp.cpu_offload} was asked for"
            )

    held = f"{rec.params_local_max:,} of {rec.params_total:,} parameter elements on the fullest rank"
    if _expects_sharded_params(strategy):
        shards = strategy.shard_group_size
        if rec.params_local_max > _SHARD_SLACK * rec.params_total / shards:
            problems.append(f"parameters are not sharded: {held}, expected about 1/{shards}")
    elif rec.sharded and not mesh.tensor_parallel(strategy):  # tp shards Linear weights: mesh.check reads them
        problems.append(f"parameters are sharded ({held}) but {asked!r} keeps them whole on every rank")

    expected_mp = _EXPECTED_MIXED_PRECISION[strategy.precision]
    if rec.mixed_precision != expected_mp:
        problems.append(
            f"accelerate ran with mixed_precision={rec.mixed_precision!r}, expected {expected_mp!r} for precision "
            f"{strategy.precision!r}"
        )
    expected_dtype = _EXPECTED_DTYPE[strategy.precision]
    if rec.linear_output_dtype is None:
        problems.append("no nn.Linear forward was observed, so the compute precision is unverified")
    elif rec.linear_output_dtype != expected_dtype:
        problems.append(
            f"{rec.linear_layer or 'an nn.Linear'} produced {rec.linear_output_dtype}, expected {expected_dtype} "
            f"for precision {strategy.precision!r}"
        )

    problems += _optimizer_problems(strategy, rec)
    problems += kernels.check(strategy, rec)
    problems += activation_offload.check(strategy, rec)
    problems += lora.check(strategy, rec)
    problems += multi_machine.check(strategy, rec)
    problems += mesh.check(strategy, rec)

    if rec.global_batch_size is not None and rec.global_batch_size != strategy.global_batch_size:
        # Ranks of one tensor/context/sequence-parallel group share their batch (Strategy.global_batch_size).
        replicas = strategy.global_batch_size // (strategy.per_device_batch_size * strategy.gradient_accumulation_steps)
        problems.append(
            f"{rec.global_batch_size} samples per optimizer step across ranks ran, {strategy.global_batch_size} "
            f"were asked for (batch {strategy.per_device_batch_size} x accumulation "
            f"{strategy.gradient_accumulation_steps} x {replicas} data-parallel replica(s))"
        )

    if rec.gradient_checkpointing != strategy.gradient_checkpointing:
        state = "active" if rec.gradient_checkpointing else "not active"
        problems.append(
            f"gradient checkpointing is {state}, strategy.gradient_checkpointing={strategy.gradient_checkpointing}"
        )
    return problems


def _optimizer_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    problems = []
    optim = strategy.resolved_optimizer
    eight_bit_states = "uint8" in rec.optimizer_state_dtypes
    if optim in EIGHT_BIT_OPTIMIZERS and not eight_bit_states:
        problems.append(
            f"optimizer {rec.optimizer_class} holds {rec.optimizer_state_dtypes or 'no'} states, "
            f"expected uint8 states for {optim!r}"
        )
    elif optim not in EIGHT_BIT_OPTIMIZERS and eight_bit_states:
        problems.append(f"optimizer {rec.optimizer_class} holds uint8 states, {optim!r} was asked for")
    offloaded = strategy.deepspeed is not None and strategy.deepspeed.offload_optimizer != "none"
    if offloaded:
        # ZeRO-Offload replaces whatever was named with DeepSpeed's CPU Adam (the strategy refuses non-Adam names).
        if not (rec.optimizer_class or "").endswith("DeepSpeedCPUAdam"):
            problems.append(f"optimizer offload runs {rec.optimizer_class}, expected DeepSpeed's CPU Adam")
        return problems
    expected = _EXPECTED_OPTIMIZER.get(optim)
    if expected is None or rec.optimizer_class is None:
        return problems  # a name this table does not know (a newer transformers default), or an old record
    expected_class, expected_kernel = expected
    if not rec.optimizer_class.startswith(expected_class):
        problems.append(f"optimizer {rec.optimizer_class} ran, {optim!r} builds {expected_class.rstrip('.')}")
    elif rec.optimizer_implementation is not None:
        if expected_kernel == "fused" and rec.optimizer_implementation != "fused":
            problems.append(
                f"optimizer {rec.optimizer_class} runs its {rec.optimizer_implementation} kernel, "
                f"{optim!r} asks for fused"
            )
        elif expected_kernel is None and optim == "adamw_torch" and rec.optimizer_implementation == "fused":
            problems.append(f"optimizer {rec.optimizer_class} runs its fused kernel, {optim!r} is the unfused one")
    return problems


__all__ = [
    "LinearDtypeProbe",
    "VerificationError",
    "VerificationRecord",
    "Wrapper",
    "check",
    "collect",
    "count_parameters",
]
