"""Every speed figure of the report with its noise: run-level intervals, verdicts against the baseline, stability
flags, energy.

The unit of replication is the run. Each run that finished ok gives one figure, its steady samples/s (the samples
of its measured steps over their time); a trial's samples/s is the **geometric mean over its runs**, and its 95%
interval is a t-interval on the log scale whose standard deviation is the run-to-run noise **pooled over every
trial of the sweep** (:func:`hfscale.results.stats.sweep_noise`), or the trial's own where the trials do not share
one noise (then each comparison is Welch's, Dunnett's T3). A speed-up against the baseline is the ratio of the
two geometric means with **Dunnett's** simultaneous 95% interval, so that the chance of calling any identical trial
faster or slower in a whole sweep is 5%; a ratio whose interval holds 1, or that lies within the 2% noise threshold
of it, is a tie. A difference is called only when both trials ran at least twice and neither is flagged (its
runs disagree far beyond the sweep's noise); otherwise it is "untested", with the reason.

The noise between steps is a diagnostic of one run, never the interval of a verdict: the step-time CV and the
batch-means standard error of a run's mean step time. A trial is flagged "may be unstable" (pyperf's words) when
the machine was busy while it ran (:func:`hfscale.launch.activity.disturbances`) or when its runs disagree beyond the
sweep's noise; such a trial gets no verdict and is not recommended on a speed claim.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hfscale.records.activity import disturbances
from hfscale.records.row import TrialResult
from hfscale.results import stats

if TYPE_CHECKING:
    import pandas as pd

NOISE_THRESHOLD = stats.DEFAULT_NOISE_THRESHOLD


def _finite(values: Sequence[float]) -> bool:
    return bool(values) and all(math.isfinite(v) and v > 0 for v in values)


def run_rates(runs: Sequence[TrialResult], attr: str = "samples_per_s") -> list[float]:
    """Each ok run's steady figure (``samples_per_s`` or ``tokens_per_s``): the run is the unit of replication.
    A run whose step times hold a non-finite value gives none (that row gets no interval; the report goes on)."""
    values = []
    for r in runs:
        tp = r.throughput
        value = r.samples_per_s if attr == "samples_per_s" else getattr(tp, attr, None)
        if r.status != "ok" or value is None or not (math.isfinite(value) and value > 0):
            continue
        if tp is not None and tp.step_times_s and not _finite(tp.step_times_s):
            continue
        values.append(float(value))
    return values


def _geometric_mean(values: Sequence[float]) -> float | None:
    if len(values) < 2:  # one run's figure as it was measured, not through exp(log(x))
        return values[0] if values else None
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _energy(runs: Sequence[TrialResult]) -> tuple[float | None, float | None]:
    """Energy of one run of the trial (all its GPUs, start-up included), mean over runs, and per sample trained."""
    per_run, per_sample = [], []
    for r in runs:
        gpus = [g.energy_j for g in (r.activity.gpus if r.activity else []) if g.energy_j is not None]
        if r.status != "ok" or not gpus:
            continue
        joules = float(sum(gpus))
        per_run.append(joules)
        tp = r.throughput
        samples = None
        if tp is not None and tp.samples_per_step and tp.total_steps:
            samples = tp.samples_per_step * tp.total_steps
        elif r.train_samples_per_second and r.train_runtime_s:
            samples = r.train_samples_per_second * r.train_runtime_s
        if samples:
            per_sample.append(joules / samples)
    return (statistics.fmean(per_run) if per_run else None, statistics.fmean(per_sample) if per_sample else None)


def _step_diagnostics(ok: Sequence[TrialResult]) -> dict[str, Any]:
    """How steady each run was (median over runs): step-time CV and the batch-means standard error of the run's
    mean step time; the mean step time over runs; the steps they rest on."""
    times = [list(r.throughput.step_times_s) for r in ok if r.throughput is not None and r.throughput.step_times_s]
    times = [t for t in times if _finite(t)]
    if not times:
        return {"steps_n": 0}
    se = [s for t in times if (s := stats.batch_means_se(t)) is not None]
    return {
        "steps_n": sum(len(t) for t in times),
        "step_time_mean_s": statistics.fmean(statistics.fmean(t) for t in times),
        "step_time_cv_pct": 100 * statistics.median(stats.coefficient_of_variation(t) for t in times),
        "step_mean_se_pct": 100 * statistics.median(se) if se else None,
    }


def trial_noise(runs: Sequence[TrialResult]) -> tuple[dict[str, Any], list[float]]:
    """The columns of one trial that need only its own runs, and its per-run samples/s (the evidence of its
    verdicts: :func:`sweep_columns` adds the intervals once every trial's runs are known).

    Columns: ``steps_n``, ``repeats_n`` (runs with a figure), ``step_time_mean_s``, ``step_time_cv_pct`` and
    ``step_mean_se_pct`` (within-run diagnostics), ``samples_per_s``/``tokens_per_s`` (geometric means over runs),
    ``unstable``/``unstable_reason`` (the machine was busy), ``peak_gib_min``/``peak_gib_max`` over repeats,
    ``energy_j``, ``energy_per_sample_j``.
    """
    ok = [r for r in runs if r.status == "ok"]
    rates = run_rates(ok)
    out: dict[str, Any] = {key: None for key in _KEYS}
    out.update(_step_diagnostics(ok), repeats_n=len(rates), unstable=False)
    reasons = [
        (f"repeat {r.repeat + 1}: " if len(ok) > 1 else "") + sentence
        for r in ok
        for sentence in disturbances(r.activity)
    ]
    peaks = [r.peak_gib for r in ok if r.peak_gib is not None]
    if len(peaks) > 1:
        out.update(peak_gib_min=min(peaks), peak_gib_max=max(peaks))
    out["energy_j"], out["energy_per_sample_j"] = _energy(ok)
    if rates:
        out["samples_per_s"] = _geometric_mean(rates)
        out["tokens_per_s"] = _geometric_mean(run_rates(ok, "tokens_per_s"))
    if reasons:
        out.update(unstable=True, unstable_reason="; ".join(reasons))
    return out, rates


_KEYS = (
    "steps_n",
    "repeats_n",
    "step_time_mean_s",
    "step_time_low_s",
    "step_time_high_s",
    "samples_per_s_low",
    "samples_per_s_high",
    "tokens_per_s_low",
    "tokens_per_s_high",
    "step_time_cv_pct",
    "step_mean_se_pct",
    "run_noise_pct",
    "unstable",
    "unstable_reason",
    "peak_gib_min",
    "peak_gib_max",
    "energy_j",
    "energy_per_sample_j",
)
NOISE_KEYS: tuple[str, ...] = _KEYS
"""Every column :func:`trial_noise` and :func:`sweep_columns` add (for a table with no rows)."""


def _value(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def sweep_columns(frame: pd.DataFrame, evidence: stats.SweepNoise) -> None:
    """Each trial's intervals from the sweep's pooled run-to-run noise, and the "may be unstable" flag of a trial
    whose runs disagree beyond the pool, in place. ``run_noise_pct`` is the run noise the intervals rest on: the
    pool, or the trial's own where the trials do not share one noise."""
    for name in frame.index:
        if name in evidence.flagged:
            reason = frame.loc[name, "unstable_reason"]
            joined = evidence.flagged[name] if not isinstance(reason, str) else f"{reason}; {evidence.flagged[name]}"
            frame.loc[name, ["unstable", "unstable_reason"]] = [True, joined]
        level = evidence.level(name)
        if level is None:
            continue
        frame.loc[name, "run_noise_pct"] = 100 * evidence.run_sd(name) if name not in evidence.flagged else math.nan
        for key in ("samples_per_s", "tokens_per_s"):
            value = _value(frame.loc[name], key)
            if value is not None:  # the same relative interval: tokens per sample is fixed within a trial
                frame.loc[name, [f"{key}_low", f"{key}_high"]] = [
                    value * level.low / level.value,
                    value * level.high / level.value,
                ]
        mean = _value(frame.loc[name], "step_time_mean_s")
        if mean is not None:
            frame.loc[name, ["step_time_low_s", "step_time_high_s"]] = [
                mean * level.value / level.high,
                mean * level.value / level.low,
            ]


_WORDS = {"higher": "faster", "lower": "slower", "tie": "tie", "untested": "untested"}


def speed_verdict(ratio: float | None, said: stats.Comparison | None) -> str | None:
    """``faster``, ``slower``, ``tie`` or ``untested`` for a samples/s ratio and what the sweep's evidence said of
    it; without an interval only a ratio within the noise threshold is a tie. None when there is no ratio."""
    if ratio is None or not math.isfinite(ratio):
        return None
    if said is None or (said.ratio is None and said.few_runs):  # a figure alone: only a tie within 2% is said
        return "tie" if stats.within_threshold(ratio, NOISE_THRESHOLD) else "untested"
    if said.ratio is None or said.why is not None:
        return "untested"
    return _WORDS[said.verdict]


def against(frame: pd.DataFrame, baseline: str | None, evidence: stats.SweepNoise) -> None:
    """Speed-up and memory saved against the baseline, with their intervals and the verdict, in place.

    ``speedup_low``/``_high``: Dunnett's simultaneous interval of the ratio of geometric means (Dunnett's T3 where
    the trials do not share one noise; None where either
    trial cannot be tested); ``verdict``: ``baseline``, ``faster``, ``slower``, ``tie`` or ``untested`` (see
    :func:`speed_verdict`), ``verdict_reason`` why a difference is untested; ``memory_saved_pct_low``/``_high``:
    from the peaks' range over repeats (None with one run each).
    """
    columns = ("speedup_vs_baseline", "speedup_low", "speedup_high", "memory_saved_gib", "memory_saved_pct")
    for column in (*columns, "memory_saved_pct_low", "memory_saved_pct_high"):
        frame[column] = math.nan
    frame["verdict"] = None
    frame["verdict_reason"] = None
    if baseline is None:
        return
    base = frame.loc[baseline]
    frame["speedup_vs_baseline"] = frame["samples_per_s"] / base["samples_per_s"]
    frame["memory_saved_gib"] = base["peak_gib"] - frame["peak_gib"]
    frame["memory_saved_pct"] = 100.0 * frame["memory_saved_gib"] / base["peak_gib"]
    for name, row in frame.iterrows():
        if name == baseline:
            frame.loc[name, "verdict"] = "baseline"
            continue
        said = _unless_unstable(evidence.against(name, baseline), row, base)
        if said.ratio is not None:
            frame.loc[name, ["speedup_low", "speedup_high"]] = [said.ratio.low, said.ratio.high]
        verdict = speed_verdict(_value(row, "speedup_vs_baseline"), said)
        frame.loc[name, "verdict"] = verdict
        if verdict == "untested":
            frame.loc[name, "verdict_reason"] = said.why or "no interval"
        _memory_saved(frame, name, row, base)


def _flagged(value: Any) -> bool:
    """True for a flag that is set, whether it comes as Python's bool or numpy's (a frame's row), never for NaN."""
    return isinstance(value, bool | np.bool_) and bool(value)


def _unless_unstable(said: stats.Comparison, *rows: Mapping[str, Any]) -> stats.Comparison:
    """``said``, or untested when either trial may be unstable (a disturbed run: its figure, but no claim)."""
    for row in rows:
        if _flagged(row.get("unstable")):
            why = f"{row['trial']} may be unstable: {row['unstable_reason']}"
            return stats.Comparison(verdict="untested", ratio=said.ratio, why=why)
    return said


def _memory_saved(frame: pd.DataFrame, name: str, row: pd.Series, base: pd.Series) -> None:
    b_low, b_high = _value(base, "peak_gib_min"), _value(base, "peak_gib_max")
    t_low, t_high = _value(row, "peak_gib_min"), _value(row, "peak_gib_max")
    if b_low is None and t_low is None:
        return
    base_range = (b_low, b_high) if b_low is not None else (base["peak_gib"],) * 2
    trial_range = (t_low, t_high) if t_low is not None else (row["peak_gib"],) * 2
    saved = [100 * (1 - t / b) for b in base_range for t in trial_range if b and t == t]
    if saved:
        frame.loc[name, ["memory_saved_pct_low", "memory_saved_pct_high"]] = [min(saved), max(saved)]


def speed_tie(a: Mapping[str, Any], b: Mapping[str, Any], evidence: stats.SweepNoise) -> tuple[bool, bool]:
    """Whether two trials' samples/s cannot be told apart (all-pairs family, Tukey-Kramer; against the baseline,
    the table's Dunnett verdict), and whether that was tested with an interval (never for a trial that may be
    unstable)."""
    ratio = _value(a, "samples_per_s"), _value(b, "samples_per_s")
    if ratio[0] is None or ratio[1] is None or not ratio[1]:
        return False, False
    # The table's baseline (its verdict column: the marked trial it used, or the first ok trial where none is marked),
    # not any trial marked: with several marked, the others are compared on the all-pairs family like every trial.
    baseline = next((row["trial"] for row in (a, b) if row.get("verdict") == "baseline"), None)
    if baseline is not None:  # against the baseline: the table's own verdict, never a second opinion
        said = evidence.against(b["trial"] if baseline == a["trial"] else a["trial"], baseline)
    else:
        said = evidence.pair(a["trial"], b["trial"])
    said = _unless_unstable(said, a, b)
    return speed_verdict(ratio[0] / ratio[1], said) == "tie", said.ratio is not None and said.why is None


def memory_tie(a: Mapping[str, Any], b: Mapping[str, Any], key: str = "fit_gib") -> bool:
    """Two trials' memory figures (``key``) within the noise threshold of each other; for the peak, also when
    its ranges over repeats overlap (the ranges are the peak's, so they decide only a tie of the peak)."""
    x, y = _value(a, key), _value(b, key)
    if x is None or y is None:
        return False
    if abs(x - y) <= NOISE_THRESHOLD * max(x, y):
        return True
    ranges = [(_value(r, "peak_gib_min"), _value(r, "peak_gib_max")) for r in (a, b)]
    if key == "peak_gib" and all(lo is not None for lo, _ in ranges):
        (lo_a, hi_a), (lo_b, hi_b) = ranges
        return lo_a <= hi_b and lo_b <= hi_a  # type: ignore[operator]
    return False


__all__ = [
    "NOISE_KEYS",
    "NOISE_THRESHOLD",
    "against",
    "memory_tie",
    "run_rates",
    "speed_tie",
    "speed_verdict",
    "sweep_columns",
    "trial_noise",
]
