"""The sequential rule: more runs of a trial until its run-level interval is as narrow as its recipe asks.

A recipe's ``measure.target_precision`` asks for runs until the trial's run-level 95% interval is within that
fraction, at least :data:`~hfscale.workload.spec.SEQUENTIAL_MIN_RUNS` and at most ``measure.max_repeats`` runs.
The sweep asks :func:`runs_for_precision` for another round after the planned runs, and marks every row of such a
trial (:func:`sequential_mark`), so that a reader knows the run count followed the results.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from hfscale.launch.plan import PlannedRun
from hfscale.records.row import TrialResult
from hfscale.workload.spec import SEQUENTIAL_MIN_RUNS, MeasureSpec


def sequential_mark(row: TrialResult, measure: MeasureSpec) -> TrialResult:
    """``row`` saying that its trial's run count follows the sequential rule, when its recipe asks for a target
    precision (the rule stops on the results, and a reader should know)."""
    if measure.target_precision is None:
        return row
    return dataclasses.replace(
        row,
        stopping=(
            f"sequential: more runs until the run-level 95% interval is within ± {measure.target_precision:.1%}, "
            f"at least {SEQUENTIAL_MIN_RUNS} and at most {measure.most_runs} runs"
        ),
    )


def runs_for_precision(
    runs: Sequence[PlannedRun],
    stored: Mapping[tuple[str, int], TrialResult],
    *,
    index: int,
    progress: Callable[[str], None],
) -> list[PlannedRun]:
    """One more run of every trial whose recipe asks for a target precision it has not reached (interleaved
    rounds, like the planned repeats): fewer than :data:`SEQUENTIAL_MIN_RUNS` ok runs, or a run-level interval
    (its geometric mean over runs, the verdicts' own statistics: the sweep's run-to-run noise pooled, or the
    trial's own where the trials do not share one) wider
    than the target, while runs and time are left. A trial with a failed run, or on several machines (the
    other machines' drivers could not follow the decision), gets no more.

    ``stored`` holds every row of the run folder by (trial, repeat); the new runs are numbered from ``index``.
    """
    from hfscale.report.noise import run_rates
    from hfscale.results.stats import sweep_noise

    by_trial: dict[str, list[TrialResult]] = {}
    for key, row in stored.items():
        by_trial.setdefault(key[0], []).append(row)
    evidence = sweep_noise({name: run_rates(rows) for name, rows in by_trial.items()})
    more = []
    for first in (r for r in runs if r.repeat == 0 and r.skip_reason is None):
        measure = first.trial.spec.measure
        if measure.target_precision is None or first.trial.spec.strategy.num_machines > 1:
            continue
        rows = by_trial.get(first.name, [])
        if len(rows) >= first.repeats or any(r.status != "ok" for r in rows):
            continue
        if measure.max_time_s is not None and sum(r.wall_time_s or 0.0 for r in rows) >= measure.max_time_s:
            continue
        level = evidence.level(first.name)
        precision = level.half_width_rel if level is not None else math.inf
        usable = len(evidence.runs.get(first.name, ()))  # runs with a figure, not rows
        if usable >= SEQUENTIAL_MIN_RUNS and precision <= measure.target_precision:
            continue
        progress(
            f"{first.name}: ± {precision:.1%} after {len(rows)} run(s) (run-level), target "
            f"± {measure.target_precision:.1%} with at least {SEQUENTIAL_MIN_RUNS} runs: one more run"
        )
        repeat = max(key[1] for key in stored if key[0] == first.name) + 1  # never an existing key
        more.append(dataclasses.replace(first, repeat=repeat, index=index + len(more)))
    return more


__all__ = ["runs_for_precision", "sequential_mark"]
