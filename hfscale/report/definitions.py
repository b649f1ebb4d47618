"""What each figure of a report means, in the words of its Definitions section (and the note under the estimate and
loss-parity table): kept apart from the report's layout (:mod:`hfscale.report.model`), which places them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hfscale.report.analysis import Summary

DEFINITIONS = (
    "**samples/s (steady)**: all processes together, the warm-up steps left out: each run's samples of the measured "
    "steps over their time, and the trial's figure is the **geometric mean over its runs** (the run, a fresh "
    "process, is the unit of replication).",
    "**95% interval**: a t-interval on the log scale whose spread is the run-to-run noise **pooled over every trial "
    "of the sweep** (they ran interleaved on one machine and share its noise; **run noise** is that pooled standard "
    "deviation), or the trial's own where Bartlett's test says the trials do not share one noise (the noise "
    "sentence says so); *single run, no interval*: no run-to-run noise to measure, and none is invented.",
    "**step time CV** and **step mean SE**: how steady one run was (standard deviation / mean of its step times; the "
    "batch-means standard error of its mean step time, which allows for slow stretches), median over runs: "
    "diagnostics, never a verdict's interval. **tokens/s**: the same statistic in tokens (padding included); **real "
    "tokens/s** (shown where batches were padded): the tokens the attention mask keeps, median over runs.",
    "**speed-up**: the ratio of geometric means against the baseline with **Dunnett's** simultaneous 95% interval "
    "(many trials against one baseline: the chance that a sweep calls any identical trial faster or slower is 5%; "
    "Dunnett's T3, each pair's own noise, where the trials do not share one); "
    "**≈** and *tie* mark a tie: the interval holds 1, or the ratio is within 2% of 1 (the noise threshold). A "
    "difference is *untested* (with the reason in its badge) when either trial has fewer than two runs, or is "
    "flagged. Ties between other pairs (the recommendation, the budget table) use the Tukey-Kramer interval of all "
    "pairs (Dunnett's T3 where the trials do not share one noise). How this was checked: docs/statistics.md in "
    "hfscale's repository.",
    "**may be unstable**: the machine was busy during the trial (other processes on the cores or the GPU, stolen "
    "CPU time, clock throttling) or its runs disagree far beyond the sweep's pooled noise (an F test, 1% "
    "Bonferroni-adjusted; not where the trials do not share one noise, each then judged on its own); such a trial "
    "gets no verdict and is not recommended on speed.",
    "**samples/s (Trainer)**: the Trainer's own `train_samples_per_second`, warm-up included. **wall time**: the "
    "whole process group, launch to exit (start-up, model build and engine set-up included); **train time**: the "
    "Trainer's `train_runtime`.",
    "**peak memory**: the training peak, max over ranks (GPU: allocated by the caching allocator; CPU: resident "
    "set high-water mark). **fits budget**: the peak (reserved where measured) against the memory budget.",
    "**TFLOP/s per device**: model FLOPs (6N + attention, recomputation not counted) x tokens/s / processes; "
    "**MFU** is that over the peak dense rate of one device for the dtype the matrix multiplications ran in, shown "
    'beside it ("48.6 of 66.9 (fp32)": 48.6 % of 66.9 TFLOP/s); an fp32 run is measured against the fp32 peak, '
    "which is 15x lower than the bf16 peak on an H100.",
    "**memory saved** compares peak memory with the baseline trial (the largest peak over runs of each); in "
    "brackets, where either ran more than once, the range it spans between the two trials' smallest and largest "
    "peaks (a min–max, not an interval).",
    "**runs**: a trial run several times (repeats) shows the statistics above over all its runs that finished ok "
    "(**runs** counts every run, failed ones too, not those skipped or pruned before they ran; **spread** is max − "
    "min of their samples/s over the samples/s shown, their geometric mean), the median of their times, the "
    "largest peak with the **peak range over runs**, and is ok only when every run was.",
    "**energy**: what the trial's GPUs drew over one run (NVML's counter, start-up included), mean over runs, and "
    "per sample trained. **cost per M tokens**: --price-per-hour x processes (one device each) x the time a million "
    "tokens take at the steady tokens/s.",
)
"""What each column of the trials tables means, one item per term: the report's last section."""


def estimate_parity_definitions() -> str:
    from hfscale.records.parity import DEFAULT_NOISE_K
    from hfscale.results.parity import DEFAULT_ABS_TOLERANCE, DEFAULT_REL_TOLERANCE, DEFAULT_WINDOW

    return (
        "**predicted peak**: hfscale's estimate of the training peak per device, made before the trial ran "
        "(`hfscale estimate`: weights + gradients + optimizer states + activations + overhead; the CUDA context is "
        "not in it); **prediction error** = (predicted − measured) / measured peak, in percent: positive when the "
        "estimate was too high. On CPU the measured peak is the process's resident set, which holds the "
        "interpreter and its libraries (see the weights in the Memory table), so the estimate reads low there. "
        f"**loss parity**: each trial's loss curve against the baseline's, per optimizer step, smoothed over "
        f"{DEFAULT_WINDOW} steps; FLAGGED when it is not finite, its smoothed curve departs by more than "
        f"max({DEFAULT_REL_TOLERANCE:.0%} of the baseline's loss + {DEFAULT_ABS_TOLERANCE:g}, "
        f"{DEFAULT_NOISE_K:g}x the baseline's own step noise) at any step, or its mean loss departs by more than "
        f"{DEFAULT_REL_TOLERANCE:.0%} + {DEFAULT_ABS_TOLERANCE:g} (training probably broke: a learning rate far too "
        "high, gradients never synchronised, ...); a loss logged at a known multiple (the gradient accumulation or "
        "process-count ratio to the baseline) is divided by it first. A flagged trial is "
        "never recommended; *max* is the largest deviation seen. Trials with another global batch are not "
        "compared (their steps are not the same steps)."
    )


def floor_definition(summary: Summary) -> tuple[str, ...]:
    """The definition a report made with a noise floor needs beside the others, which describe the runs' own noise
    and Dunnett's interval: the floor replaces both where it is the larger."""
    floor = summary.speed.floor
    if floor is None:
        return ()
    return (
        f"**noise floor** (this report's): {floor.sd:.1%} of one run ({floor.source}). Above, no trial's mean speed is "
        "taken as known better than one run at that noise, however many runs it had (its interval does not narrow "
        "as runs are added), and the speed-up's joint interval is **Šidák's**, not Dunnett's; **run noise** shows "
        "the runs' own.",
    )


__all__ = ["DEFINITIONS", "estimate_parity_definitions", "floor_definition"]
