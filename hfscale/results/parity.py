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
4. The baseline's own step noise: ``sigma`` = 1.4826 x the median absolute deviation of its per-step losses
   around its smoothed curve, divided by ``sqrt(1 - 1/window)`` (a residual from a mean over ``window`` points that
   include it is that much smaller) - a robust standard deviation that a few loss spikes do not inflate. Two
   independent curves with that noise differ after smoothing by ``noise = sigma * sqrt(2 / window)`` (one standard
   deviation).
5. The trial is flagged when at any step ``|trial - baseline| > max(rel_tolerance * |baseline| + abs_tolerance,
   noise_k * noise)`` (smoothed curves), with ``rel_tolerance`` = 0.10, ``abs_tolerance`` = 0.02 and ``noise_k``
   = 4: the maximum of a curve of ~n/window independent windows of Gaussian noise is 2.5-3 standard deviations, so
   4 leaves step noise alone (~1 % false alarms over 128 steps) and still flags what noise cannot explain.
6. The trial is also flagged when its mean loss over the compared steps departs from the baseline's by more than
   ``rel_tolerance * |mean| + abs_tolerance`` (the noise of a mean over many steps is small): a curve shifted as a
   whole cannot hide inside a wide noise band.

Why 10 %: measured on a tiny BERT classifier (hidden 64, 2 layers, vocab 30522), 30 optimizer steps of batch 8
x 32 random tokens, default learning rate 5e-5: the smoothed curves of bf16 autocast, 8-bit AdamW and a re-run
with another seed stay within 0.0 %, 0.0 % and 1.5 % of the fp32 baseline; learning rates 20x and 200x the
baseline's (different, but real, training) within 6.9 % and 9.6 %; a learning rate of 10 jumps to a loss of 50-400
(deviation > 100x). The tolerance sits above every run that trains and far below a broken one. On data a model
can learn, legitimate variants drift further apart as training goes on: raise ``rel_tolerance`` for long runs.

Why the noise term: a bert-large sweep on an H100 (128 optimizer steps of batch 4, random tokens and random
labels, so the loss hovers near ln 2 with per-step losses from 0.5 to 3) has a baseline noise ``sigma`` = 0.225
(``noise`` = 0.142, band 0.57). With the relative band alone fp16 and bf16 left it by 13 % at step 53 and ZeRO-2/3
by 14 %; their largest smoothed differences are 0.16, 0.16, 0.13 and 0.13 (<= 1.2 noise), their mean losses within
0.6 % of the baseline's. Adafactor (another optimizer, real training) reaches 2.6 noise (+22 % at step 2) with a
mean 2.6 % lower: within noise, so not flagged - the check looks for broken training, not for the same training.
A learning rate of 10 reaches losses of 50-400, hundreds of noise units and > 100x off.

Known logging scales (:func:`annotate_rows`): transformers logs a loss multiplied by the gradient accumulation
steps when the model accepts loss keywords but its loss ignores ``num_items_in_batch`` (BERT classification in
transformers 5), and by the world size with several processes where ``average_tokens_across_devices`` is on and
the loss ignores the token count (hfscale turns it on only for a causal LM under tensor parallel).
The allowed multiples are the trial's accumulation and data-parallel replica ratios to the baseline's (and their
product), when integers >= 2 (the ranks of a tp, cp or sp group share a batch and are not replicas). The scale is
detected when the median of ``trial / baseline`` over the first 32 steps lies within 10 % of one of them; the curve
is then divided by it before the check, and the multiple is stored as ``loss_scale`` (with a note); anything else
is compared as is. It is not an exact multiple: another
micro-batch shape draws other dropout masks, and fp16 skips its first steps while the loss scaler calibrates. On
the H100 the batch-1 x 4-accumulation trials sit at a median 4.08x (fp32) and 4.21x (fp16) of the batch-4
baseline; after dividing by 4 their smoothed curves stay within 1.3 and 3.0 noise of it, their means within
0.1 % and 2.6 %. 10 % keeps the neighbouring integers (3, 5) apart from 4 and 1 apart from 2.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hfscale.records.parity import DEFAULT_NOISE_K, ParityResult

if TYPE_CHECKING:
    from hfscale.records.row import TrialResult
    from hfscale.strategy import Strategy

logger = logging.getLogger(__name__)

DEFAULT_REL_TOLERANCE = 0.10
DEFAULT_ABS_TOLERANCE = 0.02
DEFAULT_WINDOW = 5
SCALE_STEPS = 32
"""Steps over which the median ratio of the curves is taken to detect a logging scale."""
SCALE_TOLERANCE = 0.10
"""Relative distance of that median ratio from an allowed integer multiple."""


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


def step_noise(values: Sequence[float], window: int) -> float:
    """Robust standard deviation of a curve's per-step values around its centred moving average (0 when fewer
    than 3 points): 1.4826 x the median absolute deviation of the residuals, corrected for the point's own weight
    in the average."""
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    if len(values) < 3:
        return 0.0
    residuals = [v - s for v, s in zip(values, smooth(values, window), strict=True)]
    centre = statistics.median(residuals)
    mad = statistics.median(abs(r - centre) for r in residuals)
    shrink = math.sqrt(1 - 1 / window) if window > 1 else 1.0
    return 1.4826 * mad / shrink if shrink else 0.0


@dataclass(frozen=True, kw_only=True)
class _Settings:
    """The settings of one check, recorded in its :class:`ParityResult` beside the verdict."""

    rel_tolerance: float
    abs_tolerance: float
    window: int
    noise_k: float
    loss_scale: float

    def __post_init__(self) -> None:
        if self.rel_tolerance < 0 or self.abs_tolerance < 0 or self.noise_k < 0:
            raise ValueError(
                f"tolerances must be >= 0, got rel {self.rel_tolerance}, abs {self.abs_tolerance} and "
                f"noise_k {self.noise_k}"
            )
        if self.window < 1:
            raise ValueError(f"window must be positive, got {self.window}")
        if self.loss_scale <= 0:
            raise ValueError(f"loss_scale must be positive, got {self.loss_scale}")

    def band(self, level: float, noise: float) -> float:
        """How far a smoothed curve may stray from the baseline's at ``level`` when its step noise is ``noise``."""
        return max(self.rel_tolerance * abs(level) + self.abs_tolerance, self.noise_k * noise)


def check_parity(
    baseline_curve: Sequence[float],
    curve: Sequence[float],
    *,
    rel_tolerance: float = DEFAULT_REL_TOLERANCE,
    abs_tolerance: float = DEFAULT_ABS_TOLERANCE,
    window: int = DEFAULT_WINDOW,
    noise_k: float = DEFAULT_NOISE_K,
    loss_scale: float = 1.0,
) -> ParityResult:
    """Compare a trial's per-optimizer-step loss curve with the baseline's (see the module docstring).

    Args:
        noise_k: the band is at least this many standard deviations of the baseline's smoothed step noise (0: the
            relative band alone).
        loss_scale: divide the trial's curve by this first (a known logging scale).

    Raises:
        ValueError: on a negative tolerance or ``noise_k``, a window below 1 or a non-positive ``loss_scale``.
    """
    settings = _Settings(
        rel_tolerance=rel_tolerance, abs_tolerance=abs_tolerance, window=window, noise_k=noise_k,
        loss_scale=loss_scale,
    )  # fmt: skip
    base = [float(x) for x in baseline_curve]
    trial = [float(x) / loss_scale for x in curve]
    common = {"baseline_steps": len(base), "trial_steps": len(trial), **dataclasses.asdict(settings)}
    if not trial:
        return _not_compared("the trial logged no loss", common)
    if not base:
        return _not_compared("the baseline logged no loss", common)
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
        return _not_compared("the baseline's loss is not finite", common)
    return _compare(base, trial, settings, common)


def _not_compared(reason: str, common: dict[str, Any]) -> ParityResult:
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


def _compare(base: list[float], trial: list[float], settings: _Settings, common: dict[str, Any]) -> ParityResult:
    """Steps 3 to 6 of the module docstring, over the common prefix of two finite curves."""
    n, window = min(len(base), len(trial)), settings.window
    smooth_base = smooth(base[:n], window)
    smooth_trial = smooth(trial[:n], window)
    noise = step_noise(base[:n], window) * math.sqrt(2 / window)
    deviations = [abs(t - b) for t, b in zip(smooth_trial, smooth_base, strict=True)]
    rel = [d / abs(b) if b else (0.0 if d == 0 else math.inf) for d, b in zip(deviations, smooth_base, strict=True)]
    worst = max(range(n), key=lambda i: rel[i])
    bands = [settings.band(b, noise) for b in smooth_base]
    outside = [i for i in range(n) if deviations[i] > bands[i]]
    mean_base, mean_trial = math.fsum(base[:n]) / n, math.fsum(trial[:n]) / n
    mean_dev = mean_trial - mean_base
    mean_rel = mean_dev / abs(mean_base) if mean_base else (0.0 if mean_dev == 0 else math.inf)
    shifted = abs(mean_dev) > settings.rel_tolerance * abs(mean_base) + settings.abs_tolerance
    reason = None
    if outside:
        first = outside[0]
        sigmas = f", {deviations[first] / noise:.1f} noise" if noise > 0 else ""
        reason = (
            f"smoothed loss {smooth_trial[first]:.4g} vs baseline {smooth_base[first]:.4g} at step {first + 1} "
            f"({rel[first]:+.0%}{sigmas}; band {bands[first]:.3g} = max({settings.rel_tolerance:.0%} + "
            f"{settings.abs_tolerance:g}, {settings.noise_k:g} x noise {noise:.3g})); worst {rel[worst]:.0%} at "
            f"step {worst + 1}"
        )
    elif shifted:
        reason = (
            f"mean loss {mean_trial:.4g} vs baseline {mean_base:.4g} over {n} steps ({mean_rel:+.1%} > "
            f"{settings.rel_tolerance:.0%} + {settings.abs_tolerance:g})"
        )
    note = None
    if len(base) != len(trial):
        note = f"curves differ in length ({len(trial)} vs baseline {len(base)} steps): compared the first {n}"
    return ParityResult(
        flagged=bool(outside) or shifted,
        reason=reason,
        compared=True,
        max_rel_deviation=rel[worst],
        worst_step=worst + 1,
        final_rel_deviation=rel[n - 1],
        steps_compared=n,
        noise=noise,
        mean_rel_deviation=mean_rel,
        note=note,
        **common,
    )


def _known_scales(row: TrialResult, baseline: TrialResult) -> set[int]:
    """The multiples a logged loss may carry against the baseline's: the accumulation ratio and the ratio of
    data-parallel replicas (processes that see distinct batches: the ranks of a tp, cp or sp group share one, and a
    loss scaled by them is a defect to flag, as tp 2 doubling it was)."""
    acc = row.strategy.gradient_accumulation_steps / baseline.strategy.gradient_accumulation_steps
    procs = _replicas(row.strategy) / _replicas(baseline.strategy)
    scales = {acc, procs, acc * procs}
    return {round(s) for s in scales if s >= 2 and abs(s - round(s)) < 1e-9}


def _replicas(strategy: Strategy) -> int:
    """Processes that see distinct batches."""
    return strategy.global_batch_size // (strategy.per_device_batch_size * strategy.gradient_accumulation_steps)


def _logging_scale(
    row: TrialResult, baseline: TrialResult, *, steps: int = SCALE_STEPS, tolerance: float = SCALE_TOLERANCE
) -> int:
    """The allowed integer logging scale nearest the median ``row / baseline`` ratio over the first ``steps``
    steps, if within ``tolerance`` of it; else 1."""
    candidates = _known_scales(row, baseline)
    ratio = _median_ratio(row, baseline, steps=steps)
    if not candidates or ratio is None:
        return 1
    scale = min(candidates, key=lambda s: abs(ratio / s - 1))
    return scale if abs(ratio / scale - 1) <= tolerance else 1


def _median_ratio(row: TrialResult, baseline: TrialResult, *, steps: int = SCALE_STEPS) -> float | None:
    n = min(steps, len(row.loss_curve), len(baseline.loss_curve))
    ratios = [t / b for t, b in zip(row.loss_curve[:n], baseline.loss_curve[:n], strict=True) if b]
    ratios = [r for r in ratios if math.isfinite(r) and r > 0]
    return statistics.median(ratios) if ratios else None


def _scale_note(row: TrialResult, baseline: TrialResult, scale: int) -> str:
    """Why a trial's curve was divided by ``scale`` before the check."""
    return (
        f"loss logged x{scale} (median ratio {_median_ratio(row, baseline):.3g} over the first {SCALE_STEPS} "
        "steps; gradient accumulation / process count differ from the baseline's; transformers sums or does "
        "not average it): compared after dividing by it"
    )


def annotate_rows(
    rows: Sequence[TrialResult],
    *,
    rel_tolerance: float = DEFAULT_REL_TOLERANCE,
    abs_tolerance: float = DEFAULT_ABS_TOLERANCE,
    window: int = DEFAULT_WINDOW,
    noise_k: float = DEFAULT_NOISE_K,
) -> None:
    """Set ``row.parity`` on every ``ok`` row.

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
                row.parity = ParityResult(
                    compared=False,
                    flagged=False,
                    baseline=baseline.trial,
                    reason=f"the baseline {baseline.trial!r} did not finish ({baseline.status})",
                )
            return
        baseline = ok[0]
    base_batch = baseline.strategy.global_batch_size
    for row in ok:
        if row is baseline:
            row.parity = ParityResult(compared=False, flagged=False, baseline=row.trial, is_baseline=True)
            continue
        batch = row.strategy.global_batch_size
        if batch != base_batch:
            row.parity = ParityResult(
                compared=False,
                flagged=False,
                baseline=baseline.trial,
                reason=f"global batch {batch} differs from the baseline's {base_batch}: curves are not "
                "comparable step by step",
            )
            continue
        scale = _logging_scale(row, baseline)
        result = check_parity(
            baseline.loss_curve,
            row.loss_curve,
            rel_tolerance=rel_tolerance,
            abs_tolerance=abs_tolerance,
            window=window,
            noise_k=noise_k,
            loss_scale=scale,
        )
        if scale != 1:
            note = _scale_note(row, baseline, scale)
            result = dataclasses.replace(result, note=f"{note}; {result.note}" if result.note else note)
        if result.flagged:
            logger.warning("trial %s: loss diverges from baseline %s: %s", row.trial, baseline.trial, result.reason)
        row.parity = dataclasses.replace(result, baseline=baseline.trial)


__all__ = [
    "DEFAULT_ABS_TOLERANCE",
    "DEFAULT_NOISE_K",
    "DEFAULT_REL_TOLERANCE",
    "DEFAULT_WINDOW",
    "ParityResult",
    "annotate_rows",
    "check_parity",
    "smooth",
    "step_noise",
]
