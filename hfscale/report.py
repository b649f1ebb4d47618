"""Reports: what a sweep measured, as tables, plots and the fastest strategy that fits in memory.

``hfscale report RUN`` (or :func:`write_report`, which the sweep calls at its end) reads a run folder
(``hfscale.results``) and writes, next to it or into ``--out``:

============================  =====================================================================================
``report.md``                 environment, recommendation, one table row per trial (measured and predicted peak,
                              loss parity), memory table, largest batch (``--find-max-batch``), failures, plots
                              (PNG files beside it)
``report.html``               the same, self-contained: inline CSS, plots embedded as base64 PNG, no network
``results.csv``               one row per trial with every number unrounded, for your own analysis
``report_pareto.png``         peak memory against samples/s, Pareto front marked
``report_memory.png``         memory breakdown per trial (weights, gradients, optimizer, activations, the rest)
``report_loss.png``           training loss per optimizer step (same seed and data in every trial)
============================  =====================================================================================

``hfscale compare RUN_A RUN_B`` puts the same trials (matched by name) of two runs side by side with B/A ratios.

The numbers are the measured ones from ``results.jsonl`` (and the estimate made before each trial ran); this
module computes only comparisons (speed-up and memory saved against the baseline, the estimate's error, ratios
between runs), the loss parity check of rows that carry none (:func:`with_parity`, ``hfscale.parity``), the Pareto
front, the recommendation and the memory breakdown, whose derivation is documented on :class:`MemoryBreakdown`.

This is the only module that imports pandas and matplotlib, and only when a report is written.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import io
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfscale.memory import parse_memory_size
from hfscale.results import RESULTS_FILE, TrialResult, read_environment, read_results

logger = logging.getLogger(__name__)

GIB = 2**30

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
REPORT_CSV = "results.csv"
COMPARE_MD = "compare.md"
COMPARE_HTML = "compare.html"
COMPARE_CSV = "compare.csv"


def format_bytes(size_bytes: int | float) -> str:
    """``17179869184`` -> ``16 GiB``; the form a report prints a budget in."""
    gib = size_bytes / GIB
    return f"{gib:.3g} GiB" if gib >= 1 else f"{size_bytes / 2**20:.4g} MiB"


# -- reading the environment -----------------------------------------------------------------------------------

_GPU_CONTEXT = ("gpu", "cuda", "device", "nvml", "accelerator")
_NOT_CAPACITY = ("host", "cpu", "ram", "system", "swap", "used", "free", "reserved", "peak", "alloc")
_KEY_UNITS: tuple[tuple[str, float], ...] = (
    ("_bytes", 1),
    ("_tib", 2**40),
    ("_gib", 2**30),
    ("_mib", 2**20),
    ("_tb", 1e12),
    ("_gb", 1e9),
    ("_mb", 1e6),
)


def gpu_memory_from_environment(environment: Mapping[str, Any]) -> int | None:
    """The memory of one GPU the run used, in bytes, as ``environment.json`` records it; None when it does not.

    The record is free-form, so any key that names memory capacity in a GPU context is read: a key holding
    ``mem`` whose path also names ``gpu``/``cuda``/``device``/``nvml`` (and not host, used, free, peak, ...),
    with its unit taken from the key's suffix (``_bytes``, ``_gib``, ``_mib``, ``_gb``, ``_mb``) or from a string
    value (``"81559 MiB"``); a bare integer of 16 MiB or more is taken as bytes (torch's ``total_memory``). With
    several GPUs the smallest is returned, since every rank must fit.
    """
    found: list[float] = []
    for path, value in _walk(environment, ()):
        key = path[-1].lower() if path else ""
        joined = ".".join(path).lower()
        if "mem" not in key or not any(word in joined for word in _GPU_CONTEXT):
            continue
        if any(word in key for word in _NOT_CAPACITY):
            continue
        size = _size_from_key(key, value)
        if size is not None and size > 0:
            found.append(size)
    return int(min(found)) if found else None


def _walk(value: Any, path: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, (*path, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            # The list's own key stays last, so a list of sizes keeps its unit suffix: gpu_memory_gib[0].gpu_memory_gib
            yield from _walk(item, (*path[:-1], f"{path[-1] if path else ''}[{index}]", *path[-1:]))
    else:
        yield path, value


def _size_from_key(key: str, value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            return float(parse_memory_size(value))
        except ValueError:
            return None
    if not isinstance(value, int | float):
        return None
    for suffix, scale in _KEY_UNITS:
        if key.endswith(suffix):
            return float(value) * scale
    return float(value) if isinstance(value, int) and value >= 2**24 else None


# -- one table row per trial -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Where a trial's memory went, derived from the memory held at the end of each phase of the first step.

    ``MemorySummary.phases_gib`` records, for the first time each phase ends, what the allocator holds (max over
    ranks). Each component is the growth between two of those points:

    ===============  ======================================  ======================================================
    component        derivation                              why
    ===============  ======================================  ======================================================
    weights          ``model_load``                          only the (possibly sharded) model exists yet
    activations      ``forward - model_load``                what the forward pass keeps for the backward pass
    gradients        ``backward - model_load``               activations are freed by the end of backward; the
                                                             gradients stay until ``zero_grad``
    optimizer        ``optimizer_step - backward``           states are created at the first step, and the
                                                             Trainer's ``on_optimizer_step`` comes before
                                                             ``zero_grad``, so the gradients are in both terms
    other            ``peak - (the four above)``             temporaries, workspace, fragmentation, caches
    ===============  ======================================  ======================================================

    A negative difference (a library freeing or moving memory between phases, e.g. ZeRO-3 releasing gathered
    parameters) is shown as 0. The four components need not be held at the same moment (set_to_none frees the
    gradients before the next forward), so their sum can exceed the training peak; ``other`` is then 0 and the
    peak marker in the plot sits inside the bar.

    Under DeepSpeed, ZeRO allocates its optimizer states at initialisation and ``engine.step()`` runs inside
    backward, so ``weights`` holds the optimizer states too and ``optimizer`` is not separated (None). On CPU the
    figures are process RSS, so ``weights`` also holds the interpreter and its libraries.
    """

    weights_gib: float
    """Held at the end of model loading."""
    activations_gib: float | None
    """Growth from model loading to the end of the first forward pass."""
    gradients_gib: float | None
    """Growth from model loading to the end of the first backward pass."""
    optimizer_gib: float | None
    """Growth from the end of the first backward pass to the end of the first optimizer step."""
    other_gib: float | None
    """Training peak less the four components above, at least 0; None without a peak."""
    peak_gib: float | None
    """The training peak (max over ranks)."""
    optimizer_in_weights: bool = False
    """DeepSpeed: the optimizer states were allocated with the model, so ``weights_gib`` holds them."""

    @classmethod
    def from_memory(cls, memory: Mapping[str, Any] | None, *, deepspeed: bool = False) -> MemoryBreakdown | None:
        """The breakdown of a ``MemorySummary.to_dict()``; None when the model-load phase was not measured.

        ``deepspeed`` (also read from the summary's notes) says ZeRO allocated the optimizer states at
        initialisation.
        """
        phases = (memory or {}).get("phases_gib") or {}
        weights = phases.get("model_load")
        if weights is None:
            return None

        def grow(end: str, start: str) -> float | None:
            a, b = phases.get(end), phases.get(start)
            return None if a is None or b is None else max(0.0, float(a) - float(b))

        notes = (memory or {}).get("notes") or []
        deepspeed = deepspeed or any(str(note).startswith("DeepSpeed") for note in notes)
        parts = {
            "activations_gib": grow("forward", "model_load"),
            "gradients_gib": grow("backward", "model_load"),
            "optimizer_gib": None if deepspeed else grow("optimizer_step", "backward"),
        }
        peak = memory.get("peak_gib") if memory else None
        known = float(weights) + sum(v for v in parts.values() if v is not None)
        other = None if peak is None else max(0.0, float(peak) - known)
        return cls(weights_gib=float(weights), other_gib=other, peak_gib=peak, optimizer_in_weights=deepspeed, **parts)

    def components(self) -> dict[str, float | None]:
        """Component label -> GiB, in stacking order."""
        return {
            "weights": self.weights_gib,
            "gradients": self.gradients_gib,
            "optimizer": self.optimizer_gib,
            "activations": self.activations_gib,
            "other": self.other_gib,
        }


@dataclass(frozen=True, kw_only=True)
class TrialRow:
    """One trial as the report shows it: the measured figures of a ``TrialResult`` plus comparisons."""

    trial: str
    """The trial's name. A trial's repeats (``measure.repeats``) make one row; any other name that comes again
    gets ``#2``, ``#3``... so no row is hidden."""
    description: str
    """The strategy in words (precision, checkpointing, optimizer, ZeRO/FSDP, batch x accumulation x processes)."""
    status: str
    """ok, oom, crashed, timeout, not_applied or skipped."""
    reason: str | None
    """Why the trial is not ok."""
    is_baseline: bool
    runs: int
    """Times the trial ran (``measure.repeats``); figures are over the runs that finished ok."""
    wall_time_s: float | None
    """Launch to exit of the whole process group."""
    train_runtime_s: float | None
    """The Trainer's ``train_runtime`` (warm-up included, set-up excluded)."""
    samples_per_s: float | None
    """Steady-state samples per second, all processes together, warm-up steps left out (median over repeats)."""
    samples_per_s_spread_pct: float | None
    """(max - min) / median of samples/s over the repeats, in percent; None for a single run."""
    trainer_samples_per_s: float | None
    """The Trainer's ``train_samples_per_second`` (warm-up included)."""
    tokens_per_s: float | None
    step_time_median_s: float | None
    mfu: float | None
    """Model FLOPs utilisation as a fraction of the device's peak; None where the peak is unknown (CPU)."""
    world_size: int | None
    peak_gib: float | None
    """Training peak memory, max over ranks (GPU: allocated; CPU: resident set high-water mark)."""
    peak_reserved_gib: float | None
    """Peak held by the CUDA caching allocator, max over ranks; None on CPU."""
    nvml_process_used_gib: float | None
    """What NVML saw the process use (CUDA context included); None where NVML is missing."""
    estimate_gib: float | None
    """Predicted peak from ``hfscale.estimate``; None when no estimate was made."""
    alloc_retries: int | None
    ooms: int | None
    speedup_x: float | None
    """samples/s over the baseline's; None when either is missing."""
    memory_saved_gib: float | None
    """Baseline peak less this trial's peak (negative: uses more)."""
    memory_saved_pct: float | None
    """memory_saved_gib as a percentage of the baseline peak."""
    final_loss: float | None
    loss_curve: tuple[float, ...]
    parity_flagged: bool | None
    """True when the loss check flagged this trial, False when it passed, None when it was not checked."""
    parity_reason: str | None
    breakdown: MemoryBreakdown | None
    memory_notes: tuple[str, ...]
    """How to read this trial's phases (``MemorySummary.notes``: DeepSpeed, gradient accumulation)."""
    stderr_tail: str | None
    on_pareto_front: bool = False
    """No other ok trial is at least as fast and as small, and better in one of them."""
    fits_budget: bool | None = None
    """Whether the fit memory (reserved peak where known, else peak) is within the budget; None without one."""
    parity_status: str | None = None
    """``baseline`` (the reference), ``ok``, ``flagged``, ``not compared`` (with ``parity_reason``), or None when
    the loss was not checked (the trial did not finish ok)."""
    parity_max_deviation_pct: float | None = None
    """Largest deviation of the smoothed loss from the baseline's, in percent of the baseline's."""
    batch_search: dict[str, Any] | None = None
    """``row.extra["batch_search"]`` (``hfscale sweep --find-max-batch``): the largest batch that fits and every
    probe; None when no search was asked."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def fit_gib(self) -> float | None:
        """The memory a budget is checked against: the allocator's reserved peak where known (the device must hold
        it), else the peak."""
        values = [v for v in (self.peak_gib, self.peak_reserved_gib) if v is not None]
        return max(values) if values else None

    @property
    def estimate_error_pct(self) -> float | None:
        """(estimate - measured peak) / measured peak, in percent: positive when the estimate was too high."""
        if self.estimate_gib is None or not self.peak_gib:
            return None
        return 100.0 * (self.estimate_gib - self.peak_gib) / self.peak_gib

    @property
    def mfu_pct(self) -> float | None:
        return None if self.mfu is None else 100.0 * self.mfu

    @property
    def max_batch_size(self) -> int | None:
        """The largest per-device batch that fitted in the batch search."""
        return _int(self.batch_search, "max_batch_size")

    @property
    def max_batch_samples_per_s(self) -> float | None:
        """Samples/s of the probe at :attr:`max_batch_size`."""
        return _num(self.batch_search, "samples_per_s")


def _describe(result: TrialResult) -> str:
    if result.description:
        return result.description
    try:
        from hfscale.strategy import Strategy

        return Strategy.from_dict(result.strategy).describe()
    except (TypeError, ValueError) as exc:  # a row from another hfscale version: show what is there
        logger.debug("cannot describe %s: %s", result.trial, exc)
        return ", ".join(f"{k}={v}" for k, v in sorted(result.strategy.items()) if v is not None) or "?"


def _num(mapping: Mapping[str, Any] | None, key: str) -> float | None:
    value = (mapping or {}).get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _int(mapping: Mapping[str, Any] | None, key: str) -> int | None:
    value = _num(mapping, key)
    return None if value is None else int(value)


def _median(values: Iterable[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def _group_status(group: Sequence[TrialResult]) -> tuple[str, str | None]:
    """A trial's status over its repeats: ok only when every repeat is; else the first real failure."""
    failures = [(k, r) for k, r in enumerate(group, 1) if r.status != "ok"]
    if not failures:
        return "ok", None
    k, worst = next(((k, r) for k, r in failures if r.status != "skipped"), failures[0])
    if len(group) == 1:
        return worst.status, worst.reason
    n_ok = len(group) - len(failures)
    reason = f"repeat {k} of {len(group)}: {worst.reason or worst.status}"
    return worst.status, reason + (f"; {n_ok} repeat(s) ok" if n_ok else "")


def _row(group: Sequence[TrialResult], name: str) -> TrialRow:
    """One table row from a trial's runs (one, or ``measure.repeats`` of them).

    Over repeats: throughput and times are the median of the runs that finished ok; memory is the run with the
    largest peak (a budget must hold for every run); the status is ok only when every repeat finished ok.
    """
    status, reason = _group_status(group)
    runs = [r for r in group if r.status == "ok"] or list(group)
    first = runs[0]
    memory = max(runs, key=lambda r: _num(r.memory, "peak_gib") or -1.0).memory
    throughputs = [r.throughput for r in runs]
    parity = next((r.extra["parity"] for r in runs if isinstance(r.extra.get("parity"), Mapping)), None)
    flagged = [r.extra["parity"] for r in runs if isinstance(r.extra.get("parity"), Mapping)]
    if any(p.get("flagged") for p in flagged):
        parity = next(p for p in flagged if p.get("flagged"))
    speeds = [v for v in (_num(t, "samples_per_s") for t in throughputs) if v is not None]
    median_speed = _median(speeds)
    search = next((r.extra["batch_search"] for r in group if isinstance(r.extra.get("batch_search"), Mapping)), None)
    deviation = _num(parity, "max_rel_deviation")  # None for a non-finite loss: the reason says which step
    return TrialRow(
        trial=name,
        description=_describe(first),
        status=status,
        reason=reason,
        is_baseline=any(r.is_baseline for r in group),
        runs=len(group),
        wall_time_s=_median(r.wall_time_s for r in runs),
        train_runtime_s=_median(r.train_runtime_s for r in runs),
        samples_per_s=median_speed,
        samples_per_s_spread_pct=(
            100.0 * (max(speeds) - min(speeds)) / median_speed if len(speeds) > 1 and median_speed else None
        ),
        trainer_samples_per_s=_median(r.train_samples_per_second for r in runs),
        tokens_per_s=_median(_num(t, "tokens_per_s") for t in throughputs),
        step_time_median_s=_median(_num(t, "step_time_median_s") for t in throughputs),
        mfu=_median(_num(t, "mfu") for t in throughputs),
        world_size=_int(first.throughput, "world_size") or _int(memory, "world_size"),
        peak_gib=_num(memory, "peak_gib"),
        peak_reserved_gib=_num(memory, "peak_reserved_gib"),
        nvml_process_used_gib=_num(memory, "nvml_process_used_gib"),
        estimate_gib=_num(first.estimate, "total_gib"),
        alloc_retries=_int(memory, "alloc_retries"),
        ooms=_int(memory, "ooms"),
        speedup_x=None,
        memory_saved_gib=None,
        memory_saved_pct=None,
        final_loss=_median(r.final_loss for r in runs),
        loss_curve=tuple(float(x) for x in first.loss_curve or ()),
        parity_flagged=None if parity is None else bool(parity.get("flagged")),
        parity_reason=None if parity is None else parity.get("reason"),
        parity_status=_parity_status(parity),
        parity_max_deviation_pct=None if deviation is None else 100.0 * deviation,
        batch_search=dict(search) if search is not None else None,
        breakdown=MemoryBreakdown.from_memory(memory, deepspeed=first.strategy.get("deepspeed") is not None),
        memory_notes=tuple(str(n) for n in (memory or {}).get("notes") or ()),
        stderr_tail=next((r.stderr_tail for r in group if r.status != "ok" and r.stderr_tail), None),
    )


def _parity_status(parity: Mapping[str, Any] | None) -> str | None:
    if parity is None:
        return None
    if parity.get("flagged"):
        return "flagged"
    if parity.get("is_baseline"):
        return "baseline"
    return "ok" if parity.get("compared", True) else "not compared"


def with_parity(results: Sequence[TrialResult]) -> list[TrialResult]:
    """The rows, each ``ok`` row without ``extra["parity"]`` given the loss check against the baseline
    (:func:`hfscale.parity.annotate_rows`, its default tolerance); rows are copied, never changed in place.

    Parity is derived from the loss curves the rows hold, so ``results.jsonl`` stays as the sweep appended it and
    a report of any run folder (a resumed one, an older one) shows it. A row that already carries a parity record
    keeps it.
    """
    from hfscale.parity import annotate_rows

    copies = [dataclasses.replace(r, extra=dict(r.extra)) for r in results]
    if all("parity" in r.extra for r in copies if r.status == "ok"):
        return copies
    checked = [dataclasses.replace(r, extra=dict(r.extra)) for r in copies]
    annotate_rows(checked)
    for row, check in zip(copies, checked, strict=True):
        if "parity" not in row.extra and "parity" in check.extra:
            row.extra["parity"] = check.extra["parity"]
    return copies


# -- comparisons ------------------------------------------------------------------------------------------------


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """Names of the points no other point dominates, fastest first; a point is ``(samples_per_s, memory_gib)``.

    A point dominates another when it is at least as fast and at most as large, and strictly better in one of the
    two. Identical points are all on the front.
    """
    front = []
    for name, (speed, mem) in points.items():
        dominated = any(
            other != name and s >= speed and m <= mem and (s > speed or m < mem) for other, (s, m) in points.items()
        )
        if not dominated:
            front.append(name)
    return sorted(front, key=lambda n: (-points[n][0], points[n][1], n))


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The fastest strategy that fits the memory budget, and the one that needs the least memory."""

    budget_bytes: int | None
    """The per-device budget; None when none was given and the run's GPU memory is unknown."""
    budget_source: str
    """Where the budget came from, in words."""
    fastest: str | None
    """Trial name: the highest steady-state samples/s among ok trials that fit (all ok trials without a budget)."""
    most_frugal: str | None
    """Trial name: the smallest peak among ok trials (the faster one on a tie)."""
    lines: tuple[str, ...]
    """The recommendation in sentences, as the report prints it."""


@dataclass(frozen=True, kw_only=True)
class Summary:
    """Everything a report shows about one run folder."""

    run_dir: Path
    environment: dict[str, Any]
    rows: tuple[TrialRow, ...]
    baseline: str | None
    """The baseline trial's name when it finished ok, else None (see ``baseline_note``)."""
    baseline_note: str
    """What speed-up and memory saved are measured against, or why they are missing."""
    pareto: tuple[str, ...]
    """Trials on the Pareto front of (samples/s, peak memory), fastest first."""
    recommendation: Recommendation

    def row(self, trial: str) -> TrialRow:
        for row in self.rows:
            if row.trial == trial:
                return row
        raise KeyError(trial)


def _group(results: Sequence[TrialResult]) -> list[tuple[str, list[TrialResult]]]:
    """Rows grouped into trials, in order of first appearance: the repeats of a trial (``extra.repeats`` > 1)
    form one group; any other name that comes again gets ``#2``, ``#3``... so no row is hidden."""
    groups: dict[str, list[TrialResult]] = {}
    seen: dict[str, int] = {}
    for result in results:
        if int(result.extra.get("repeats") or 1) > 1:
            groups.setdefault(f"{result.trial}\0repeats", []).append(result)
            continue
        seen[result.trial] = seen.get(result.trial, 0) + 1
        key = result.trial if seen[result.trial] == 1 else f"{result.trial}#{seen[result.trial]}"
        groups[key] = [result]
    return [(key.split("\0")[0], group) for key, group in groups.items()]


def summarize(
    results: Sequence[TrialResult],
    *,
    environment: Mapping[str, Any] | None = None,
    memory_budget_bytes: int | None = None,
    run_dir: str | Path = ".",
) -> Summary:
    """Rows, baseline comparisons, Pareto front and recommendation for a run's results; ok rows without a loss
    parity record get one (:func:`with_parity`).

    Without ``memory_budget_bytes`` the budget is the GPU memory ``environment.json`` records
    (:func:`gpu_memory_from_environment`), else there is none and the recommendation says so.
    """
    environment = dict(environment or {})
    rows = [_row(group, name) for name, group in _group(with_parity(results))]
    baseline, baseline_note = _baseline(rows)
    if baseline is not None:
        rows = [_against(row, baseline) for row in rows]

    points = {r.trial: (r.samples_per_s, r.peak_gib) for r in rows if r.ok and r.samples_per_s and r.peak_gib}
    front = pareto_front(points)

    if memory_budget_bytes is not None:
        budget, source = memory_budget_bytes, "--memory-budget"
    else:
        budget = gpu_memory_from_environment(environment)
        source = "the GPU memory environment.json records" if budget is not None else "none"
    rows = [
        dataclasses.replace(
            r,
            on_pareto_front=r.trial in front,
            fits_budget=None if budget is None or r.fit_gib is None else r.fit_gib * GIB <= budget,
        )
        for r in rows
    ]
    return Summary(
        run_dir=Path(run_dir),
        environment=environment,
        rows=tuple(rows),
        baseline=baseline.trial if baseline else None,
        baseline_note=baseline_note,
        pareto=tuple(front),
        recommendation=_recommend(rows, budget, source),
    )


def _baseline(rows: Sequence[TrialRow]) -> tuple[TrialRow | None, str]:
    marked = [r for r in rows if r.is_baseline]
    if not marked:
        return None, "No trial is marked as the baseline, so speed-up and memory saved are not shown."
    ok = [r for r in marked if r.ok]
    if not ok:
        r = marked[0]
        why = f"{r.status}: {r.reason}" if r.reason else r.status
        return None, (
            f"The baseline trial {r.trial} did not finish ({why}), so speed-up and memory saved are not shown."
        )
    base = ok[0]
    note = f"Speed-up and memory saved are against the baseline trial {base.trial} ({base.description})."
    if base.samples_per_s is None or base.peak_gib is None:
        missing = "samples/s" if base.samples_per_s is None else "peak memory"
        note += f" Its {missing} was not measured, so that comparison is not shown."
    if len(marked) > 1:
        note += f" {len(marked)} trials are marked as baseline; the first that finished ok is used."
    return base, note


def _against(row: TrialRow, base: TrialRow) -> TrialRow:
    speedup = saved = saved_pct = None
    if row.samples_per_s is not None and base.samples_per_s:
        speedup = row.samples_per_s / base.samples_per_s
    if row.peak_gib is not None and base.peak_gib:
        saved = base.peak_gib - row.peak_gib
        saved_pct = 100.0 * saved / base.peak_gib
    return dataclasses.replace(row, speedup_x=speedup, memory_saved_gib=saved, memory_saved_pct=saved_pct)


def _outside_allocator_gib(rows: Sequence[TrialRow]) -> float | None:
    """Largest measured memory outside torch's allocator (NVML process use less reserved peak); None if unmeasured."""
    gaps = [
        r.nvml_process_used_gib - r.peak_reserved_gib
        for r in rows
        if r.nvml_process_used_gib is not None and r.peak_reserved_gib is not None
    ]
    gaps = [g for g in gaps if g >= 0]  # a negative gap means the NVML samples missed the peak: not a measurement
    return max(gaps) if gaps else None


def _recommend(rows: Sequence[TrialRow], budget: int | None, source: str) -> Recommendation:
    ok = [r for r in rows if r.ok and r.samples_per_s is not None and r.peak_gib is not None]
    flagged = [r for r in ok if r.parity_flagged]
    candidates = [r for r in ok if not r.parity_flagged]
    lines: list[str] = []
    if not candidates:
        lines.append("No trial finished ok with both throughput and memory measured, so nothing can be recommended.")
        return Recommendation(
            budget_bytes=budget, budget_source=source, fastest=None, most_frugal=None, lines=tuple(lines)
        )

    def speed_key(r: TrialRow) -> tuple[float, float]:
        return (-(r.samples_per_s or 0.0), r.peak_gib or 0.0)

    frugal = min(candidates, key=lambda r: (r.peak_gib, -(r.samples_per_s or 0.0)))
    fastest: TrialRow | None
    if budget is None:
        fastest = min(candidates, key=speed_key)
        lines.append(
            "No memory budget: none was given (--memory-budget) and environment.json records no GPU memory, so "
            f"the fastest trial overall is **{fastest.trial}** ({fastest.description}): "
            f"{_f(fastest.samples_per_s, 2)} samples/s, peak {_f(fastest.peak_gib, 3)} GiB."
        )
    else:
        fitting = [r for r in candidates if r.fit_gib is not None and r.fit_gib * GIB <= budget]
        fastest = min(fitting, key=speed_key) if fitting else None
        where = f"{format_bytes(budget)} per device ({source})"
        if fastest is not None:
            lines.append(
                f"Fastest within {where}: **{fastest.trial}** ({fastest.description}): "
                f"{_f(fastest.samples_per_s, 2)} samples/s, peak {_f(fastest.peak_gib, 3)} GiB"
                + (
                    f" (reserved {_f(fastest.peak_reserved_gib, 3)} GiB)"
                    if fastest.peak_reserved_gib is not None
                    else ""
                )
                + (f", {_f(fastest.speedup_x, 2)}x the baseline." if fastest.speedup_x is not None else ".")
            )
        else:
            lines.append(
                f"No ok trial fits within {where}; the smallest, **{frugal.trial}**, peaks at "
                f"{_f(frugal.fit_gib, 3)} GiB."
            )
    lines.append(
        f"Least memory: **{frugal.trial}** ({frugal.description}): peak {_f(frugal.peak_gib, 3)} GiB, "
        f"{_f(frugal.samples_per_s, 2)} samples/s"
        + (
            f", {_f(frugal.memory_saved_pct, 1)} % less than the baseline."
            if frugal.memory_saved_pct is not None and frugal.memory_saved_pct > 0
            else "."
        )
    )
    if any(r.peak_reserved_gib is not None for r in candidates):
        outside = _outside_allocator_gib(candidates)
        context = (
            f"NVML saw up to {outside:.3f} GiB per process outside it in these trials (NVML process use less "
            "reserved peak: the CUDA context and libraries)"
            if outside is not None
            else "it was not measured here (no NVML reading); the V100 reference saw 1.31 GiB after CUDA "
            "initialisation alone (shared/reference/v100-bert-large.md), an assumption for other devices"
        )
        lines.append(
            "Only trials with status ok qualify. A budget is checked against the allocator's reserved peak (what "
            "the device had to give), max over ranks; leave room for the CUDA context, which is in no allocator "
            f"figure: {context}."
        )
    else:
        lines.append(
            "Only trials with status ok qualify. Memory here is each process's resident set high-water mark (CPU "
            "training), max over ranks."
        )
    if flagged:
        names = ", ".join(f"{r.trial} ({r.parity_reason or 'flagged'})" for r in flagged)
        lines.append(f"Left out because their loss was flagged by the parity check: {names}.")
    return Recommendation(
        budget_bytes=budget,
        budget_source=source,
        fastest=fastest.trial if fastest else None,
        most_frugal=frugal.trial,
        lines=tuple(lines),
    )


# -- loading a run folder ---------------------------------------------------------------------------------------


class ReportError(ValueError):
    """A run folder or argument the report cannot use; the message names it and says what is valid."""


def load_run(run_dir: str | Path, *, memory_budget_bytes: int | None = None) -> Summary:
    """Read a run folder and summarize it.

    Raises:
        ReportError: when the folder does not exist or holds no ``results.jsonl``.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"{path}: no such folder; expected a run folder written by 'hfscale sweep'")
    if not (path / RESULTS_FILE).is_file():
        raise ReportError(f"{path}: has no {RESULTS_FILE}; expected a run folder written by 'hfscale sweep'")
    try:
        results = read_results(path)
        environment = read_environment(path)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ReportError(f"{path / RESULTS_FILE}: cannot be read: {exc}") from exc
    return summarize(results, environment=environment, memory_budget_bytes=memory_budget_bytes, run_dir=path)


# -- formatting --------------------------------------------------------------------------------------------------


def _f(value: float | None, digits: int) -> str:
    """A number with a fixed number of decimals, or an em dash when it was not measured."""
    return "—" if value is None else f"{value:.{digits}f}"


def _short(text: str | None, limit: int = 90) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _status_cell(row: TrialRow, limit: int = 90) -> str:
    return row.status if row.ok or not row.reason else f"{row.status}: {_short(row.reason, limit)}"


def _notes(row: TrialRow, summary: Summary) -> str:
    notes = []
    if row.is_baseline:
        notes.append("baseline")
    if row.on_pareto_front:
        notes.append("Pareto")
    if row.trial == summary.recommendation.fastest:
        notes.append("fastest that fits" if summary.recommendation.budget_bytes else "fastest")
    if row.trial == summary.recommendation.most_frugal:
        notes.append("least memory")
    if row.fits_budget is False:
        notes.append("over budget")
    if row.parity_flagged:
        notes.append(f"loss flagged: {_short(row.parity_reason, 60)}" if row.parity_reason else "loss flagged")
    elif row.parity_status == "ok":
        notes.append("loss parity ok")
    return "; ".join(notes)


def _parity_cell(row: TrialRow, limit: int = 70) -> str:
    status = row.parity_status
    if status is None:
        return "—"
    if status == "baseline":
        return "reference"
    if status == "ok":
        return "ok" + (
            f" (max {row.parity_max_deviation_pct:.1f} %)" if row.parity_max_deviation_pct is not None else ""
        )
    if status == "flagged":
        return "FLAGGED" + (f": {_short(row.parity_reason, limit)}" if row.parity_reason else "")
    return f"not compared: {_short(row.parity_reason, limit)}" if row.parity_reason else "not compared"


def _max_batch_cell(row: TrialRow) -> str:
    search = row.batch_search
    if not search:
        return "—"
    if search.get("searched") is False:
        return "not searched"
    if row.max_batch_size is None:
        return "none fits"
    speed = row.max_batch_samples_per_s
    plus = "+" if search.get("reached_upper_limit") else ""
    return f"{row.max_batch_size}{plus}" + (f" ({speed:.2f}/s)" if speed is not None else "")


Column = tuple[str, Callable[[TrialRow], str]]


def _main_columns(summary: Summary) -> list[Column]:
    repeats: list[Column] = []
    if any(r.runs > 1 for r in summary.rows):
        repeats = [
            ("runs", lambda r: str(r.runs)),
            ("samples/s spread (%)", lambda r: _f(r.samples_per_s_spread_pct, 1)),
        ]
    batch: list[Column] = []
    if any(r.batch_search for r in summary.rows):
        batch = [("max batch (samples/s)", _max_batch_cell)]
    return [
        ("trial", lambda r: r.trial),
        ("strategy", lambda r: r.description),
        ("status", _status_cell),
        ("wall time (s)", lambda r: _f(r.wall_time_s, 2)),
        ("train time (s)", lambda r: _f(r.train_runtime_s, 2)),
        ("samples/s (steady)", lambda r: _f(r.samples_per_s, 2)),
        *repeats,
        ("samples/s (Trainer)", lambda r: _f(r.trainer_samples_per_s, 2)),
        ("tokens/s", lambda r: _f(r.tokens_per_s, 0)),
        ("MFU (%)", lambda r: _f(r.mfu_pct, 1)),
        ("peak memory (GiB)", lambda r: _f(r.peak_gib, 3)),
        ("predicted peak (GiB)", lambda r: _f(r.estimate_gib, 3)),
        ("prediction error (%)", lambda r: _f(r.estimate_error_pct, 1)),
        *batch,
        ("speed-up vs baseline (x)", lambda r: _f(r.speedup_x, 2)),
        ("memory saved vs baseline (%)", lambda r: _f(r.memory_saved_pct, 1)),
        ("final loss", lambda r: _f(r.final_loss, 4)),
        ("loss parity", _parity_cell),
        ("notes", lambda r: _notes(r, summary)),
    ]


def _memory_columns() -> list[Column]:
    def part(name: str) -> Callable[[TrialRow], str]:
        return lambda r: _f(r.breakdown.components()[name] if r.breakdown else None, 3)

    return [
        ("trial", lambda r: r.trial),
        ("status", lambda r: r.status),
        ("processes", lambda r: "—" if r.world_size is None else str(r.world_size)),
        ("peak (GiB)", lambda r: _f(r.peak_gib, 3)),
        ("peak reserved (GiB)", lambda r: _f(r.peak_reserved_gib, 3)),
        ("NVML process (GiB)", lambda r: _f(r.nvml_process_used_gib, 3)),
        ("estimate (GiB)", lambda r: _f(r.estimate_gib, 3)),
        ("estimate vs peak (%)", lambda r: _f(r.estimate_error_pct, 1)),
        ("weights (GiB)", part("weights")),
        ("gradients (GiB)", part("gradients")),
        ("optimizer (GiB)", part("optimizer")),
        ("activations (GiB)", part("activations")),
        ("other (GiB)", part("other")),
        ("alloc retries", lambda r: "—" if r.alloc_retries is None else str(r.alloc_retries)),
        ("step time median (s)", lambda r: _f(r.step_time_median_s, 4)),
        ("how to read the phases", lambda r: "; ".join(r.memory_notes)),
    ]


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _env_items(environment: Mapping[str, Any]) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []
    for key, value in environment.items():
        if isinstance(value, Mapping) and value and all(not isinstance(v, Mapping | list) for v in value.values()):
            items += [(f"{key}.{k}", "—" if v is None else str(v)) for k, v in value.items()]
        elif isinstance(value, Mapping | list):
            items.append((str(key), json.dumps(value, sort_keys=True)))
        else:
            items.append((str(key), "—" if value is None else str(value)))
    return items


def _gib_text(value: Any) -> str:
    return f"{float(value):.1f} GiB" if isinstance(value, int | float) and not isinstance(value, bool) else "?"


def env_header(environment: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The few lines that say where a run ran, from the keys ``hfscale.environment`` writes: machine, GPUs,
    driver and CUDA, library versions, Python, commit, time. Empty when the record has none of those keys."""
    env = environment
    rows: list[tuple[str, str]] = []
    machine = [str(env[k]) for k in ("host", "cpu_model") if env.get(k)]
    if env.get("cpu_count"):
        machine.append(f"{env['cpu_count']} CPUs")
    if env.get("host_memory_total_gib") is not None:
        machine.append(f"{_gib_text(env['host_memory_total_gib'])} RAM")
    if machine:
        rows.append(("machine", ", ".join(machine)))
    if isinstance(env.get("gpus"), list):
        names: dict[str, int] = {}
        for gpu in env["gpus"]:
            if isinstance(gpu, Mapping):
                label = f"{gpu.get('name', '?')} ({_gib_text(gpu.get('memory_total_gib'))})"
                names[label] = names.get(label, 0) + 1
        rows.append(("GPUs", ", ".join(f"{n} x {label}" for label, n in names.items()) or "none"))
    driver = [f"{label} {env[k]}" for k, label in _DRIVER_KEYS if env.get(k)]
    if driver:
        rows.append(("driver / CUDA", ", ".join(driver)))
    if isinstance(env.get("packages"), Mapping):
        versions = [f"{name} {v}" for name, v in env["packages"].items() if v]
        rows.append(("libraries", ", ".join(versions) or "?"))
    if env.get("python"):
        rows.append(("python", f"{env['python']}" + (f" on {env['platform']}" if env.get("platform") else "")))
    git = env.get("git")
    if isinstance(git, Mapping) and git.get("commit"):
        rows.append(("commit", str(git["commit"])[:12] + (" (with uncommitted changes)" if git.get("dirty") else "")))
    if env.get("time"):
        rows.append(("started", str(env["time"])))
    return rows


_DRIVER_KEYS = (
    ("driver_version", "driver"),
    ("cuda_driver_version", "driver CUDA"),
    ("cuda_version", "torch CUDA"),
    ("cudnn_version", "cuDNN"),
)


def _counts(rows: Sequence[TrialRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in counts.items()) or "none"


_DEFINITIONS = (
    "**samples/s (steady)**: all processes together, the warm-up steps left out (median step time); "
    "**samples/s (Trainer)**: the Trainer's own `train_samples_per_second`, warm-up included. "
    "**wall time**: the whole process group, launch to exit (start-up, model build and engine set-up included); "
    "**train time**: the Trainer's `train_runtime`. "
    "**peak memory**: the training peak, max over ranks (GPU: allocated by the caching allocator; CPU: resident "
    "set high-water mark). **MFU**: model FLOPs per second over the device's peak dense rate, where it is known. "
    "**speed-up** and **memory saved** compare steady samples/s and peak memory with the baseline trial. "
    "A trial run several times (repeats) shows the median of the runs that finished ok and the largest peak, and "
    "is ok only when every run was."
)


def _estimate_parity_definitions() -> str:
    from hfscale.parity import DEFAULT_ABS_TOLERANCE, DEFAULT_NOISE_K, DEFAULT_REL_TOLERANCE, DEFAULT_WINDOW

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


_BATCH_HEADERS = ("trial", "start", "max batch", "samples/s at max batch", "first out of memory", "probes", "notes")

_BATCH_NOTE = (
    "Each probe trains the trial's warm-up steps plus a few more at one per-device batch size, in a fresh process "
    "group with the trial's memory limit (configs and logs in trials/NAME/probes/bsN/). From the first size (the "
    "estimate's largest that fits the budget, else the trial's own) it doubles until out of memory, halves "
    "until one fits, then bisects. Out of memory bounds the search; any other failure stops it. The samples/s are "
    "the probe's steady-state figure over its few steps; + marks a search that reached its upper limit."
)


def _probe_text(probe: Mapping[str, Any]) -> str:
    text = f"{probe.get('batch_size')}: {probe.get('status')}"
    speed, peak = _num(probe, "samples_per_s"), _num(probe, "peak_memory_gib")
    extras = [f"{speed:.2f}/s" if speed is not None else "", f"{peak:.3f} GiB" if peak is not None else ""]
    extras = [e for e in extras if e]
    return text + (f" ({', '.join(extras)})" if extras else "")


def _batch_cells(row: TrialRow) -> list[str]:
    search = row.batch_search or {}
    if search.get("searched") is False:
        return [row.trial, "—", "—", "—", "—", "", f"not searched: {search.get('reason') or '?'}"]
    notes = []
    if search.get("same_as"):
        notes.append(f"the search of {search['same_as']}, which differs only in its batch size")
    if search.get("start_from"):
        notes.append(f"started from {search['start_from']}")
    if search.get("trial_run_batch_size"):
        notes.append(f"batch {search['trial_run_batch_size']} is the trial's own run")
    if search.get("reached_upper_limit"):
        notes.append(f"the upper limit ({search.get('upper_limit', '?')}) fitted: the real limit may be higher")
    if search.get("stopped_reason"):
        notes.append(f"stopped: {_short(search['stopped_reason'], 120)}")
    if search.get("probe_steps"):
        notes.append(f"probes: warm-up + {search['probe_steps']} steps")
    first_oom = _int(search, "first_oom_batch_size")
    return [
        row.trial,
        "—" if _int(search, "start") is None else str(_int(search, "start")),
        "none fits"
        if row.max_batch_size is None
        else f"{row.max_batch_size}" + ("+" if search.get("reached_upper_limit") else ""),
        _f(row.max_batch_samples_per_s, 2),
        "—" if first_oom is None else str(first_oom),
        "; ".join(_probe_text(p) for p in search.get("probes") or () if isinstance(p, Mapping)),
        "; ".join(notes),
    ]


_BREAKDOWN_NOTE = (
    "Memory breakdown, from the memory held at the end of each phase of the first step (max over ranks): "
    "weights = after model load; activations = end of forward − model load; gradients = end of backward − model "
    "load; optimizer = end of optimizer step − end of backward (the states appear at the first step, the "
    "gradients are still held); other = peak − the four, at least 0 (temporaries, workspace, fragmentation). "
    "Negative differences show as 0. The four need not be held at once, so their sum can exceed the peak "
    "(black marker); the open diamond is the estimate where one was made. Under DeepSpeed the optimizer states are "
    "allocated with the model, so they are in the weights (hatched). On CPU the figures are process RSS, so the "
    "weights include the interpreter and its libraries."
)


# -- plots ---------------------------------------------------------------------------------------------------------

_COLORS = {
    "weights": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "other": "#BBBBBB",
}


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("reports draw their plots with matplotlib: pip install 'hfscale[report]'") from exc
    return matplotlib


def _new_figure(width_in: float, height_in: float) -> Any:
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A Figure on its own Agg canvas: no pyplot, no global backend switch, nothing shown.
    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _plot_pareto(summary: Summary) -> bytes | None:
    rows = [r for r in summary.rows if r.ok and r.samples_per_s is not None and r.peak_gib is not None]
    if not rows:
        return None
    fig = _new_figure(8.0, 5.0)
    ax = fig.add_subplot()
    rec = summary.recommendation
    other = [r for r in rows if not r.on_pareto_front]
    front = sorted((r for r in rows if r.on_pareto_front), key=lambda r: r.samples_per_s or 0.0)
    ax.scatter([r.samples_per_s for r in other], [r.peak_gib for r in other], s=40, color="#999999", label="dominated")
    ax.scatter(
        [r.samples_per_s for r in front], [r.peak_gib for r in front], s=60, color="#C44E52", label="Pareto front"
    )
    if len(front) > 1:
        ax.step(
            [r.samples_per_s for r in front],
            [r.peak_gib for r in front],
            where="pre",
            color="#C44E52",
            linewidth=1,
            alpha=0.6,
        )
    for r in rows:
        if r.is_baseline:
            ax.scatter([r.samples_per_s], [r.peak_gib], s=160, facecolors="none", edgecolors="black", label="baseline")
        if r.trial == rec.fastest:
            ax.scatter(
                [r.samples_per_s], [r.peak_gib], s=260, marker="*", color="#E1A100", label="recommended", zorder=3
            )
    for i, r in enumerate(rows):
        ax.annotate(
            r.trial,
            (r.samples_per_s, r.peak_gib),
            xytext=(6, 6 if i % 2 == 0 else -12),
            textcoords="offset points",
            fontsize=8,
        )
    if rec.budget_bytes is not None:
        budget_gib = rec.budget_bytes / GIB
        top = max(r.peak_gib or 0.0 for r in rows)
        if budget_gib <= top * 1.5:
            ax.axhline(budget_gib, color="#555555", linestyle="--", linewidth=1, label=f"budget {budget_gib:.3g} GiB")
    ax.set_xlabel("samples/s (steady state, all processes)")
    ax.set_ylabel("peak memory (GiB, max over ranks)")
    ax.set_title("Peak memory against throughput: lower right is better")
    ax.grid(True, alpha=0.3)
    # From zero: a 2 MiB difference must not look like a factor of ten.
    top = max(r.peak_gib or 0.0 for r in rows)
    if rec.budget_bytes is not None and rec.budget_bytes / GIB <= top * 1.5:
        top = max(top, rec.budget_bytes / GIB)
    ax.set_xlim(0, 1.15 * max(r.samples_per_s or 0.0 for r in rows))
    ax.set_ylim(0, 1.2 * top)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def _plot_breakdown(summary: Summary) -> bytes | None:
    rows = [r for r in summary.rows if r.breakdown is not None]
    if not rows:
        return None
    fig = _new_figure(8.0, 1.6 + 0.45 * len(rows))
    ax = fig.add_subplot()
    labels = [r.trial for r in rows]
    y = list(range(len(rows)))
    left = [0.0] * len(rows)
    for name, color in _COLORS.items():
        widths = [(r.breakdown.components()[name] or 0.0) if r.breakdown else 0.0 for r in rows]
        bars = ax.barh(y, widths, left=left, color=color, label=name, height=0.6)
        if name == "weights":  # DeepSpeed: the optimizer states are in this bar; hatch it in their colour
            for bar, r in zip(bars, rows, strict=True):
                if r.breakdown and r.breakdown.optimizer_in_weights:
                    bar.set_hatch("//")
                    bar.set_edgecolor(_COLORS["optimizer"])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    if any(r.breakdown and r.breakdown.optimizer_in_weights for r in rows):
        ax.barh(
            [0],
            [0],
            color=_COLORS["weights"],
            hatch="//",
            edgecolor=_COLORS["optimizer"],
            label="weights + optimizer (DeepSpeed)",
        )
    peaks = [(i, r.peak_gib) for i, r in enumerate(rows) if r.peak_gib is not None]
    if peaks:
        ax.scatter([p for _, p in peaks], [i for i, _ in peaks], marker="|", s=300, color="black", label="peak")
    estimates = [(i, r.estimate_gib) for i, r in enumerate(rows) if r.estimate_gib is not None]
    if estimates:
        ax.scatter(
            [e for _, e in estimates],
            [i for i, _ in estimates],
            marker="D",
            s=40,
            facecolors="none",
            edgecolors="black",
            label="estimate",
        )
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GiB (max over ranks)")
    ax.set_title("Memory breakdown per trial (first step's phases)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=8)
    return _png(fig)


def _plot_loss(summary: Summary) -> bytes | None:
    rows = [r for r in summary.rows if len(r.loss_curve) > 1]
    if not rows:
        return None
    fig = _new_figure(8.0, 4.0)
    ax = fig.add_subplot()
    for r in rows:
        style = "-" if r.ok else ":"
        ax.plot(range(1, len(r.loss_curve) + 1), r.loss_curve, style, linewidth=1.2, label=r.trial)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss (same seed and data in every trial)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    return _png(fig)


# -- writing -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReportPaths:
    """The files a report wrote."""

    markdown: Path
    html: Path
    csv: Path
    figures: tuple[Path, ...] = field(default_factory=tuple)
    """PNG plots beside the Markdown (the HTML embeds the same images)."""


@dataclass(frozen=True, kw_only=True)
class _Figure:
    name: str
    title: str
    caption: str
    png: bytes


def _figures(summary: Summary) -> list[_Figure]:
    figures = []
    pareto = _plot_pareto(summary)
    if pareto:
        figures.append(
            _Figure(
                name="report_pareto.png",
                title="Peak memory against throughput",
                caption="Each ok trial; the Pareto front (nothing else is both faster and smaller) in red, the "
                "recommended trial starred, the baseline circled, the budget dashed.",
                png=pareto,
            )
        )
    breakdown = _plot_breakdown(summary)
    if breakdown:
        figures.append(
            _Figure(
                name="report_memory.png",
                title="Memory breakdown",
                caption="Per trial with the phases measured; the black mark is the training peak, the open diamond "
                "the estimate. How each part is derived is under the Memory table.",
                png=breakdown,
            )
        )
    loss = _plot_loss(summary)
    if loss:
        figures.append(
            _Figure(
                name="report_loss.png",
                title="Training loss",
                caption="Per optimizer step; dotted lines are trials that did not finish ok.",
                png=loss,
            )
        )
    return figures


def _failures(summary: Summary) -> list[TrialRow]:
    return [r for r in summary.rows if not r.ok]


def _render_markdown(summary: Summary, figures: Sequence[_Figure]) -> str:
    out = [f"# hfscale report: {summary.run_dir.resolve().name}", ""]
    out += [f"{len(summary.rows)} trials: {_counts(summary.rows)}. {summary.baseline_note}", ""]
    out += ["## Recommendation", ""] + [f"- {line}" for line in summary.recommendation.lines] + [""]
    out += ["## Environment", ""]
    header = env_header(summary.environment) or _env_items(summary.environment)
    if header:
        out += [_md_table(["", ""], header), ""]
        if env_header(summary.environment):
            out += ["The full record is at the end of this report and in environment.json.", ""]
    else:
        out += [_NO_ENV, ""]
    columns = _main_columns(summary)
    out += ["## Trials", "", _md_table([h for h, _ in columns], ([fn(r) for _, fn in columns] for r in summary.rows))]
    out += ["", _DEFINITIONS, "", _estimate_parity_definitions(), ""]
    for fig in figures:
        out += [f"## {fig.title}", "", f"![{fig.title}]({fig.name})", "", fig.caption, ""]
    columns = _memory_columns()
    out += ["## Memory", "", _md_table([h for h, _ in columns], ([fn(r) for _, fn in columns] for r in summary.rows))]
    out += ["", _BREAKDOWN_NOTE, ""]
    searched = [r for r in summary.rows if r.batch_search]
    if searched:
        out += ["## Largest batch that fits", "", _md_table(_BATCH_HEADERS, (_batch_cells(r) for r in searched))]
        out += ["", _BATCH_NOTE, ""]
    failures = _failures(summary)
    if failures:
        out += ["## Trials that did not finish ok", ""]
        for r in failures:
            out += [f"### {r.trial}: {r.status}", "", f"{r.description}", "", f"Reason: {r.reason or 'not recorded'}"]
            if r.stderr_tail:
                out += ["", "```", r.stderr_tail.rstrip()[-3000:], "```"]
            out.append("")
    if env_header(summary.environment):
        out += ["## Environment (full record)", "", _md_table(["", "value"], _env_items(summary.environment)), ""]
    return "\n".join(out).rstrip() + "\n"


_NO_ENV = "No environment.json in this run folder: the machine and library versions are unknown."


_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:24px auto;
max-width:1500px;padding:0 16px;color:#222;line-height:1.45;background:#fff}
h1{font-size:1.6em;margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.wrap{overflow-x:auto}table{border-collapse:collapse;font-size:13px;margin:.5em 0}
th,td{border:1px solid #ddd;padding:4px 8px;vertical-align:top}th{background:#f3f4f6;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}tr:nth-child(even) td{background:#fafafa}
tr.fail td{background:#fdecea}tr.warn td{background:#fff4e0}tr.skip td{background:#f2f2f2;color:#666}
tr.rec td{background:#eaf6ec}
.status{font-weight:600}.ok{color:#1a7f37}.bad{color:#b42318}
.box{border:1px solid #9ccfa6;background:#f1faf3;padding:8px 16px;border-radius:6px}
.note{color:#555;font-size:13px}figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#555;font-size:13px;max-width:900px}pre{background:#f6f8fa;padding:8px;overflow-x:auto;
font-size:12px}.env td:first-child{font-family:monospace;white-space:nowrap}
"""

_NUMERIC_HEADERS = re.compile(
    r"\((s|GiB|x|%)\)|samples/s|tokens/s|final loss|retries|processes|^runs$|^(start|max batch|first out of memory)$"
)


def _html_table(headers: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]], klass: str = "") -> str:
    numeric = [bool(_NUMERIC_HEADERS.search(h)) for h in headers]
    parts = [f'<div class="wrap"><table class="{klass}">']
    if any(headers):
        parts += ["<thead><tr>", *(f"<th>{html.escape(h)}</th>" for h in headers), "</tr></thead>"]
    parts.append("<tbody>")
    for row_class, cells in rows:
        parts.append(f'<tr class="{row_class}">' if row_class else "<tr>")
        for is_num, cell in zip(numeric, cells, strict=True):
            parts.append(f'<td class="n">{html.escape(cell)}</td>' if is_num else f"<td>{html.escape(cell)}</td>")
        parts.append("</tr>")
    parts.append("</tbody></table></div>")
    return "".join(parts)


def _row_class(row: TrialRow, summary: Summary) -> str:
    if row.status in ("oom", "crashed", "timeout"):
        return "fail"
    if row.status == "not_applied" or row.parity_flagged:
        return "warn"
    if row.status == "skipped":
        return "skip"
    return "rec" if row.trial == summary.recommendation.fastest else ""


def _md_bold_to_html(text: str) -> str:
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(text))
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def _html_page(title: str, body: Sequence[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _html_figure(fig: _Figure) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    return (
        f'<h2>{html.escape(fig.title)}</h2><figure><img alt="{html.escape(fig.title)}" '
        f'src="data:image/png;base64,{data}"><figcaption>{html.escape(fig.caption)}</figcaption></figure>'
    )


def _html_environment(environment: Mapping[str, Any]) -> str:
    header = env_header(environment) or _env_items(environment)
    if not header:
        return f'<p class="note">{html.escape(_NO_ENV)}</p>'
    return _html_table(["", ""], [("", item) for item in header], "env")


def _html_full_environment(environment: Mapping[str, Any]) -> str:
    if not env_header(environment):
        return ""
    table = _html_table(["", "value"], [("", item) for item in _env_items(environment)], "env")
    return f"<h2>Environment (full record)</h2><details><summary>environment.json</summary>{table}</details>"


def _render_html(summary: Summary, figures: Sequence[_Figure]) -> str:
    name = summary.run_dir.resolve().name
    body = [f"<h1>hfscale report: {html.escape(name)}</h1>"]
    body.append(
        f"<p>{len(summary.rows)} trials: {html.escape(_counts(summary.rows))}. {html.escape(summary.baseline_note)}</p>"
    )
    body.append('<h2>Recommendation</h2><div class="box"><ul>')
    body += [f"<li>{_md_bold_to_html(line)}</li>" for line in summary.recommendation.lines]
    body.append("</ul></div>")
    body += ["<h2>Environment</h2>", _html_environment(summary.environment)]
    columns = _main_columns(summary)
    body.append("<h2>Trials</h2>")
    body.append(
        _html_table(
            [h for h, _ in columns],
            [(_row_class(r, summary), [fn(r) for _, fn in columns]) for r in summary.rows],
            "trials",
        )
    )
    body.append(f'<p class="note">{_md_bold_to_html(_DEFINITIONS)}</p>')
    body.append(f'<p class="note">{_md_bold_to_html(_estimate_parity_definitions())}</p>')
    body += [_html_figure(fig) for fig in figures]
    columns = _memory_columns()
    body.append("<h2>Memory</h2>")
    body.append(
        _html_table(
            [h for h, _ in columns], [(_row_class(r, summary), [fn(r) for _, fn in columns]) for r in summary.rows]
        )
    )
    body.append(f'<p class="note">{html.escape(_BREAKDOWN_NOTE)}</p>')
    searched = [r for r in summary.rows if r.batch_search]
    if searched:
        body.append("<h2>Largest batch that fits</h2>")
        body.append(_html_table(_BATCH_HEADERS, [(_row_class(r, summary), _batch_cells(r)) for r in searched]))
        body.append(f'<p class="note">{html.escape(_BATCH_NOTE)}</p>')
    failures = _failures(summary)
    if failures:
        body.append("<h2>Trials that did not finish ok</h2>")
        for r in failures:
            body.append(
                f'<h3>{html.escape(r.trial)}: <span class="status bad">{html.escape(r.status)}</span></h3>'
                f"<p>{html.escape(r.description)}<br>Reason: {html.escape(r.reason or 'not recorded')}</p>"
            )
            if r.stderr_tail:
                body.append(f"<pre>{html.escape(r.stderr_tail.rstrip()[-3000:])}</pre>")
    body.append(_html_full_environment(summary.environment))
    return _html_page(f"hfscale report: {name}", body)


def _csv_frame(summary: Summary) -> Any:
    import pandas as pd

    records = []
    for r in summary.rows:
        record = {
            k: v
            for k, v in dataclasses.asdict(r).items()
            if k
            not in (
                "breakdown",
                "loss_curve",
                "stderr_tail",
                "on_pareto_front",
                "fits_budget",
                "memory_notes",
                "batch_search",
            )
        }
        record["memory_notes"] = "; ".join(r.memory_notes)
        record["mfu_pct"] = r.mfu_pct
        record["estimate_error_pct"] = r.estimate_error_pct
        record["fit_gib"] = r.fit_gib
        if any(row.batch_search for row in summary.rows):
            search = r.batch_search or {}
            record["max_batch_size"] = r.max_batch_size
            record["max_batch_samples_per_s"] = r.max_batch_samples_per_s
            record["first_oom_batch_size"] = _int(search, "first_oom_batch_size")
            record["batch_probes"] = "; ".join(
                _probe_text(p) for p in search.get("probes") or () if isinstance(p, Mapping)
            )
        for name, value in (r.breakdown.components() if r.breakdown else {}).items():
            record[f"{name}_gib"] = value
        record["on_pareto_front"] = r.on_pareto_front
        record["fits_budget"] = r.fits_budget
        record["recommended"] = r.trial == summary.recommendation.fastest
        record["least_memory"] = r.trial == summary.recommendation.most_frugal
        records.append(record)
    return pd.DataFrame.from_records(records)


def write_report(
    run_dir: str | Path, *, memory_budget_bytes: int | None = None, out_dir: str | Path | None = None
) -> ReportPaths:
    """Write ``report.md``, ``report.html``, ``results.csv`` and the plots for a run folder.

    Args:
        run_dir: a folder written by the sweep (holds ``results.jsonl``).
        memory_budget_bytes: per-device memory the recommendation must fit in; None takes the GPU memory
            ``environment.json`` records, else recommends without a budget and says so.
        out_dir: where to write; the run folder by default.

    Raises:
        ReportError: when the folder has no results.
        ImportError: when matplotlib is missing (``pip install 'hfscale[report]'``).
    """
    summary = load_run(run_dir, memory_budget_bytes=memory_budget_bytes)
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = _figures(summary)
    figure_paths = []
    for fig in figures:
        path = out / fig.name
        path.write_bytes(fig.png)
        figure_paths.append(path)
    paths = ReportPaths(
        markdown=out / REPORT_MD, html=out / REPORT_HTML, csv=out / REPORT_CSV, figures=tuple(figure_paths)
    )
    paths.markdown.write_text(_render_markdown(summary, figures), encoding="utf-8")
    paths.html.write_text(_render_html(summary, figures), encoding="utf-8")
    _csv_frame(summary).to_csv(paths.csv, index=False)
    logger.info("report for %s written to %s", run_dir, out)
    return paths


# -- comparing two runs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Two runs' trials matched by name."""

    a: Summary
    b: Summary
    label_a: str
    label_b: str
    matched: tuple[tuple[TrialRow, TrialRow], ...]
    """Trials in both runs, in run A's order."""
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]


def compare(a: Summary, b: Summary) -> Comparison:
    """Match two summaries' trials by name."""
    label_a, label_b = a.run_dir.resolve().name, b.run_dir.resolve().name
    if label_a == label_b:
        label_a, label_b = f"A ({label_a})", f"B ({label_b})"
    by_name_b = {r.trial: r for r in b.rows}
    names_a = {r.trial for r in a.rows}
    return Comparison(
        a=a,
        b=b,
        label_a=label_a,
        label_b=label_b,
        matched=tuple((r, by_name_b[r.trial]) for r in a.rows if r.trial in by_name_b),
        only_a=tuple(r.trial for r in a.rows if r.trial not in by_name_b),
        only_b=tuple(r.trial for r in b.rows if r.trial not in names_a),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else b / a


_RATIO_FIELDS = (
    ("samples_per_s", "samples/s", 2),
    ("tokens_per_s", "tokens/s", 0),
    ("step_time_median_s", "step time median (s)", 4),
    ("peak_gib", "peak memory (GiB)", 3),
    ("wall_time_s", "wall time (s)", 2),
)


def _compare_columns(c: Comparison) -> tuple[list[str], list[list[str]]]:
    headers = ["trial", "strategy", f"status {c.label_a}", f"status {c.label_b}"]
    for _, label, _ in _RATIO_FIELDS[:-1]:
        headers += [f"{label} {c.label_a}", f"{label} {c.label_b}", f"{label} B/A (x)"]
    headers += [f"final loss {c.label_a}", f"final loss {c.label_b}", f"MFU {c.label_a} (%)", f"MFU {c.label_b} (%)"]
    body = []
    for ra, rb in c.matched:
        desc = ra.description if ra.description == rb.description else f"{ra.description} / {rb.description}"
        cells = [ra.trial, desc, _status_cell(ra, 40), _status_cell(rb, 40)]
        for attr, _, digits in _RATIO_FIELDS[:-1]:  # wall time: in the CSV only, the table is wide enough
            va, vb = getattr(ra, attr), getattr(rb, attr)
            cells += [_f(va, digits), _f(vb, digits), _f(_ratio(va, vb), 2)]
        cells += [_f(ra.final_loss, 4), _f(rb.final_loss, 4), _f(ra.mfu_pct, 1), _f(rb.mfu_pct, 1)]
        body.append(cells)
    return headers, body


_ALWAYS_DIFFERENT = ("time", "command", "launch.", "resumed", "sweep")
# Keys the header lines already show (package versions stay: one row each reads better than the joined line).
_IN_HEADER = (
    "host",
    "platform",
    "python",
    "cpu_model",
    "cpu_count",
    "host_memory_total_gib",
    "gpus",
    "gpu_count",
    "driver_version",
    "cuda_driver_version",
    "cuda_version",
    "cudnn_version",
    "git.",
)


def _env_pairs(c: Comparison) -> list[tuple[str, list[str]]]:
    """The header lines of both runs, then every other recorded key whose value differs (left out: keys that
    differ between any two runs, such as the start time and the command line)."""

    def pairs(a: dict[str, str], b: dict[str, str], keys: Iterable[str]) -> list[tuple[str, list[str]]]:
        return [("warn" if a.get(k) != b.get(k) else "", [k, a.get(k, "—"), b.get(k, "—")]) for k in keys]

    head_a, head_b = dict(env_header(c.a.environment)), dict(env_header(c.b.environment))
    out = pairs(head_a, head_b, list(head_a) + [k for k in head_b if k not in head_a])
    a, b = dict(_env_items(c.a.environment)), dict(_env_items(c.b.environment))
    keys = [k for k in list(a) + [k for k in b if k not in a] if not k.startswith(_ALWAYS_DIFFERENT)]
    if head_a or head_b:
        keys = [k for k in keys if a.get(k) != b.get(k) and not (k in _IN_HEADER or k.startswith("git."))]
    return out + pairs(a, b, keys)


def _plot_compare(c: Comparison) -> bytes | None:
    pairs = [(ra, rb) for ra, rb in c.matched if ra.samples_per_s is not None or rb.samples_per_s is not None]
    if not pairs:
        return None
    fig = _new_figure(9.0, 1.5 + 0.4 * len(pairs))
    axes = fig.subplots(1, 2, sharey=True)
    y = list(range(len(pairs)))
    for ax, attr, label in ((axes[0], "samples_per_s", "samples/s"), (axes[1], "peak_gib", "peak memory (GiB)")):
        ax.barh([i - 0.2 for i in y], [getattr(ra, attr) or 0.0 for ra, _ in pairs], height=0.4, label=c.label_a)
        ax.barh([i + 0.2 for i in y], [getattr(rb, attr) or 0.0 for _, rb in pairs], height=0.4, label=c.label_b)
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(y, [ra.trial for ra, _ in pairs], fontsize=8)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8)
    fig.suptitle("Same trials, two runs")
    return _png(fig)


def write_comparison(run_a: str | Path, run_b: str | Path, *, out_dir: str | Path | None = None) -> ReportPaths:
    """Write ``compare.md``, ``compare.html`` and ``compare.csv``: the trials of two runs side by side.

    ``out_dir`` defaults to ``compare-A-vs-B`` in the current folder.

    Raises:
        ReportError: when either folder has no results.
    """
    c = compare(load_run(run_a), load_run(run_b))
    out = (
        Path(out_dir)
        if out_dir is not None
        else Path(f"compare-{Path(run_a).resolve().name}-vs-{Path(run_b).resolve().name}")
    )
    out.mkdir(parents=True, exist_ok=True)
    headers, body = _compare_columns(c)
    png = _plot_compare(c)
    fig = (
        _Figure(
            name="compare.png",
            title="Throughput and peak memory",
            caption=f"Bars: {c.label_a} and {c.label_b} for each trial in both runs.",
            png=png,
        )
        if png
        else None
    )
    intro = (
        f"Run A: {c.a.run_dir} ({len(c.a.rows)} trials); run B: {c.b.run_dir} ({len(c.b.rows)} trials); "
        f"{len(c.matched)} in both. B/A above 1 means B is faster (samples/s, tokens/s) or uses more "
        "(step time, peak memory, wall time)."
    )
    only = []
    if c.only_a:
        only.append(f"Only in {c.label_a}: {', '.join(c.only_a)}.")
    if c.only_b:
        only.append(f"Only in {c.label_b}: {', '.join(c.only_b)}.")
    env_headers = ["", c.label_a, c.label_b]

    md = [f"# hfscale compare: {c.label_a} vs {c.label_b}", "", intro, ""] + [f"- {line}" for line in only]
    md += [
        "",
        "## Environments",
        "",
        "Rows that differ are marked with *; below the header lines, only the other recorded keys that differ.",
        "",
    ]
    md.append(_md_table(env_headers, ([("* " if k else "") + cells[0], *cells[1:]] for k, cells in _env_pairs(c))))
    md += ["", "## Trials", "", _md_table(headers, body), ""]
    if fig:
        md += [f"## {fig.title}", "", f"![{fig.title}]({fig.name})", "", fig.caption, ""]

    page = [f"<h1>hfscale compare: {html.escape(c.label_a)} vs {html.escape(c.label_b)}</h1>"]
    page.append(f"<p>{html.escape(intro)}</p>")
    if only:
        page.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in only) + "</ul>")
    page += ["<h2>Environments</h2>", '<p class="note">Rows that differ are highlighted.</p>']
    page.append(_html_table(env_headers, _env_pairs(c), "env"))
    page += ["<h2>Trials</h2>", _html_table(headers, [("", cells) for cells in body])]
    if fig:
        page.append(_html_figure(fig))

    paths = ReportPaths(
        markdown=out / COMPARE_MD,
        html=out / COMPARE_HTML,
        csv=out / COMPARE_CSV,
        figures=(out / fig.name,) if fig else (),
    )
    if fig:
        paths.figures[0].write_bytes(fig.png)
    paths.markdown.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    paths.html.write_text(_html_page(f"hfscale compare: {c.label_a} vs {c.label_b}", page), encoding="utf-8")
    _compare_frame(c).to_csv(paths.csv, index=False)
    return paths


def _compare_frame(c: Comparison) -> Any:
    import pandas as pd

    records = []
    for ra, rb in c.matched:
        record: dict[str, Any] = {"trial": ra.trial, "status_a": ra.status, "status_b": rb.status}
        for attr, _, _ in _RATIO_FIELDS:
            va, vb = getattr(ra, attr), getattr(rb, attr)
            record.update({f"{attr}_a": va, f"{attr}_b": vb, f"{attr}_ratio": _ratio(va, vb)})
        record.update({"final_loss_a": ra.final_loss, "final_loss_b": rb.final_loss})
        records.append(record)
    records += [{"trial": name, "status_a": c.a.row(name).status, "status_b": None} for name in c.only_a]
    records += [{"trial": name, "status_a": None, "status_b": c.b.row(name).status} for name in c.only_b]
    return pd.DataFrame.from_records(records)


# -- command line -------------------------------------------------------------------------------------------------


def _budget_arg(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, message already printed)
        return int(exc.code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """``hfscale report RUN_FOLDER [--memory-budget 16GiB] [--out DIR]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="hfscale report",
        description="Write report.md, report.html and results.csv (tables, plots, recommendation) for a run folder.",
    )
    parser.add_argument("run_dir", metavar="RUN_FOLDER", help="a folder written by 'hfscale sweep'")
    parser.add_argument(
        "--memory-budget",
        type=_budget_arg,
        default=None,
        metavar="SIZE",
        help="per-device memory the recommended strategy must fit in, e.g. 16GiB, 80GB, 512MiB "
        "(default: the GPU memory environment.json records, else none)",
    )
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write (default: the run folder)")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        paths = write_report(args.run_dir, memory_budget_bytes=args.memory_budget, out_dir=args.out)
    except ReportError as exc:
        print(f"hfscale report: error: argument RUN_FOLDER: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"hfscale report: error: {exc}", file=sys.stderr)
        return 2
    for path in (paths.markdown, paths.html, paths.csv, *paths.figures):
        print(path)
    return 0


def compare_main(argv: Sequence[str] | None = None) -> int:
    """``hfscale compare RUN_A RUN_B [--out DIR]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="hfscale compare",
        description="The same trials (matched by name) of two run folders side by side, with B/A ratios.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="a folder written by 'hfscale sweep'")
    parser.add_argument("run_b", metavar="RUN_B", help="another one (other machine, other library versions)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where to write (default: ./compare-A-vs-B)")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    for name, value in (("RUN_A", args.run_a), ("RUN_B", args.run_b)):
        try:
            load_run(value)
        except ReportError as exc:
            print(f"hfscale compare: error: argument {name}: {exc}", file=sys.stderr)
            return 2
    try:
        paths = write_comparison(args.run_a, args.run_b, out_dir=args.out)
    except ImportError as exc:
        print(f"hfscale compare: error: {exc}", file=sys.stderr)
        return 2
    for path in (paths.markdown, paths.html, paths.csv, *paths.figures):
        print(path)
    return 0


__all__ = [
    "Comparison",
    "MemoryBreakdown",
    "Recommendation",
    "ReportError",
    "ReportPaths",
    "Summary",
    "TrialRow",
    "compare",
    "compare_main",
    "env_header",
    "format_bytes",
    "gpu_memory_from_environment",
    "load_run",
    "main",
    "pareto_front",
    "parse_memory_size",
    "summarize",
    "with_parity",
    "write_comparison",
    "write_report",
]

if __name__ == "__main__":
    sys.exit(main())
