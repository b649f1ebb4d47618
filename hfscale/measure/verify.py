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
``fsdp_param_dtype``          FSDP2: the dtype each unit gathers its parameters in (the ``MixedPrecisionPolicy``'s
                              ``param_dtype``, else the stored dtype): bf16 gathers, not autocast alone
``global_batch_size``         samples per optimizer step across ranks: as the trial counted them in the batches,
                              else the DeepSpeed engine's ``train_batch_size()``, else the Trainer's batch (after any
                              change it made) x accumulation steps x processes
``gradient_checkpointing``    ``model.is_activation_checkpointing`` or a ``CheckpointWrapper`` (FSDP's own
                              activation checkpointing)
============================  =====================================================================================

:func:`check` turns a record and a :class:`~hfscale.strategy.Strategy` into a list of mismatches in words; the trial
runner makes any mismatch a ``not_applied`` result, never a silent row. Every field of the strategy is compared with
what ran: processes and device, the engine (distributed type and wrapper), ZeRO stage and offloads, FSDP sharding
and offload (and FSDP2's gather dtype under half precision), whether parameters are sharded, precision (accelerate's
setting and the dtype a Linear produced), the optimizer (class, kernel, 8-bit states, DeepSpeed's CPU Adam under
offload), gradient checkpointing and the global batch (per-device batch x accumulation x data-parallel ranks). A
field the record could not read (None: an older record, or a library whose internals moved) is left out of the
comparison rather than guessed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hfscale.configs.fsdp import fsdp_by_accelerate
from hfscale.core.collective import all_gather_object
from hfscale.measure.readback import (
    LinearDtypeProbe,
    _fsdp2_param_dtype,
    _fsdp_facts,
    _global_batch_size,
    _gradient_checkpointing,
    _optimizer_implementation,
    _qualname,
    _state_dtypes,
    _unwrap_optimizer,
    _wrapper_kind,
    _zero_offload,
    count_parameters_held,
)
from hfscale.records.measurements import VerificationRecord, Wrapper
from hfscale.strategy import EIGHT_BIT_OPTIMIZERS, FsdpSharding, Strategy
from hfscale.techniques import TECHNIQUES, TrainedRun, kernels, mesh

if TYPE_CHECKING:
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


# --------------------------------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------------------------------


def collect(
    trainer: Trainer,
    probe: LinearDtypeProbe | None = None,
    *,
    params_total: int | None = None,
    samples_per_step: int | None = None,
    attention_probe: kernels.AttentionProbe | None = None,
) -> VerificationRecord:
    """Read what ran from a Trainer after ``train()``.

    Collective under several processes (parameters held per rank are gathered, and so are the techniques' facts
    that need every rank): call it on every rank. Every registered technique
    (:data:`hfscale.techniques.TECHNIQUES`) adds its own fields.

    Args:
        trainer: a Trainer whose ``train()`` has returned.
        probe: the dtype probe added to its callbacks; None leaves the compute dtype unobserved.
        params_total: parameter elements counted before the Trainer wrapped the model. FSDP1 keeps only views of
            the local shard, so after wrapping the whole size cannot be read back; ZeRO-3 and FSDP2 still give it
            (``ds_numel``, the DTensor's global size). None counts after training.
        samples_per_step: samples per optimizer step across ranks as counted in the batches the model received
            (``ThroughputCallback.summary.samples_per_step``); None reads the engine's and the Trainer's batch.
        attention_probe: the attention probe installed at train begin
            (:class:`hfscale.techniques.kernels.AttentionProbe`); None leaves ``attention_scores_kept`` unread.
    """
    from accelerate.state import AcceleratorState

    state = AcceleratorState()
    model_wrapped = trainer.model_wrapped
    model = trainer.model
    wrapper = _stepped_wrapper(model_wrapped, model)
    optimizer_chain = _unwrap_optimizer(trainer.optimizer)
    offload_optimizer, offload_param = _zero_offload(optimizer_chain)
    total, local = count_parameters_held(model)
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
        zero_stage=int(model_wrapped.zero_optimization_stage()) if wrapper == "DeepSpeedEngine" else None,
        zero_offload_optimizer=offload_optimizer,
        zero_offload_param=offload_param,
        params_total=total if params_total is None else params_total,
        params_local_per_rank=[int(v) for v in all_gather_object(local, world_size)],
        linear_layer=probe.layer_name if probe else None,
        linear_output_dtype=probe.output_dtype if probe else None,
        **_optimizer_fields(optimizer_chain),
        fsdp_sharding=fsdp_sharding,
        fsdp_cpu_offload=fsdp_offload,
        fsdp_param_dtype=_fsdp2_param_dtype(model, wrapper),
        global_batch_size=samples_per_step,
        gradient_checkpointing=_gradient_checkpointing(model),
        **_technique_fields(TrainedRun(trainer=trainer, world_size=world_size, attention_probe=attention_probe)),
    )


def _stepped_wrapper(model_wrapped: Any, model: Any) -> Wrapper:
    """What wraps the model the Trainer stepped (see :func:`~hfscale.measure.readback._wrapper_kind`)."""
    wrapper = _wrapper_kind(kernels.uncompiled(model_wrapped))  # accelerate compiles after wrapping in DDP
    if wrapper == "none":
        # FSDP2 turns the model itself into an FSDPModule; the Trainer may keep model_wrapped as the same object.
        wrapper = _wrapper_kind(model)
    return wrapper


def _optimizer_fields(optimizer_chain: list[Any]) -> dict[str, Any]:
    """The optimizer's record fields: the innermost optimizer's class, states and kernel, and the wrappers."""
    inner = optimizer_chain[-1] if optimizer_chain else None
    return {
        "optimizer_class": _qualname(inner) if inner is not None else None,
        "optimizer_wrappers": [type(o).__name__ for o in optimizer_chain],
        "optimizer_state_dtypes": _state_dtypes(inner) if inner is not None else [],
        "optimizer_implementation": _optimizer_implementation(inner) if inner is not None else None,
    }


def _technique_fields(run: TrainedRun) -> dict[str, Any]:
    """Every registered technique's record fields, read from ``run`` (each names only its own)."""
    fields: dict[str, Any] = {}
    for technique in TECHNIQUES:
        read = technique.collect(run)
        shared = fields.keys() & read.keys()
        if shared:  # a registration error, not a run's: two techniques claim one field
            raise RuntimeError(f"technique {technique.name!r} reads {sorted(shared)}, already read by another")
        fields |= read
    return fields


# --------------------------------------------------------------------------------------------------------------
# What the strategy expects
# --------------------------------------------------------------------------------------------------------------


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
    if fsdp_by_accelerate(strategy):  # else accelerate sees the tp model transformers sharded
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
    transformers' default (:attr:`~hfscale.strategy.Strategy.resolved_optimizer`). After the engine, sharding,
    precision and optimizer, every registered technique (:data:`hfscale.techniques.TECHNIQUES`) checks its own
    fields, in the registry's order; the batch and checkpointing come last.
    """
    rec = VerificationRecord.from_dict(record) if isinstance(record, dict) else record
    problems = _engine_problems(strategy, rec)
    problems += _deepspeed_problems(strategy, rec)
    problems += _fsdp_problems(strategy, rec)
    problems += _sharding_problems(strategy, rec)
    problems += _precision_problems(strategy, rec)
    problems += _optimizer_problems(strategy, rec)
    for technique in TECHNIQUES:
        problems += technique.check(strategy, rec)
    problems += _batch_problems(strategy, rec)
    if rec.gradient_checkpointing != strategy.gradient_checkpointing:
        state = "active" if rec.gradient_checkpointing else "not active"
        problems.append(
            f"gradient checkpointing is {state}, strategy.gradient_checkpointing={strategy.gradient_checkpointing}"
        )
    return problems


def _engine_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """Processes, device, accelerate's distributed type and the wrapper the Trainer stepped."""
    problems = []
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
    return problems


def _deepspeed_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """The DeepSpeed engine's ZeRO stage and offloads (nothing without DeepSpeed)."""
    ds = strategy.deepspeed
    if ds is None:
        return []
    problems = []
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
    return problems


def _fsdp_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """FSDP's sharding, CPU offload and FSDP2's gather dtype (nothing without FSDP, or where the record could not read
    them)."""
    fsdp = strategy.fsdp
    if fsdp is None:
        return []
    problems = []
    expected_sharding = _expected_fsdp_sharding(strategy)
    if rec.fsdp_sharding is not None and rec.fsdp_sharding != expected_sharding:
        asked_sharding = f"fsdp.sharding={fsdp.sharding!r} was asked for"
        if expected_sharding != fsdp.sharding:
            layout = " x ".join(f"{k} {v}" for k, v in (strategy.fsdp_mesh or {}).items())
            asked_sharding = f"expected {expected_sharding} for {asked_sharding} on a mesh of {layout}"
        problems.append(f"FSDP runs {rec.fsdp_sharding}, {asked_sharding}")
    if rec.fsdp_cpu_offload is not None and rec.fsdp_cpu_offload != fsdp.cpu_offload:
        problems.append(
            f"FSDP CPU offload is {rec.fsdp_cpu_offload}, fsdp.cpu_offload={fsdp.cpu_offload} was asked for"
        )
    problems += _gather_dtype_problems(strategy, rec)
    return problems


def _gather_dtype_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """FSDP2 under half precision: every unit gathers its parameters in the half type (not read: nothing said)."""
    half = _EXPECTED_DTYPE[strategy.precision]
    ran = rec.fsdp_param_dtype
    if strategy.precision == "fp32" or ran is None or ran == half:
        return []
    if half in ran.split(","):
        return [f"FSDP2 gathers the parameters in {ran}, not {half} alone: some units gather another dtype"]
    why = "runs as autocast alone, with full-precision gathers" if ran == "float32" else f"asks for {half}"
    return [f"FSDP2 gathers the parameters in {ran}, not {half}: precision {strategy.precision} {why}"]


def _sharding_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """Whether the fullest rank holds about its share of the parameters (sharded) or all of them (kept whole)."""
    held = f"{rec.params_local_max:,} of {rec.params_total:,} parameter elements on the fullest rank"
    if _expects_sharded_params(strategy):
        shards = strategy.shard_group_size
        if rec.params_local_max > _SHARD_SLACK * rec.params_total / shards:
            return [f"parameters are not sharded: {held}, expected about 1/{shards}"]
    elif rec.sharded and not mesh.tensor_parallel(strategy):  # tp shards Linear weights: mesh.check reads them
        return [f"parameters are sharded ({held}) but {strategy.describe()!r} keeps them whole on every rank"]
    return []


def _precision_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """accelerate's mixed-precision setting and the dtype an ``nn.Linear`` produced in the first forward."""
    problems = []
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
    return problems


def _batch_problems(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """Samples per optimizer step across ranks (not compared when the record could not read them)."""
    if rec.global_batch_size is None or rec.global_batch_size == strategy.global_batch_size:
        return []
    # Ranks of one tensor/context/sequence-parallel group share their batch (Strategy.global_batch_size).
    replicas = strategy.global_batch_size // (strategy.per_device_batch_size * strategy.gradient_accumulation_steps)
    return [
        f"{rec.global_batch_size} samples per optimizer step across ranks ran, {strategy.global_batch_size} "
        f"were asked for (batch {strategy.per_device_batch_size} x accumulation "
        f"{strategy.gradient_accumulation_steps} x {replicas} data-parallel replica(s))"
    ]


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
    "count_parameters_held",
]
