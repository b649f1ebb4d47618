"""Loss parity's result as a row stores it; the check itself is :mod:`hfscale.results.parity`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

DEFAULT_NOISE_K = 4.0


@dataclass(frozen=True, kw_only=True)
class ParityResult:
    """How a trial's loss curve compares with the baseline's."""

    flagged: bool
    """The curve leaves the tolerance band (or is not finite): training probably broke."""
    compared: bool
    """False when there was nothing to compare (an empty curve, a baseline without a finite curve, a different
    global batch, the baseline row itself)."""
    reason: str | None = None
    """Why it is flagged, or why it could not be compared; None when it passed."""
    baseline: str | None = None
    """The trial compared against."""
    is_baseline: bool = False
    """This row is the baseline (the reference, not compared)."""
    max_rel_deviation: float | None = None
    """Largest ``|trial - baseline| / |baseline|`` of the smoothed curves (inf for a non-finite loss; stored as
    null)."""
    worst_step: int | None = None
    """Optimizer step (1-based) of that deviation."""
    final_rel_deviation: float | None = None
    """The same at the last compared step."""
    steps_compared: int = 0
    baseline_steps: int = 0
    trial_steps: int = 0
    rel_tolerance: float | None = None
    abs_tolerance: float | None = None
    window: int | None = None
    noise_k: float = DEFAULT_NOISE_K
    """The band is at least this many ``noise`` wide."""
    noise: float = 0.0
    """One standard deviation of the difference of two smoothed curves with the baseline's step noise."""
    mean_rel_deviation: float | None = 0.0
    """``(mean trial - mean baseline) / |mean baseline|`` over the compared steps (signed)."""
    loss_scale: float = 1.0
    """The trial's curve was divided by this before the comparison (a known logging scale)."""
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in ("max_rel_deviation", "final_rel_deviation", "mean_rel_deviation"):
            if data[key] is not None and not math.isfinite(data[key]):
                data[key] = None  # JSON has no inf
        return data
