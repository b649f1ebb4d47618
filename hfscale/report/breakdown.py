"""Where a trial's memory went: the growth between the phases of its first optimizer step.

``MemorySummary.phases_gib`` records, for the first time each phase ends, what the allocator holds (max over ranks).
Each component is the growth between two of those points:

===============  ======================================  =========================================================
component        derivation                              why
===============  ======================================  =========================================================
weights          ``model_load``                          only the (possibly sharded) model exists yet
activations      ``forward - model_load``                what the forward pass keeps for the backward pass
gradients        ``backward - model_load``               activations are freed by the end of backward; the
                                                         gradients stay until ``zero_grad``
optimizer        ``optimizer_step - backward``           states are created at the first step, and the Trainer's
                                                         ``on_optimizer_step`` comes before ``zero_grad``
other            ``peak - (the four above)``             temporaries, workspace, fragmentation, caches
===============  ======================================  =========================================================

A negative difference (a library freeing or moving memory between phases) is shown as 0. The four need not be held
at the same moment, so their sum can exceed the training peak; ``other`` is then 0.

Two cases where the first step does not show the optimizer, stated rather than shown as a number:

- DeepSpeed runs ``engine.step()`` inside backward, so the optimizer states it creates at its first step land in
  ``gradients`` (``backward - model_load``); ``model_load`` holds what the engine allocated at initialisation (the
  16-bit weights and the fp32 master copy; measured on bert-large ZeRO-2 bf16: 1.874 GiB for 335M parameters,
  6 bytes each, no optimizer states). ``optimizer`` is None and :attr:`MemoryBreakdown.optimizer_in_gradients` set.
- fp16's loss scaler skips the first optimizer step when its gradients overflow at the initial scale: the optimizer
  then allocates nothing at that step although it holds states at the end of training (the verification record's
  ``optimizer_state_dtypes``). ``optimizer`` is None, :attr:`MemoryBreakdown.first_step_skipped` is set, and the
  states are in ``other`` (they exist at the training peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfscale.records.row import TrialResult

SKIPPED_STEP_GIB = 2**-10
"""Below this growth (1 MiB) an fp16 optimizer phase that should create states is taken as a skipped step."""


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """The components of one trial's memory, in GiB (see the module docstring for each derivation)."""

    weights_gib: float
    activations_gib: float | None
    gradients_gib: float | None
    optimizer_gib: float | None
    """None when the first step does not show it (DeepSpeed, a skipped fp16 step) or the phase was not reached."""
    other_gib: float | None
    """Training peak less the four above, at least 0; None without a peak."""
    optimizer_in_gradients: bool = False
    """DeepSpeed: the optimizer states created at the first step are in ``gradients_gib``."""
    first_step_skipped: bool = False
    """fp16: the first optimizer step was skipped, so the optimizer states are in ``other_gib``."""

    @classmethod
    def of(cls, row: TrialResult) -> MemoryBreakdown | None:
        """The breakdown of a row's memory summary; None when the model-load phase was not measured."""
        memory = row.memory
        phases = memory.phases_gib if memory else {}
        weights = phases.get("model_load")
        if memory is None or weights is None:
            return None

        def grow(end: str, start: str) -> float | None:
            a, b = phases.get(end), phases.get(start)
            return None if a is None or b is None else max(0.0, a - b)

        deepspeed = row.strategy.deepspeed is not None or any(n.startswith("DeepSpeed") for n in memory.notes)
        optimizer = None if deepspeed else grow("optimizer_step", "backward")
        states = row.verification.optimizer_state_dtypes if row.verification else []
        skipped = (
            not deepspeed
            and row.strategy.precision == "fp16"
            and bool(states)
            and optimizer is not None
            and optimizer < SKIPPED_STEP_GIB
        )
        parts = {
            "activations_gib": grow("forward", "model_load"),
            "gradients_gib": grow("backward", "model_load"),
            "optimizer_gib": None if skipped else optimizer,
        }
        known = weights + sum(v for v in parts.values() if v is not None)
        other = None if memory.peak_gib is None else max(0.0, memory.peak_gib - known)
        return cls(
            weights_gib=weights,
            other_gib=other,
            optimizer_in_gradients=deepspeed,
            first_step_skipped=skipped,
            **parts,
        )

    def components(self) -> dict[str, float | None]:
        """Component label -> GiB, in stacking order."""
        return {
            "weights": self.weights_gib,
            "gradients": self.gradients_gib,
            "optimizer": self.optimizer_gib,
            "activations": self.activations_gib,
            "other": self.other_gib,
        }

    def notes(self) -> list[str]:
        """What was measured, in words, where a component is not what its name says."""
        if self.optimizer_in_gradients:
            return [
                "DeepSpeed: engine.step() runs inside backward, so the optimizer states created at the first step "
                "are in gradients (end of backward − model load); weights (model load) is what the engine held "
                "after initialisation (16-bit weights and the fp32 master copy, no optimizer states)"
            ]
        if self.first_step_skipped:
            return [
                "fp16: the first optimizer step allocated nothing although the optimizer holds states at the end "
                "of training: the loss scaler skipped that step (gradients overflowed at its initial scale), so "
                "the optimizer states are in other, not optimizer"
            ]
        return []


__all__ = ["SKIPPED_STEP_GIB", "MemoryBreakdown"]
