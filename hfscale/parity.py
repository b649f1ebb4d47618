"""Loss parity: did a strategy train the same model as the baseline, or did it break training?

Every trial trains the same model from the same seed on the same data, so its loss curve should follow the
baseline's. Legitimate differences stay small: bf16 autocast, 8-bit optimizer states, another split of the same
global batch into micro-batches or processes (other dropout masks), another seed. Broken training does not: a
learning rate far too large, a loss that is not averaged, gradients that are never synchronised, a NaN.

The check (:func:`check_parity`), with its defaults:

1. Both curves are per optimizer step (``TrialResult.loss_curve``) and are aligned on the step index; the common
   prefix is compared and a length difference is reported.
2. A non-finite loss (NaN, inf) in the trial's curve is flagged at once.
3. Both curves are smoothed with a centred moving average over ``window`` = 5 steps (per-step losses of small
   batches are noisy; the average keeps a divergence of a few steps visible).
4. The trial is flagged when at any step ``|trial - baseline| > rel_tolerance * |baseline| + abs_tolerance``,
   with ``rel_tolerance`` = 0.10 and ``abs_tolerance`` = 0.02 (the absolute term keeps a loss near zero from
   turning float noise into a large relative deviation).

Why 10 %: measured on a tiny BERT classifier (hidden 64, 2 layers, vocab 30522), 30 optimizer steps of batch 8
x 32 random tokens, default learning rate 5e-5: the smoothed curves of bf16 autocast, 8-bit AdamW and a re-run
with another seed stay within 0.0 %, 0.0 % and 1.5 % of the fp32 baseline; learning rates 20x and 200x the
baseline's (different, but real, training) within 6.9 % and 9.6 %; a learning rate of 10 jumps to a loss of 50-400
(deviation > 100x). The tolerance sits above every run that trains and far below a broken one. On data a model
can learn, legitimate variants drift further apart as training goes on: raise ``rel_tolerance`` for long runs.

Known logging scales (:func:`annotate_rows`): transformers logs a loss multiplied by the gradient accumulation
steps when the model accepts loss keywords but its loss ignores ``num_items_in_batch`` (BERT classification in
transformers 5), and by the world size with several processes unless ``average_tokens_across_devices=False``.
When a trial's accumulation or process count differs from the baseline's, its curve sits at a constant integer
multiple of the baseline's from the first step, and that multiple is one of those ratios, the curve is divided by
it before the check and the multiple is stored as ``loss_scale`` (with a note); anything else is compared as is.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfscale.results import TrialResult

logger = logging.getLogger(__name__)

DEFAULT_REL_TOLERANCE = 0.10
DEFAULT_ABS_TOLERANCE = 0.02
DEFAULT_WINDOW = 5


@dataclass(frozen=True, kw_only=True)
class ParityResult:
    """How a trial's loss curve compares with the baseline's."""

    flagged: bool
    """The curve leaves the tolerance band (or is not finite): training probably broke."""
    reason: str | None
    """Why it is flagged, or why it could not be compared; None when it passed."""
    compared: bool
    """False when there was nothing to compare (an empty curve, a baseline without a finite curve)."""
    max_rel_deviation: float
    """Largest ``|trial - baseline| / |baseline|`` of the smoothed curves (inf for a non-finite loss)."""
    worst_step: int | None
    """Optimizer step (1-based) of that deviation."""
    final_rel_deviation: float
    """The same at the last compared step."""
    steps_compared: int
    baseline_steps: int
    trial_steps: int
    rel_tolerance: float
    abs_tolerance: float
    window: int
    loss_scale: float = 1.0
    """The trial's curve was divided by this before the comparison (a known logging scale)."""
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in ("max_rel_deviation", "final_rel_deviation"):
            if not math.isfinite(data[key]):
                data[key] = None  # JSON has no inf
        return data


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Centred moving average over ``window`` points, narrower at the ends."""
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    half = window // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def check_parity(
    baseline_curve: Sequence[float],
    curve: Sequence[float],
    *,
    rel_tolerance: float = DEFAULT_REL_TOLERANCE,
    abs_tolerance: float = DEFAULT_ABS_TOLERANCE,
    window: int = DEFAULT_WINDOW,
    loss_scale: float = 1.0,
) -> ParityResult:
    """Compare a trial's per-optimizer-step loss curve with the baseline's (see the module docstring).

    Args:
        loss_scale: divide the trial's curve by this first (a known logging scale).

    Raises:
        ValueError: on a negative tolerance, a window below 1 or a non-positive ``loss_scale``.
    """
    if rel_tolerance < 0 or abs_tolerance < 0:
        raise ValueError(f"tolerances must be >= 0, got rel {rel_tolerance} and abs {abs_tolerance}")
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    if loss_scale <= 0:
        raise ValueError(f"loss_scale must be positive, got {loss_scale}")
    base = [float(x) for x in baseline_curve]
    trial = [float(x) / loss_scale for x in curve]
    common = dict(
        baseline_steps=len(base),
        trial_steps=len(trial),
        rel_tolerance=rel_tolerance,
        abs_tolerance=abs_tolerance,
        window=window,
        loss_scale=loss_scale,
    )

    def not_compared(reason: str) -> ParityResult:
        return ParityResult(
            flagged=False,
            reason=reason,
            compared=False,
            max_rel_deviation=0.0,
            worst_step=None,
            final_rel_deviation=0.0,
            steps_compared=0,
            **common,
        )

    if not trial:
        return not_compared("the trial logged no loss")
    if not base:
        return not_compared("the baseline logged no loss")
    n = min(len(base), len(trial))
    bad = next((i for i, x in enumerate(trial[:n]) if not math.isfinite(x)), None)
    if bad is not None:
        return ParityResult(
            flagged=True,
            reason=f"loss is {trial[bad]} at step {bad + 1}",
            compared=True,
            max_rel_deviation=math.inf,
            worst_step=bad + 1,
            final_rel_deviation=math.inf,
            steps_compared=n,
            **common,
        )
    if not all(math.isfinite(x) for x in base[:n]):
        return not_compared("the baseline's loss is not finite")

    smooth_base = smooth(base[:n], window)
    smooth_trial = smooth(trial[:n], window)
    deviations = [abs(t - b) for t, b in zip(smooth_trial, smooth_base, strict=True)]
    rel = [d / abs(b) if b else (0.0 if d == 0 else math.inf) for d, b in zip(deviations, smooth_base, strict=True)]
    worst = max(range(n), key=lambda i: rel[i])
    outside = [i for i in range(n) if deviations[i] > rel_tolerance * abs(smooth_base[i]) + abs_tolerance]
    reason = None
    if outside:
        first = outside[0]
        reason = (
            f"smoothed loss {smooth_trial[first]:.4g} vs baseline {smooth_base[first]:.4g} at step {first + 1} "
            f"({rel[first]:+.0%} > {rel_tolerance:.0%} + {abs_tolerance:g}); worst {rel[worst]:.0%} at step "
            f"{worst + 1}"
        )
    note = None
    if len(base) != len(trial):
        note = f"curves differ in length ({len(trial)} vs baseline {len(base)} steps): compared the first {n}"
    return ParityResult(
        flagged=bool(outside),
        reason=reason,
        compared=True,
        max_rel_deviation=rel[worst],
        worst_step=worst + 1,
        final_rel_deviation=rel[n - 1],
        steps_compared=n,
        note=note,
        **common,
    )


def _known_scales(row: TrialResult, baseline: TrialResult) -> set[int]:
    def count(strategy: dict[str, Any], key: str) -> int:
        value = strategy.get(key, 1)
        return value if isinstance(value, int) and value > 0 else 1

    acc = count(row.strategy, "gradient_accumulation_steps") / count(baseline.strategy, "gradient_accumulation_steps")
    procs = count(row.strategy, "num_processes") / count(baseline.strategy, "num_processes")
    scales = {acc, procs, acc * procs}
    return {round(s) for s in scales if s >= 2 and abs(s - round(s)) < 1e-9}


def _logging_scale(row: TrialResult, baseline: TrialResult, *, steps: int = 3, tolerance: float = 0.05) -> int:
    """A known integer logging scale of the row's curve against the baseline's, or 1."""
    candidates = _known_scales(row, baseline)
    n = min(steps, len(row.loss_curve), len(baseline.loss_curve))
    if not candidates or n == 0:
        return 1
    ratios = [t / b for t, b in zip(row.loss_curve[:n], baseline.loss_curve[:n], strict=False) if b]
    if len(ratios) < n or not all(math.isfinite(r) for r in ratios):
        return 1
    for scale in sorted(candidates):
        if all(abs(r / scale - 1) <= tolerance for r in ratios):
            return scale
    return 1


def annotate_rows(
    rows: Sequence[TrialResult],
    *,
    rel_tolerance: float = DEFAULT_REL_TOLERANCE,
    abs_tolerance: float = DEFAULT_ABS_TOLERANCE,
    window: int = DEFAULT_WINDOW,
) -> None:
    """Store ``row.extra["parity"]`` (a :meth:`ParityResult.to_dict` plus ``baseline``) on every ``ok`` row.

    The baseline is the row with ``is_baseline`` (else the first ``ok`` row); it is annotated as the reference.
    Rows whose global batch differs from the baseline's are not compared (their curves are not step-for-step
    comparable): they get ``compared: False`` with the reason.
    """
    ok = [r for r in rows if r.status == "ok"]
    if not ok:
        return
    baseline = next((r for r in ok if r.is_baseline), None)
    if baseline is None:
        baseline = next((r for r in rows if r.is_baseline), None)
        if baseline is not None:
            for row in ok:
                row.extra["parity"] = {
                    "compared": False,
                    "flagged": False,
                    "baseline": baseline.trial,
                    "reason": f"the baseline {baseline.trial!r} did not finish ({baseline.status})",
                }
            return
        baseline = ok[0]
    base_batch = _global_batch(baseline.strategy)
    for row in ok:
        if row is baseline:
            row.extra["parity"] = {"compared": False, "flagged": False, "baseline": row.trial, "is_baseline": True}
            continue
        batch = _global_batch(row.strategy)
        if base_batch is not None and batch is not None and batch != base_batch:
            row.extra["parity"] = {
                "compared": False,
                "flagged": False,
                "baseline": baseline.trial,
                "reason": f"global batch {batch} differs from the baseline's {base_batch}: curves are not "
                "comparable step by step",
            }
            continue
        scale = _logging_scale(row, baseline)
        result = check_parity(
            baseline.loss_curve,
            row.loss_curve,
            rel_tolerance=rel_tolerance,
            abs_tolerance=abs_tolerance,
            window=window,
            loss_scale=scale,
        )
        if scale != 1:
            note = (
                f"loss logged x{scale} (gradient accumulation / process count differ from the baseline's; "
                "transformers sums or does not average it): compared after dividing by it"
            )
            result = dataclasses.replace(result, note=f"{note}; {result.note}" if result.note else note)
        if result.flagged:
            logger.warning("trial %s: loss diverges from baseline %s: %s", row.trial, baseline.trial, result.reason)
        row.extra["parity"] = {**result.to_dict(), "baseline": baseline.trial}


def _global_batch(strategy: dict[str, Any]) -> int | None:
    try:
        return (
            int(strategy.get("per_device_batch_size", 8))
            * int(strategy.get("gradient_accumulation_steps", 1))
            * int(strategy.get("num_processes", 1))
        )
    except (TypeError, ValueError):
        return None


__all__ = [
    "DEFAULT_ABS_TOLERANCE",
    "DEFAULT_REL_TOLERANCE",
    "DEFAULT_WINDOW",
    "ParityResult",
    "annotate_rows",
    "check_parity",
    "smooth",
]
