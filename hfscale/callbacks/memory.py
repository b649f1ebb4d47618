"""Peak memory of a training run and of each phase of its first optimizer step, on every rank.

The callback reads the allocator (CUDA) or the kernel (CPU) only in the first optimizer step and at the end.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hfscale.callbacks.base import _rank_and_world, _SummaryCallback, _write_json
from hfscale.core.collective import all_gather_object
from hfscale.core.units import GIB
from hfscale.measure.memory import MemoryProbe, probe_for
from hfscale.records.measurements import MEMORY_PHASES, MemorySummary, RankMemory, max_present

logger = logging.getLogger(__name__)


def _gib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / GIB


class MemoryCallback(_SummaryCallback):
    """Peak memory of a training run and of each phase of its first optimizer step, on every rank.

    On CUDA the figures come from the torch caching allocator (peaks reset at train begin), plus NVML's view of the
    device where ``pynvml`` works; on CPU from the kernel: RSS now (``VmRSS``) and its high-water mark (``VmHWM``,
    reset at train begin and at each phase boundary through ``/proc/self/clear_refs``), never a lifetime peak.

    Phases (memory held at the end of each, and the peak within it), measured in the first optimizer step:

    ============== ================================================================================================
    model_load     ``on_train_begin``: after the Trainer prepared the model (and optimizer), before any forward
    forward        a forward hook on the model, removed after its first training call
    backward       first ``on_substep_end`` (gradient accumulation) or ``on_pre_optimizer_step``
    optimizer_step first ``on_optimizer_step`` (after ``optimizer.step()``, before gradients are zeroed)
    ============== ================================================================================================

    With gradient accumulation the optimizer_step phase also spans the first step's remaining micro-batches. Under
    DeepSpeed, accelerate runs ``engine.step()`` inside backward, so the backward phase includes the optimizer step
    (and ZeRO allocates optimizer states at initialisation, i.e. in model_load); ``summary.notes`` says so.

    Several processes: every rank measures itself; at the end the ranks exchange figures
    (``torch.distributed.all_gather_object``, a collective: every rank must have this callback).

    Logged once, at the end of the last step, through ``Trainer.log`` (so ``log_history`` and ``report_to``):

    ============================== =============================================================================
    ``memory/peak_gib``            training peak, max over ranks (CUDA allocated / CPU RSS)
    ``memory/peak_reserved_gib``   CUDA peak reserved by the caching allocator (CUDA only)
    ``memory/{phase}_gib``         held at the end of ``model_load``, ``forward``, ``backward``, ``optimizer_step``
    ``memory/{phase}_peak_gib``    peak within that phase
    ``memory/alloc_retries``       allocator retries during training, summed over ranks (CUDA only)
    ``memory/ooms``                allocator out-of-memory errors during training, summed over ranks (CUDA only)
    ``memory/nvml_process_used_gib`` NVML: this process's memory on its device (CUDA with NVML only)
    ``memory/nvml_device_used_gib``  NVML: the whole device's used memory (CUDA with NVML only)
    ``memory/rank_{r}/peak_gib``   each rank's training peak (several processes only)
    ============================== =============================================================================

    After training, ``summary`` holds a :class:`MemorySummary` (on every rank).

    Args:
        output_path: where the main process writes ``summary.to_dict()`` as JSON; None writes nothing.
    """

    def __init__(self, *, output_path: str | os.PathLike[str] | None = None) -> None:
        self.output_path = output_path
        self.summary: MemorySummary | None = None

    # -- events ------------------------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._begin_run(model)
        self.summary = None
        self._remove_hook()
        self._probe: MemoryProbe = probe_for(args.device)
        self._held: dict[str, int | None] = {}
        self._phase_peak: dict[str, int | None] = {}
        self._nvml_process: int | None = None
        self._nvml_device: int | None = None
        probe = self._probe
        # The model_load phase's peak is the peak so far (model build, Trainer set-up); its held value is now.
        self._phase_peak["model_load"] = probe.peak_bytes()
        self._held["model_load"] = probe.current_bytes()
        probe.reset_peak()
        self._train_peak: int | None = probe.current_bytes()
        self._reserved_peak: int | None = probe.peak_reserved_bytes()
        self._counters_start = probe.counters()
        self._notes = _memory_notes(args)
        if model is not None:
            self._hook = model.register_forward_hook(self._after_first_forward)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending("backward"):
            self._end_phase("backward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending("backward"):
            self._end_phase("backward")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self._pending("optimizer_step"):
            if getattr(optimizer, "step_was_skipped", False):
                # The fp16 loss scaler skipped this step (inf/NaN gradients): nothing was allocated for the
                # optimizer. Measure backward and the optimizer step again in the first step that really runs.
                self._held.pop("backward", None)
                self._phase_peak.pop("backward", None)
                return
            self._end_phase("optimizer_step")
            self._read_nvml()

    # -- measurement -------------------------------------------------------------------------------------------

    def _pending(self, phase: str) -> bool:
        """Whether ``phase`` of the first step is still to be measured (only ever true inside a training run)."""
        held = getattr(self, "_held", None)
        return held is not None and not self._finished and phase not in held

    def _after_first_forward(self, module: Any, inputs: Any, output: Any) -> None:
        if not module.training:  # an evaluation before training (eval_on_start) is not the training forward
            return
        self._remove_hook()
        self._end_phase("forward")

    def _remove_hook(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        self._hook = None

    def _end_phase(self, phase: str) -> None:
        probe = self._probe
        self._held[phase] = probe.current_bytes()
        peak = probe.peak_bytes()
        self._phase_peak[phase] = peak
        self._train_peak = max_present(self._train_peak, peak)
        self._reserved_peak = max_present(self._reserved_peak, probe.peak_reserved_bytes())
        # A reset per phase (first step only) is what makes a per-phase peak; the training peak is their max.
        probe.reset_peak()

    def _read_nvml(self) -> None:
        reading = self._probe.nvml()
        if reading is not None:
            self._nvml_process = max_present(self._nvml_process, reading.process_used_bytes)
            self._nvml_device = max_present(self._nvml_device, reading.device_used_bytes)

    def _finish(self, args: Any, state: Any, control: Any) -> None:
        if getattr(self, "_finished", True):
            return
        self._finished = True
        self._remove_hook()
        probe = self._probe
        self._train_peak = max_present(self._train_peak, probe.peak_bytes())
        self._reserved_peak = max_present(self._reserved_peak, probe.peak_reserved_bytes())
        self._read_nvml()
        retries, ooms = probe.counters()
        retries0, ooms0 = self._counters_start
        rank, _ = _rank_and_world()
        row = RankMemory(
            rank=rank,
            device="cuda" if probe.device == "cuda" else "cpu",
            peak_gib=_gib(self._train_peak),
            peak_reserved_gib=_gib(self._reserved_peak) if probe.device == "cuda" else None,
            phases_gib={p: _gib(self._held.get(p)) for p in MEMORY_PHASES},
            phase_peaks_gib={p: _gib(self._phase_peak.get(p)) for p in MEMORY_PHASES},
            alloc_retries=None if retries is None or retries0 is None else retries - retries0,
            ooms=None if ooms is None or ooms0 is None else ooms - ooms0,
            nvml_process_used_gib=_gib(self._nvml_process),
            nvml_device_used_gib=_gib(self._nvml_device),
        )
        self.summary = MemorySummary.from_ranks(all_gather_object(row), notes=self._notes)
        self._log(control, self.summary.log_dict())
        if self.output_path is not None and state.is_world_process_zero:
            _write_json(self.output_path, self.summary.to_dict())


def _memory_notes(args: Any) -> list[str]:
    notes = []
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        notes.append(
            "DeepSpeed: engine.step() runs inside backward, so the backward phase includes the optimizer step and "
            "the optimizer states it creates; model_load holds what the engine allocated at initialisation (16-bit "
            "weights, fp32 master copy)"
        )
    if getattr(args, "gradient_accumulation_steps", 1) > 1:
        notes.append(
            "gradient accumulation: backward ends at the first micro-batch's backward; the optimizer_step phase "
            "spans the first step's remaining micro-batches"
        )
    return notes


__all__ = ["MEMORY_PHASES", "MemoryCallback", "MemorySummary", "RankMemory"]
