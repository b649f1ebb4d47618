"""Will a trial fit a memory budget? The estimate plus what lies outside the allocator's peak.

Kept apart from the estimate because the reserve is the one figure here that is assumed rather than counted: the
CUDA context cannot be known before anything runs, so its default is a documented assumption that a caller can
replace with a measured value.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfscale.core.units import GIB
from hfscale.estimate.peak import estimate_memory
from hfscale.records.estimate import MemoryEstimate
from hfscale.workload.spec import TrialSpec

CUDA_CONTEXT_BYTES = 1343 * 1024**2
"""Assumed, not measured: the CUDA context outside torch's allocator, 1343 MB after CUDA initialisation alone on a
Tesla V100 in the Hugging Face transformers documentation (docs/estimate.md, "The CUDA context"). Other GPUs,
drivers and CUDA versions differ."""

CONTEXT_ASSUMPTION = "CUDA context (assumed, V100 reference)"
"""How a default reserve is named wherever it is printed: an assumption, with where the figure comes from."""


def default_reserve_bytes(device: str) -> int:
    """Memory outside the allocator's peak that a device needs: on a GPU the assumed CUDA context
    (:data:`CUDA_CONTEXT_BYTES`, a V100's figure from the transformers documentation, not measured), nothing on
    the CPU."""
    return CUDA_CONTEXT_BYTES if device == "cuda" else 0


def predicted_to_fit(estimate: MemoryEstimate, budget_bytes: int, *, reserve_bytes: int | None = None) -> bool:
    """Whether the predicted peak plus the reserve (default: :func:`default_reserve_bytes`) fits the budget."""
    reserve = default_reserve_bytes(estimate.device) if reserve_bytes is None else reserve_bytes
    return estimate.total_bytes + reserve <= budget_bytes


@dataclass(frozen=True, kw_only=True)
class FitPrediction:
    """What ``--skip-predicted-oom`` needs for one trial."""

    estimate: MemoryEstimate
    fits: bool
    reason: str | None
    """Why the trial is skipped, with the predicted figure; None when it is predicted to fit."""


def predict_fit(spec: TrialSpec, budget_bytes: int, *, reserve_bytes: int | None = None) -> FitPrediction:
    """Estimate a trial and say whether it fits ``budget_bytes`` per device, with a skip reason when it does not.

    Raises:
        ValueError: as :func:`estimate_memory`.
    """
    estimate = estimate_memory(spec)
    reserve = default_reserve_bytes(estimate.device) if reserve_bytes is None else reserve_bytes
    fits = predicted_to_fit(estimate, budget_bytes, reserve_bytes=reserve)
    reason = None
    if not fits:
        reason = (
            f"predicted out of memory: {estimate.total_gib:.2f} GiB peak per device"
            + (
                f" + {reserve / GIB:.2f} GiB " + (CONTEXT_ASSUMPTION if reserve_bytes is None else "reserve")
                if reserve
                else ""
            )
            + f" > budget {budget_bytes / GIB:.2f} GiB (hfscale estimate; run without --skip-predicted-oom to try)"
        )
    return FitPrediction(estimate=estimate, fits=fits, reason=reason)


__all__ = [
    "CONTEXT_ASSUMPTION",
    "CUDA_CONTEXT_BYTES",
    "FitPrediction",
    "default_reserve_bytes",
    "predict_fit",
    "predicted_to_fit",
]
