"""What a trial measured, as typed records: memory per rank and phase, steady-state throughput, and what really
ran (the verification record, read by :mod:`hfscale.measure.verify`).

The callbacks fill them, the trial process writes them into its result, the sweep stores them in a row and the
report reads them back; they live on the bottom floor (no torch, no transformers) so that every one of those can use
them without importing the code that measures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from hfscale.strategy import FsdpSharding

MEMORY_PHASES: tuple[str, ...] = ("model_load", "forward", "backward", "optimizer_step")
"""The phases of the first optimizer step, in order (the breakdown of HF's "model training anatomy")."""


def max_present(*values: Any) -> Any:
    """The largest of the values that are not None; None when all are."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _sum_present(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """What one rank measured. Memory in GiB (2**30 bytes)."""

    rank: int
    device: Literal["cuda", "cpu"]
    """Where the model trained: CUDA figures come from the torch allocator, CPU figures are process RSS."""
    peak_gib: float | None
    """Training peak: CUDA peak allocated by tensors, CPU peak RSS (VmHWM), from train begin to the last step."""
    peak_reserved_gib: float | None
    """CUDA: peak reserved by the caching allocator (what the device really had to give); None on CPU."""
    phases_gib: dict[str, float | None]
    """Memory held at the end of each phase of the first optimizer step (CUDA allocated / CPU RSS):
    ``model_load`` (at train begin: weights, plus whatever the wrapper allocates up front: DDP buckets, DeepSpeed
    partitions and optimizer states), ``forward`` (after the first forward: + activations), ``backward`` (after the
    first backward: + gradients), ``optimizer_step`` (after the first optimizer step: + optimizer states)."""
    phase_peaks_gib: dict[str, float | None]
    """Peak within each phase; for ``model_load`` the peak from process start (or the last reset) to train begin."""
    alloc_retries: int | None
    """CUDA allocator retries (cache flushed and allocation retried: a sign of fragmentation near the limit)
    during training; None on CPU."""
    ooms: int | None
    """CUDA out-of-memory errors raised by the allocator during training; None on CPU."""
    nvml_process_used_gib: float | None
    """The driver's figure for this process (CUDA context included), the largest of the readings after the first
    optimizer step and at the end; None without NVML or where the driver does not list this pid (containers)."""
    nvml_device_used_gib: float | None
    """The driver's figure for the whole device (every process), read at the same times; None without NVML."""


@dataclass(frozen=True, kw_only=True)
class MemorySummary:
    """Memory of a training run: the max over ranks, and each rank's own figures. Memory in GiB."""

    device: Literal["cuda", "cpu"]
    world_size: int
    peak_gib: float | None
    """Training peak, max over ranks (CUDA peak allocated / CPU peak RSS)."""
    peak_reserved_gib: float | None
    """CUDA peak reserved, max over ranks; None on CPU."""
    phases_gib: dict[str, float | None]
    """Held at the end of each first-step phase (see :class:`RankMemory`), max over ranks; None if not reached."""
    phase_peaks_gib: dict[str, float | None]
    """Peak within each phase, max over ranks."""
    alloc_retries: int | None
    """CUDA allocator retries during training, summed over ranks; None on CPU."""
    ooms: int | None
    """CUDA out-of-memory errors during training, summed over ranks; None on CPU."""
    nvml_process_used_gib: float | None
    """NVML per-process memory, max over ranks; None where unavailable."""
    nvml_device_used_gib: float | None
    """NVML whole-device memory, max over ranks; None where unavailable."""
    per_rank: list[RankMemory] = field(default_factory=list)
    """Each rank's figures, in rank order."""
    notes: list[str] = field(default_factory=list)
    """How to read the phases for this run (DeepSpeed, gradient accumulation)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemorySummary:
        known = {f.name for f in dataclasses.fields(RankMemory)}
        rows = [RankMemory(**{k: v for k, v in row.items() if k in known}) for row in data.get("per_rank", [])]
        top = {f.name for f in dataclasses.fields(cls)} - {"per_rank"}
        return cls(**{k: v for k, v in data.items() if k in top}, per_rank=rows)

    @classmethod
    def from_ranks(cls, rows: list[RankMemory], notes: list[str] | None = None) -> MemorySummary:
        """Combine the ranks' figures: memory is the max over ranks, error counters the sum."""
        if not rows:
            raise ValueError("rows: expected at least one rank's figures, got none")

        def phasemax_present(attr: str) -> dict[str, float | None]:
            return {p: max_present(*(getattr(r, attr).get(p) for r in rows)) for p in MEMORY_PHASES}

        return cls(
            device=rows[0].device,
            world_size=len(rows),
            peak_gib=max_present(*(r.peak_gib for r in rows)),
            peak_reserved_gib=max_present(*(r.peak_reserved_gib for r in rows)),
            phases_gib=phasemax_present("phases_gib"),
            phase_peaks_gib=phasemax_present("phase_peaks_gib"),
            alloc_retries=_sum_present([r.alloc_retries for r in rows]),
            ooms=_sum_present([r.ooms for r in rows]),
            nvml_process_used_gib=max_present(*(r.nvml_process_used_gib for r in rows)),
            nvml_device_used_gib=max_present(*(r.nvml_device_used_gib for r in rows)),
            per_rank=sorted(rows, key=lambda r: r.rank),
            notes=list(notes or []),
        )

    def log_dict(self) -> dict[str, float]:
        """The flat ``memory/...`` keys logged through ``Trainer.log`` (None figures left out)."""
        out: dict[str, Any] = {
            "memory/peak_gib": self.peak_gib,
            "memory/peak_reserved_gib": self.peak_reserved_gib,
            "memory/alloc_retries": self.alloc_retries,
            "memory/ooms": self.ooms,
            "memory/nvml_process_used_gib": self.nvml_process_used_gib,
            "memory/nvml_device_used_gib": self.nvml_device_used_gib,
        }
        for phase in MEMORY_PHASES:
            out[f"memory/{phase}_gib"] = self.phases_gib.get(phase)
            out[f"memory/{phase}_peak_gib"] = self.phase_peaks_gib.get(phase)
        if self.world_size > 1:
            for row in self.per_rank:
                out[f"memory/rank_{row.rank}/peak_gib"] = row.peak_gib
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class ThroughputSummary:
    """Steady-state throughput of a training run, global over ranks. None figures: too few steps were measured."""

    samples_per_s: float | None
    """Samples trained per second, all ranks together, over the measured (post-warm-up) steps."""
    tokens_per_s: float | None
    """Input tokens (padding included) per second, all ranks together; None when batches carry no token ids."""
    step_time_median_s: float | None
    """Median optimizer-step time (end of one step to the end of the next; the slowest rank for each step)."""
    step_time_p90_s: float | None
    step_time_mean_s: float | None
    measured_steps: int
    """Optimizer steps in the figures: all steps but the warm-up and those interrupted by evaluation or saving."""
    warmup_steps: int
    """Leading optimizer steps left out of the figures: the count given, or the one detected (``warmup_detected``)."""
    samples_per_step: int | None
    """Samples per optimizer step, all ranks together, as counted from the batches the model received (a full
    step: per-device batch x gradient accumulation x world size)."""
    tokens_per_sample: float | None
    """Mean input length over the measured steps (sequence length for unpadded data)."""
    world_size: int
    flops_per_token: float | None
    """Model FLOPs per trained token (``hfscale.measure.flops``: 6N + 12 L H T; recomputation not counted)."""
    mfu: float | None
    """Model FLOPs utilisation: tokens/s x flops_per_token / (peak_flops_per_s x world_size); None without a peak."""
    peak_flops_per_s: float | None
    """One device's peak for the run's compute dtype (``hfscale.measure.flops.DEVICE_PEAK_FLOPS``, or as given)."""
    device_name: str
    compute_dtype: str = "fp32"
    """The dtype matrix multiplications ran in (bf16, fp16, tf32, fp32): the peak is looked up for it."""
    timer: Literal["cuda_events", "perf_counter"] = "perf_counter"
    total_steps: int = 0
    """Optimizer steps timed (warm-up included)."""
    interrupted_steps: int = 0
    """Steps left out because an evaluation or a checkpoint save ran inside them."""
    measured_samples: int | None = None
    """Samples in the measured steps, all ranks (a last partial batch counts what it really held)."""
    measured_time_s: float | None = None
    """Sum of the measured step times."""
    samples_per_step_configured: int | None = None
    """per_device_train_batch_size x n_gpu x gradient_accumulation_steps x world_size, from the arguments."""
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    """Every measured step's time (the slowest rank's), in step order: the within-run diagnostics (step-time CV,
    batch-means error) come from them; the intervals come from the runs (``hfscale.results.stats``)."""
    real_tokens_per_s: float | None = None
    """Tokens that are not padding (the batches' ``attention_mask``) per second, all ranks together; None when the
    batches carry no attention mask. Beside ``tokens_per_s`` it shows what padding costs."""
    first_step_s: float | None = None
    """The first optimizer step's time (the slowest rank's), a warm-up step left out of the figures above (unless
    the warm-up, given or detected, is 0 steps): under ``torch.compile`` it holds the compilation (README,
    "Compilation, attention kernels, TF32 and Liger": seconds to minutes against milliseconds per steady step), so
    compile cost is read here and steady-state speed above. None when no step was timed."""
    warmup_detected: bool = False
    """Whether ``warmup_steps`` was detected from the run's step times (``warmup_steps: auto``,
    :mod:`hfscale.measure.warmup`) rather than given; False in rows written before detection existed."""
    steady_state: bool | None = None
    """Whether the run reached a steady state (the detected warm-up ends in the first half of the run); None when
    the warm-up was given, not detected."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ThroughputSummary:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def log_dict(self) -> dict[str, float]:
        """The flat ``throughput/...`` keys logged through ``Trainer.log`` (None figures left out)."""
        out: dict[str, Any] = {
            "throughput/samples_per_s": self.samples_per_s,
            "throughput/tokens_per_s": self.tokens_per_s,
            "throughput/real_tokens_per_s": self.real_tokens_per_s,
            "throughput/step_time_median_s": self.step_time_median_s,
            "throughput/step_time_p90_s": self.step_time_p90_s,
            "throughput/step_time_mean_s": self.step_time_mean_s,
            "throughput/mfu": self.mfu,
            "throughput/measured_steps": self.measured_steps,
            "throughput/samples_per_step": self.samples_per_step,
        }
        if self.warmup_detected:  # a given warm-up is the user's own number: not logged back
            out["throughput/warmup_steps"] = self.warmup_steps
            out["throughput/steady_state"] = None if self.steady_state is None else int(self.steady_state)
        return {k: v for k, v in out.items() if v is not None}


Wrapper = Literal["none", "DDP", "DataParallel", "DeepSpeedEngine", "FSDP2", "FSDP1"]
"""What wrapped the model the Trainer stepped."""


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
    """accelerate's ``mixed_precision`` (``no``, ``bf16``, ``fp16``), DeepSpeed's precision included."""
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
    optimizer_implementation: str | None = None
    """Kernel of a torch optimizer: ``fused``, ``foreach`` or ``for-loop``; None for other optimizers."""
    fsdp_sharding: FsdpSharding | None = None
    """What the FSDP wrapper does: ``full_shard``, ``shard_grad_op``, ``hybrid_shard`` or ``no_shard``; None without
    FSDP or where it could not be read."""
    fsdp_cpu_offload: bool | None = None
    """Whether FSDP keeps the sharded parameters in CPU memory; None without FSDP or where it could not be read."""
    fsdp_param_dtype: str | None = None
    """FSDP2: the dtype its units gather the parameters in for forward and backward (its ``MixedPrecisionPolicy``'s
    ``param_dtype``, else the stored one; several, comma-separated, where the units differ); None without FSDP2 or
    where it could not be read."""
    global_batch_size: int | None = None
    """Samples per optimizer step across every rank; None where it could not be read."""
    gradient_checkpointing: bool = False
    """Whether activations are recomputed in backward (the model's flag or FSDP's checkpoint wrappers)."""
    # -- machines ------------------------------------------------------------------------------------------
    machine_rank_per_rank: list[int] = field(default_factory=list)
    """Machine (node) rank of each process, in global rank order; empty where it was not read."""
    hostname_per_rank: list[str] = field(default_factory=list)
    """Host name of each process, in global rank order; empty where it was not read."""
    fsdp_mesh: dict[str, int] | None = None
    """FSDP2's device mesh as dimension name -> size (``{"dp_replicate": 2, "dp_shard": 2}`` under hybrid
    sharding); None without FSDP2 or where it could not be read."""
    fsdp_shard_groups: list[list[int]] = field(default_factory=list)
    """FSDP2: the global ranks of each group that splits one parameter among itself (the mesh's shard dimension),
    sorted; with :attr:`machine_rank_per_rank` it shows whether hybrid sharding stayed inside each machine. Empty
    without FSDP2 or where it was not read."""
    # -- kernels and compilation ---------------------------------------------------------------------------
    compiled: bool | None = None
    """Whether the stepped model's own forward ran compiled: dynamo holds compiled code for the model's ``forward``
    made by the model's ``torch.compile`` wrapper (not any compilation in the process); None where it was not
    read."""
    compile_backend: str | None = None
    """The torch.compile backend that ran (``inductor``, ``aot_eager``, ...); None when not compiled."""
    compile_mode: str | None = None
    """inductor's mode as its compiler holds it (``default``, ``reduce-overhead``, ``max-autotune``, ...); None for
    another backend, when not compiled, or when the options match no mode."""
    compile_graph_breaks: int | None = None
    """Graph breaks dynamo counted in the run (each one splits the compiled model, with Python between the pieces);
    None when not compiled."""
    attn_implementation: str | None = None
    """The attention kernel the model's config says ran (``eager``, ``sdpa``, ``flash_attention_2``, ...)."""
    attention_scores_kept: bool | None = None
    """Whether the first attention module returned the seq x seq probabilities in the first training forward (only
    eager attention forms them; ``hfscale.techniques.kernels.AttentionProbe``); None where it was not observed."""
    tf32_matmul: bool | None = None
    """Whether fp32 matmuls may use TF32 inside the run (torch's CUDA matmul flag); None where it was not read."""
    liger_patched: list[str] = field(default_factory=list)
    """Class names of the model's modules that Liger kernels replaced; empty when none were."""
    # -- parameter-efficient fine-tuning -------------------------------------------------------------------
    params_trainable: int | None = None
    """Parameter elements that receive gradients (adapters only under LoRA); None where it was not read."""
    params_adapter: int | None = None
    """Parameter elements peft added and trains (LoRA matrices, and the copy of a ``modules_to_save`` head such as
    a classifier): equal to :attr:`params_trainable` when the base is frozen; None where it was not read."""
    lora_layers: int | None = None
    """Modules carrying a LoRA adapter; None where it was not read."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Last names of the modules carrying a LoRA adapter (``query``, ``value``), sorted; empty without LoRA."""
    quantized_4bit_layers: int | None = None
    """Linear layers whose weights are stored in 4 bits (bitsandbytes ``Linear4bit``); None where not read."""
    # -- activations ---------------------------------------------------------------------------------------
    activation_offload_tensors: int | None = None
    """Storages the activation-offload hooks moved to (or kept in) CPU memory in the first training step, each once
    however many saved tensors view it; None without activation offload."""
    ds_activation_checkpointing: list[str] | None = None
    """DeepSpeed activation-checkpointing options on (``partition_activations``, ``cpu_checkpointing``) when the
    model's checkpointed layers call ``deepspeed.checkpointing.checkpoint``; None when they call another function
    (transformers' default ``torch.utils.checkpoint``) or none is checkpointed."""
    # -- device mesh -----------------------------------------------------------------------------------------
    device_mesh: dict[str, int] | None = None
    """accelerate's ``ParallelismConfig`` mesh as dimension name -> size (``dp_replicate``, ``dp_shard``, ``tp``,
    ``cp``, ``sp``); None without one."""
    linear_weight_placements: str | None = None
    """DTensor placements of one Linear weight per named mesh dimension (``tp=Shard(dim=0)``; ``(Shard(dim=0),)``
    for an unnamed mesh), showing how tensor parallelism split it; None when the weight is a plain tensor."""

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

    def log_dict(self) -> dict[str, int | str]:
        """The record as ``Trainer.log`` keys (``verify/...``): numbers, flags as 0/1, and lists joined with commas
        (``report_to`` integrations take scalars and text only); unread fields (None) are left out."""
        values: dict[str, Any] = self.to_dict()
        values.pop("params_local_per_rank")
        values["params_local_max"] = self.params_local_max
        values["params_sharded"] = self.sharded
        logged: dict[str, int | str] = {}
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, list):
                value = ",".join(str(v) for v in value)
            elif isinstance(value, dict):
                value = ",".join(f"{k}={v}" for k, v in value.items())
            logged[f"verify/{key}"] = value
        return logged

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerificationRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


__all__ = [
    "MEMORY_PHASES",
    "MemorySummary",
    "RankMemory",
    "ThroughputSummary",
    "VerificationRecord",
    "Wrapper",
    "max_present",
]
