"""Every speed figure of the report with its noise: intervals, ties against the baseline, stability flags, energy.

A trial's steady-state samples/s is the samples of its measured steps over their time, i.e. the samples per step
over the **mean** step time; its 95% interval is the percentile bootstrap of that mean (``hfscale.stats``: over the
steps of one run, hierarchically over repeats and then steps when the trial ran several times), mapped through
``samples per step / step time``. A speed-up against the baseline is the bootstrap ratio of the two trials' mean
step times (scaled by their samples per step); a ratio whose interval holds 1, or that lies within the 2% noise
threshold of it, is a tie; a difference outside it is called faster or slower only when both trials ran at
least twice (one run cannot show the noise between runs), else it is "untested". A row without step times (rows
written before hfscale kept them) gets no interval: it is
a single figure, and only a difference within the noise threshold can be called (a tie); any other ranking of such
rows is "untested".

A trial is flagged "may be unstable" (pyperf's words) when the machine was busy while it ran
(:func:`hfscale.activity.disturbances`), when its step times vary by more than :data:`hfscale.stats.UNSTABLE_CV`
of their mean, or when its repeats disagree by more than :data:`REPEAT_SPREAD_LIMIT`; such a trial is not
recommended on a speed claim.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hfscale import stats
from hfscale.activity import disturbances
from hfscale.results import TrialResult

if TYPE_CHECKING:
    import pandas as pd

REPEAT_SPREAD_LIMIT = 0.10
"""Repeats whose mean step times differ by more than 10% of their mean make a trial "may be unstable"."""
NOISE_THRESHOLD = stats.DEFAULT_NOISE_THRESHOLD

Groups = list[list[float]]
"""A trial's step times: one list per repeat that kept them."""


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(present) if present else None


def step_groups(runs: Sequence[TrialResult]) -> Groups:
    """The measured step times of each run that finished ok and kept them."""
    return [
        list(r.throughput.step_times_s)
        for r in runs
        if r.status == "ok" and r.throughput is not None and r.throughput.step_times_s
    ]


def _per_step(runs: Sequence[TrialResult], attr: str) -> float | None:
    """Samples (``samples_per_s``) or tokens (``tokens_per_s``) per measured step, median over the runs: the
    run's figure times its mean step time (the samples it really measured over its steps)."""
    values = []
    for r in runs:
        tp = r.throughput
        rate = getattr(tp, attr) if tp is not None else None
        if r.status == "ok" and tp is not None and tp.step_times_s and rate is not None:
            values.append(rate * statistics.fmean(tp.step_times_s))
    return _median(values)


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


def trial_noise(runs: Sequence[TrialResult]) -> tuple[dict[str, Any], Groups]:
    """The statistics columns of one trial (its ok runs), and its step-time groups.

    Columns: ``steps_n`` and ``repeats_n`` (what the interval is over), ``step_time_mean_s`` with
    ``step_time_low_s``/``step_time_high_s``, ``samples_per_s_low``/``_high`` and ``tokens_per_s_low``/``_high``
    (None without step times), ``samples_per_step``, ``step_time_cv_pct``, ``repeat_spread_pct``, ``unstable`` and
    ``unstable_reason``, ``peak_gib_min``/``peak_gib_max`` over repeats, ``energy_j``, ``energy_per_sample_j``;
    plus ``samples_per_s``/``tokens_per_s`` recomputed from the mean step time where there are step times.
    """
    ok = [r for r in runs if r.status == "ok"]
    groups = step_groups(ok)
    out: dict[str, Any] = {key: None for key in _KEYS}
    out.update(steps_n=sum(len(g) for g in groups), repeats_n=len(groups), unstable=False)
    reasons: list[str] = []
    for r in ok:
        for sentence in disturbances(r.activity):
            where = f"repeat {r.repeat + 1}: " if len(ok) > 1 else ""
            reasons.append(where + sentence)
    peaks = [r.peak_gib for r in ok if r.peak_gib is not None]
    if len(peaks) > 1:
        out.update(peak_gib_min=min(peaks), peak_gib_max=max(peaks))
    out["energy_j"], out["energy_per_sample_j"] = _energy(ok)
    if groups:
        interval = stats.bootstrap_interval(groups if len(groups) > 1 else groups[0])
        per_sample, per_token = _per_step(ok, "samples_per_s"), _per_step(ok, "tokens_per_s")
        out.update(
            step_time_mean_s=interval.value,
            step_time_low_s=interval.low,
            step_time_high_s=interval.high,
            samples_per_step=per_sample,
        )
        for key, per_step in (("samples_per_s", per_sample), ("tokens_per_s", per_token)):
            if per_step is not None:
                rate = interval.map(lambda t, k=per_step: k / t)
                out.update({key: rate.value, f"{key}_low": rate.low, f"{key}_high": rate.high})
        cv = stats.coefficient_of_variation(groups)
        spread = stats.repeat_spread(groups)
        out.update(step_time_cv_pct=100 * cv, repeat_spread_pct=100 * spread if len(groups) > 1 else None)
        if cv > stats.UNSTABLE_CV:
            reasons.append(f"step times vary by {cv:.0%} of their mean (over {stats.UNSTABLE_CV:.0%})")
        if spread > REPEAT_SPREAD_LIMIT:
            reasons.append(f"its repeats disagree by {spread:.0%} (over {REPEAT_SPREAD_LIMIT:.0%})")
    if reasons:
        out.update(unstable=True, unstable_reason="; ".join(reasons))
    return out, groups


_KEYS = (
    "steps_n",
    "repeats_n",
    "step_time_mean_s",
    "step_time_low_s",
    "step_time_high_s",
    "samples_per_step",
    "samples_per_s_low",
    "samples_per_s_high",
    "tokens_per_s_low",
    "tokens_per_s_high",
    "step_time_cv_pct",
    "repeat_spread_pct",
    "unstable",
    "unstable_reason",
    "peak_gib_min",
    "peak_gib_max",
    "energy_j",
    "energy_per_sample_j",
)
NOISE_KEYS: tuple[str, ...] = _KEYS
"""Every column :func:`trial_noise` adds (for a table with no rows)."""


def speed_ratio(
    top: Groups, top_per_step: float | None, bottom: Groups, bottom_per_step: float | None
) -> stats.Interval | None:
    """samples/s of ``top`` over samples/s of ``bottom`` with its bootstrap interval; None without step times."""
    if not top or not bottom or not top_per_step or not bottom_per_step:
        return None
    times = stats.ratio_interval(bottom if len(bottom) > 1 else bottom[0], top if len(top) > 1 else top[0])
    return times.map(lambda x: x * top_per_step / bottom_per_step)


MIN_RUNS_FOR_A_RANKING = 2
"""Runs each side needs before a difference is called faster or slower: one run's steps show the noise within a
run, not between runs (a fresh process, another memory layout, the machine's other load), which on a shared CPU is
the larger part (the 0.1 cpu_small sweep gave bf16 0.69x and then 1.03x of fp32 in two single runs)."""


def speed_verdict(
    ratio: float | None, interval: stats.Interval | None, runs: int = MIN_RUNS_FOR_A_RANKING
) -> str | None:
    """``faster``, ``slower`` or ``tie`` for a samples/s ratio; ``untested`` when the ratio departs from 1 by more
    than the noise threshold but there is no interval, or either side has fewer than :data:`MIN_RUNS_FOR_A_RANKING`
    runs (``runs`` is the smaller count); None when there is no ratio."""
    if ratio is None or not math.isfinite(ratio):
        return None
    if interval is None or runs < MIN_RUNS_FOR_A_RANKING:
        return "tie" if abs(ratio - 1) <= NOISE_THRESHOLD else "untested"
    said = stats.verdict(interval, noise_threshold=NOISE_THRESHOLD)
    return {"higher": "faster", "lower": "slower", "tie": "tie"}[said]


def _value(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def against(frame: pd.DataFrame, baseline: str | None, groups: Mapping[str, Groups]) -> None:
    """Speed-up and memory saved against the baseline, with their intervals and the verdict, in place.

    ``speedup_low``/``_high``: the bootstrap ratio of step times (None where either trial has none);
    ``verdict``: ``baseline``, ``faster``, ``slower``, ``tie`` or ``untested`` (see :func:`speed_verdict`);
    ``memory_saved_pct_low``/``_high``: from the peaks' range over repeats (None with one run each).
    """
    columns = ("speedup_vs_baseline", "speedup_low", "speedup_high", "memory_saved_gib", "memory_saved_pct")
    for column in (*columns, "memory_saved_pct_low", "memory_saved_pct_high"):
        frame[column] = math.nan
    frame["verdict"] = None
    if baseline is None:
        return
    base = frame.loc[baseline]
    frame["speedup_vs_baseline"] = frame["samples_per_s"] / base["samples_per_s"]
    frame["memory_saved_gib"] = base["peak_gib"] - frame["peak_gib"]
    frame["memory_saved_pct"] = 100.0 * frame["memory_saved_gib"] / base["peak_gib"]
    b_low, b_high = _value(base, "peak_gib_min"), _value(base, "peak_gib_max")
    for name, row in frame.iterrows():
        ratio = _value(row, "speedup_vs_baseline")
        interval = speed_ratio(
            groups.get(name, []),
            _value(row, "samples_per_step"),
            groups.get(baseline, []),
            _value(base, "samples_per_step"),
        )
        if interval is not None:
            frame.loc[name, ["speedup_low", "speedup_high"]] = [interval.low, interval.high]
        runs = min(len(groups.get(name, [])), len(groups.get(baseline, [])))
        frame.loc[name, "verdict"] = "baseline" if name == baseline else speed_verdict(ratio, interval, runs)
        t_low, t_high = _value(row, "peak_gib_min"), _value(row, "peak_gib_max")
        if name != baseline and (b_low is not None or t_low is not None):
            base_range = (b_low, b_high) if b_low is not None else (base["peak_gib"],) * 2
            trial_range = (t_low, t_high) if t_low is not None else (row["peak_gib"],) * 2
            saved = [100 * (1 - t / b) for b in base_range for t in trial_range if b and t == t]
            if saved:
                frame.loc[name, ["memory_saved_pct_low", "memory_saved_pct_high"]] = [min(saved), max(saved)]


def speed_tie(a: Mapping[str, Any], b: Mapping[str, Any], groups: Mapping[str, Groups]) -> tuple[bool, bool]:
    """Whether two trials' samples/s cannot be told apart, and whether that was tested with an interval."""
    ratio = _value(a, "samples_per_s"), _value(b, "samples_per_s")
    if ratio[0] is None or ratio[1] is None or not ratio[1]:
        return False, False
    interval = speed_ratio(
        groups.get(a["trial"], []),
        _value(a, "samples_per_step"),
        groups.get(b["trial"], []),
        _value(b, "samples_per_step"),
    )
    runs = min(len(groups.get(a["trial"], [])), len(groups.get(b["trial"], [])))
    tested = interval is not None and runs >= MIN_RUNS_FOR_A_RANKING  # the interval could decide the verdict
    return speed_verdict(ratio[0] / ratio[1], interval, runs) == "tie", tested


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
    "REPEAT_SPREAD_LIMIT",
    "against",
    "memory_tie",
    "speed_ratio",
    "speed_tie",
    "speed_verdict",
    "step_groups",
    "trial_noise",
]
