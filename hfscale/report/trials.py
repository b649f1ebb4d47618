"""One trial's record in the comparison table, from its rows (the repeats of a trial grouped): status, memory,
breakdown, parity, batch search, and the per-run figures whose median the table shows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hfscale.records.measurements import MemorySummary
from hfscale.records.row import TrialResult
from hfscale.report.breakdown import MemoryBreakdown


def describe(row: TrialResult) -> str:
    return row.description or row.strategy.describe()


def group_rows(rows: Sequence[TrialResult]) -> list[tuple[str, list[TrialResult]]]:
    """Rows grouped into trials, in order of first appearance: the repeats of a trial (``repeats`` > 1) form one
    group, and so does a ``pruned`` row with the runs of its trial; any other name that comes again gets ``#2``,
    ``#3``... so no row is hidden."""
    groups: dict[tuple[str, bool], list[TrialResult]] = {}
    names: dict[tuple[str, bool], str] = {}
    taken: set[str] = set()

    def fresh(trial: str) -> str:  # a name no group holds yet: a repeated single row or a resumed trial stays apart
        name, k = trial, 1
        while name in taken:
            k += 1
            name = f"{trial}#{k}"
        taken.add(name)
        return name

    home: dict[str, tuple[str, bool]] = {}  # each trial's latest group
    for row in rows:
        if row.status == "pruned" and row.trial in home:  # the search's last word on a trial joins its runs
            groups[home[row.trial]].append(row)
            continue
        if row.repeats > 1:
            key = (row.trial, True)
            if key not in groups:
                names[key] = fresh(row.trial)
            groups.setdefault(key, []).append(row)
            home[row.trial] = key
            continue
        key = (fresh(row.trial), False)
        names[key] = key[0]
        groups[key] = [row]
        home[row.trial] = key
    return [(names[key], group) for key, group in groups.items()]


def group_status(group: Sequence[TrialResult]) -> tuple[str, str | None]:
    """A trial's status over its repeats: ok only when every repeat is; else the first real failure. An adaptive
    search's ``pruned`` row is no run: it leaves the status to the runs (:func:`pruned_reason` says it)."""
    runs = [r for r in group if r.status != "pruned"] or list(group)
    failures = [(k, r) for k, r in enumerate(runs, 1) if r.status != "ok"]
    if not failures:
        return "ok", None
    k, worst = next(((k, r) for k, r in failures if r.status != "skipped"), failures[0])
    if len(runs) == 1:
        return worst.status, worst.reason
    n_ok = len(runs) - len(failures)
    reason = f"repeat {k} of {len(runs)}: {worst.reason or worst.status}"
    return worst.status, reason + (f"; {n_ok} repeat(s) ok" if n_ok else "")


def pruned_reason(group: Sequence[TrialResult]) -> str | None:
    """Why an adaptive search stopped running the trial (its ``pruned`` row), or None: it was measured, and is
    never recommended."""
    return next((r.reason for r in group if r.status == "pruned"), None)


def parity_status(row: TrialResult) -> str | None:
    p = row.parity
    if p is None:
        return None
    if p.flagged:
        return "flagged"
    if p.is_baseline:
        return "baseline"
    return "ok" if p.compared else "not compared"


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def run_record(row: TrialResult) -> dict[str, Any]:
    """The figures of one run that a trial's median is taken over."""
    tp = row.throughput
    return {
        "samples_per_s": finite(row.samples_per_s),
        "wall_time_s": row.wall_time_s,
        "train_runtime_s": row.train_runtime_s,
        "trainer_samples_per_s": row.train_samples_per_second,
        "tokens_per_s": tp.tokens_per_s if tp else None,
        "real_tokens_per_s": tp.real_tokens_per_s if tp else None,
        "step_time_median_s": tp.step_time_median_s if tp else None,
        "first_step_s": tp.first_step_s if tp else None,
        "mfu_pct": None if tp is None or tp.mfu is None else 100.0 * tp.mfu,
        "achieved_tflops": achieved_tflops(row),
        "final_loss": finite(row.final_loss),
    }


def achieved_tflops(row: TrialResult) -> float | None:
    """Model TFLOP/s per device: tokens/s x FLOPs per token / processes (what MFU divides by the peak)."""
    tp = row.throughput
    if tp is None or tp.tokens_per_s is None or tp.flops_per_token is None:
        return None
    return tp.tokens_per_s * tp.flops_per_token / max(tp.world_size, 1) / 1e12


def fit_memory(memory: MemorySummary | None) -> tuple[float | None, str | None]:
    """What the device really had to hold, and which figure that is: NVML's process memory (CUDA context
    included; never below the allocator's reserved peak, which NVML's few readings can miss), else the reserved
    peak, else the peak (CPU: resident set)."""
    if memory is None:
        return None, None
    if memory.nvml_process_used_gib is not None:
        return max(memory.nvml_process_used_gib, memory.peak_reserved_gib or 0.0), "NVML process memory"
    if memory.peak_reserved_gib is not None:
        return max(memory.peak_reserved_gib, memory.peak_gib or 0.0), "reserved peak"
    if memory.peak_gib is not None:
        return memory.peak_gib, "peak"
    return None, None


MEDIANS = (
    "samples_per_s",
    "wall_time_s",
    "train_runtime_s",
    "trainer_samples_per_s",
    "tokens_per_s",
    "real_tokens_per_s",
    "step_time_median_s",
    "first_step_s",
    "mfu_pct",
    "achieved_tflops",
    "final_loss",
)


def trial_record(name: str, group: Sequence[TrialResult]) -> dict[str, Any]:
    """Everything but the medians and the comparisons for one trial (see the module docstring)."""
    status, reason = group_status(group)
    runs = [r for r in group if r.status == "ok"] or list(group)
    first = runs[0]
    worst = max(runs, key=lambda r: r.peak_gib if r.peak_gib is not None else -1.0)
    memory = worst.memory
    parities = [r for r in runs if r.parity is not None]
    parity_row = next((r for r in parities if r.parity and r.parity.flagged), parities[0] if parities else None)
    parity = parity_row.parity if parity_row else None
    breakdown = MemoryBreakdown.of(worst)
    components = breakdown.components() if breakdown else {}
    notes = [n for n in (memory.notes if memory else []) if not n.startswith("DeepSpeed")]
    search = next((r.batch_search for r in group if r.batch_search is not None), None)
    result = search.result if search else None
    tp = first.throughput
    world = tp.world_size if tp else (memory.world_size if memory else None)
    fit, fit_source = fit_memory(memory)
    scale = first.parity.loss_scale if first.parity is not None else 1.0
    return {
        "trial": name,
        "description": describe(first),
        "compiled": first.strategy.torch_compile is not None,
        "lora": first.strategy.lora is not None,
        "status": status,
        "reason": reason,
        "is_baseline": any(r.is_baseline for r in group),
        "runs": sum(r.status not in ("pruned", "skipped") for r in group),  # rows of runs that never started: no runs
        "pruned": pruned_reason(group),
        "stopping": next((r.stopping for r in group if r.stopping), None),
        "world_size": world,
        "peak_gib": memory.peak_gib if memory else None,
        "peak_reserved_gib": memory.peak_reserved_gib if memory else None,
        "nvml_process_used_gib": memory.nvml_process_used_gib if memory else None,
        "fit_gib": fit,
        "fit_source": fit_source,
        "predicted_gib": first.predicted_gib,
        "alloc_retries": memory.alloc_retries if memory else None,
        "ooms": memory.ooms if memory else None,
        **{
            f"{part}_gib": components.get(part)
            for part in ("weights", "gradients", "optimizer", "activations", "other")
        },
        "optimizer_in_gradients": bool(breakdown and breakdown.optimizer_in_gradients),
        "first_step_skipped": bool(breakdown and breakdown.first_step_skipped),
        "memory_notes": "; ".join([*(breakdown.notes() if breakdown else []), *notes]),
        "parity_status": parity_status(parity_row) if parity_row else None,
        "parity_flagged": None if parity is None else parity.flagged,
        "parity_reason": None if parity is None else parity.reason,
        "parity_max_deviation_pct": (
            None if parity is None or finite(parity.max_rel_deviation) is None else 100.0 * parity.max_rel_deviation
        ),
        "batch_searched": None if search is None else search.searched,
        "max_batch_of": None if search is None else search.max_batch_of,
        "max_batch_size": result.max_batch_size if result else None,
        "max_batch_samples_per_s": result.samples_per_s if result else None,
        "first_oom_batch_size": result.first_oom_batch_size if result else None,
        "batch_reached_upper_limit": result.reached_upper_limit if result else None,
        "stderr_tail": next((r.stderr_tail for r in group if r.status != "ok" and r.stderr_tail), None),
        "loss_curve": list(first.loss_curve),
        "loss_scale": scale,
        "compute_dtype": tp.compute_dtype if tp else None,
        "peak_tflops": None if tp is None or tp.peak_flops_per_s is None else tp.peak_flops_per_s / 1e12,
    }


def record_keys() -> list[str]:
    """The columns of a trial's record (for a run with no rows: same columns, no rows)."""
    from hfscale.strategy import Strategy

    return list(trial_record("", [TrialResult(trial="", strategy=Strategy(), status="skipped")]))
