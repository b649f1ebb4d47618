"""The columns of the comparison table, each declared once: its key in the DataFrame (unit in the name), the
header a report prints, its unit, its alignment and how a value is written.

The report's tables are selections of these columns (:func:`trial_columns`, :data:`MEMORY_COLUMNS`); a few cells
combine several values (status with its reason, the parity verdict, the notes) and say so in ``cell``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from hfscale.core.text import short as one_line

Align = Literal["left", "right"]


def is_missing(value: Any) -> bool:
    """None, NaN and pandas' NA: a figure that was not measured."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    return type(value).__name__ in ("NAType", "NaTType")


def fmt(value: Any, digits: int | None = None) -> str:
    """A number with ``digits`` decimals (None: as an integer), text as it is, or an em dash when the value was
    not measured."""
    if is_missing(value):
        return "—"
    if isinstance(value, str | bool):
        return str(value)
    if digits is None:
        return str(int(value))
    return f"{value:.{digits}f}"


def short(text: Any, limit: int = 90) -> str:
    """One line, cut at ``limit`` characters with an ellipsis; a missing value (None, NaN) is empty."""
    return one_line("" if is_missing(text) else str(text), limit)


Row = Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class Column:
    """One column: what it holds, in which unit, and how a table shows it."""

    key: str
    """The DataFrame column (units in the name: ``peak_gib``, ``wall_time_s``)."""
    header: str
    """What a table prints above it."""
    unit: str | None = None
    """GiB, s, samples/s, tokens/s, %, x; None for text, counts and flags."""
    align: Align = "right"
    """Numbers right-aligned (with tabular figures in HTML), text left."""
    digits: int | None = None
    """Decimals a table shows; None: an integer or text."""
    cell: Callable[[Row], str] | None = None
    """For a cell that combines several values; None: the value of ``key`` with ``digits``."""
    definition: str = ""
    """What the figure is, in one sentence: the HTML header's tooltip (the full definitions close the report)."""

    def text(self, row: Row) -> str:
        """The cell of one row."""
        return self.cell(row) if self.cell is not None else fmt(row.get(self.key), self.digits)


def _num(key: str, header: str, unit: str | None, digits: int | None) -> Column:
    return Column(key=key, header=header, unit=unit, digits=digits)


def _text(key: str, header: str, cell: Callable[[Row], str] | None = None) -> Column:
    return Column(key=key, header=header, align="left", cell=cell)


def status_cell(row: Row, limit: int = 90) -> str:
    return (
        row["status"]
        if row["status"] == "ok" or is_missing(row.get("reason"))
        else (f"{row['status']}: {short(row['reason'], limit)}")
    )


def _parity_cell(row: Row, limit: int = 70) -> str:
    status, reason = row.get("parity_status"), row.get("parity_reason")
    if is_missing(status):
        return "—"
    if status == "baseline":
        return "reference"
    if status == "ok":
        deviation = row.get("parity_max_deviation_pct")
        return "ok" + ("" if is_missing(deviation) else f" (max {deviation:.1f} %)")
    if status == "flagged":
        return "FLAGGED" + ("" if is_missing(reason) else f": {short(reason, limit)}")
    return "not compared" + ("" if is_missing(reason) else f": {short(reason, limit)}")


def _notes_cell(row: Row) -> str:
    notes = []
    if row.get("is_baseline"):
        notes.append("baseline")
    if not is_missing(row.get("max_batch_of")):
        notes.append(f"{row['max_batch_of']} at its largest batch: compare samples/s, not step time or loss")
    if row.get("on_pareto_front"):
        notes.append("Pareto")
    if row.get("recommended"):
        fastest = "tied fastest, chosen" if row.get("chosen_of_tie") else "fastest"
        notes.append(f"{fastest} that fits" if row.get("budget_known") else fastest)
    if row.get("ties_with_fastest"):
        notes.append("ties on speed with the fastest")
    if row.get("least_memory"):
        notes.append("least memory")
    if row.get("fits_budget") is False:
        notes.append("over budget")
    if row.get("unstable") is True:
        reason = row.get("unstable_reason")
        notes.append("may be unstable" + ("" if is_missing(reason) else f": {short(reason, 80)}"))
    # A trial of one run is untested for a reason the report's first lines state once; say only other reasons.
    two_runs = not is_missing(row.get("repeats_n")) and row["repeats_n"] >= 2
    if row.get("verdict") == "untested" and two_runs and not row.get("unstable"):
        notes.append(f"speed untested: {short(row['verdict_reason'], 80)}")
    if not is_missing(row.get("stopping")):
        how = "adaptive search" if str(row["stopping"]).startswith("adaptive") else "runs stopped sequentially"
        notes.append(f"{how} ({row.get('repeats_n')} runs)")
    if not is_missing(row.get("pruned")):
        notes.append(f"pruned: {short(row['pruned'], 80)}")
    if row.get("parity_status") == "flagged":
        reason = row.get("parity_reason")
        notes.append("loss flagged" + ("" if is_missing(reason) else f": {short(reason, 60)}"))
    elif row.get("parity_status") == "ok":
        notes.append("loss parity ok")
    return "; ".join(notes)


def _num_or_none(row: Row, key: str) -> float | None:
    value = row.get(key)
    return None if is_missing(value) else float(value)


def interval_cell(row: Row, key: str = "samples_per_s", digits: int = 2) -> str:
    """``31.90–32.60 (3 runs)``; ``single run, no interval`` for a figure the sweep's runs give no interval (no
    trial ran twice); an em dash when the figure was not measured."""
    if is_missing(row.get(key)):
        return "—"
    low, high = _num_or_none(row, f"{key}_low"), _num_or_none(row, f"{key}_high")
    if low is None or high is None:
        return "single run, no interval"
    repeats = row.get("repeats_n")
    over = "" if is_missing(repeats) else f" ({int(repeats)} run{'s' if repeats != 1 else ''})"
    return f"{low:.{digits}f}–{high:.{digits}f}{over}"


def speedup_cell(row: Row) -> str:
    """The speed-up with its interval; ``≈`` marks a tie with the baseline (inside the noise)."""
    value = _num_or_none(row, "speedup_vs_baseline")
    if value is None:
        return "—"
    verdict = row.get("verdict")
    text = f"≈ {value:.2f}" if verdict == "tie" else f"{value:.2f}"
    low, high = _num_or_none(row, "speedup_low"), _num_or_none(row, "speedup_high")
    if low is not None and high is not None and verdict != "baseline":
        text += f" ({low:.2f}–{high:.2f})"
    return text


def _saved_cell(row: Row) -> str:
    value = _num_or_none(row, "memory_saved_pct")
    if value is None:
        return "—"
    low, high = _num_or_none(row, "memory_saved_pct_low"), _num_or_none(row, "memory_saved_pct_high")
    return f"{value:.1f}" + ("" if low is None or high is None else f" ({low:.1f}–{high:.1f})")


def _mfu_cell(row: Row) -> str:
    """MFU with the peak it divides by: ``48.6 of 66.9 (fp32)``."""
    mfu = _num_or_none(row, "mfu_pct")
    if mfu is None:
        return "—"
    peak, dtype = _num_or_none(row, "peak_tflops"), row.get("compute_dtype")
    where = "" if peak is None else f" of {peak:.3g}" + ("" if is_missing(dtype) else f" ({dtype})")
    return f"{mfu:.1f}{where}"


def _peak_range_cell(row: Row) -> str:
    low, high = _num_or_none(row, "peak_gib_min"), _num_or_none(row, "peak_gib_max")
    return "—" if low is None or high is None else f"{low:.3f}–{high:.3f}"


def _max_batch_cell(row: Row) -> str:
    if is_missing(row.get("batch_searched")):
        return "—"
    if not row["batch_searched"]:
        return "not searched"
    if is_missing(row.get("max_batch_size")):
        return "none fits"
    speed = row.get("max_batch_samples_per_s")
    plus = "+" if row.get("batch_reached_upper_limit") else ""
    return f"{int(row['max_batch_size'])}{plus}" + ("" if is_missing(speed) else f" ({speed:.2f}/s)")


def _optimizer_cell(row: Row) -> str:
    if row.get("optimizer_in_gradients"):
        return "in gradients"
    if row.get("first_step_skipped"):
        return "in other (1st step skipped)"
    return fmt(row.get("optimizer_gib"), 3)


COLUMNS: dict[str, Column] = {
    c.key: c
    for c in (
        _text("trial", "trial"),
        _text("description", "strategy"),
        _text("status", "status", status_cell),
        _num("runs", "runs", None, None),
        _num("wall_time_s", "wall time (s)", "s", 2),
        _num("train_runtime_s", "train time (s)", "s", 2),
        _num("samples_per_s", "samples/s (steady)", "samples/s", 2),
        Column(key="samples_per_s_low", header="samples/s 95% interval", unit="samples/s", cell=interval_cell),
        Column(key="peak_gib_min", header="peak range over runs (GiB)", unit="GiB", cell=_peak_range_cell),
        _num("step_time_cv_pct", "step time CV (%)", "%", 1),
        _num("step_mean_se_pct", "step mean SE (%)", "%", 1),
        _num("run_noise_pct", "run noise (%)", "%", 1),
        _num("achieved_tflops", "TFLOP/s per device", "TFLOP/s", 1),
        _num("energy_j", "energy per run (J)", "J", 0),
        _num("energy_per_sample_j", "energy per sample (J)", "J", 3),
        _num("cost_per_m_tokens", "cost per M tokens", None, 3),
        _num("samples_per_s_spread_pct", "samples/s spread (%)", "%", 1),
        _num("trainer_samples_per_s", "samples/s (Trainer)", "samples/s", 2),
        _num("tokens_per_s", "tokens/s", "tokens/s", 0),
        _num("real_tokens_per_s", "real tokens/s", "tokens/s", 0),
        Column(key="mfu_pct", header="MFU (% of peak TFLOP/s)", unit="%", cell=_mfu_cell),
        _num("world_size", "processes", None, None),
        _num("peak_gib", "peak memory (GiB)", "GiB", 3),
        _num("peak_reserved_gib", "peak reserved (GiB)", "GiB", 3),
        _num("nvml_process_used_gib", "NVML process (GiB)", "GiB", 3),
        _num("predicted_gib", "predicted peak (GiB)", "GiB", 3),
        _num("estimate_error_pct", "prediction error (%)", "%", 1),
        Column(key="max_batch_size", header="max batch (samples/s)", cell=_max_batch_cell),
        Column(key="speedup_vs_baseline", header="speed-up vs baseline (x)", unit="x", cell=speedup_cell),
        Column(key="memory_saved_pct", header="memory saved vs baseline (%)", unit="%", cell=_saved_cell),
        _num("final_loss", "final loss", None, 4),
        _text("parity_status", "loss parity", _parity_cell),
        _text("notes", "notes", _notes_cell),
        _num("weights_gib", "weights (GiB)", "GiB", 3),
        _num("gradients_gib", "gradients (GiB)", "GiB", 3),
        Column(key="optimizer_gib", header="optimizer (GiB)", unit="GiB", digits=3, cell=_optimizer_cell),
        _num("activations_gib", "activations (GiB)", "GiB", 3),
        _num("other_gib", "other (GiB)", "GiB", 3),
        _num("alloc_retries", "alloc retries", None, None),
        _num("step_time_median_s", "step time median (s)", "s", 4),
        _num("first_step_s", "first step (s), compilation included", "s", 2),
        _text("memory_notes", "how to read the phases"),
    )
}
"""Every column a report table shows, by DataFrame key."""


def select(*keys: str, **headers: str) -> list[Column]:
    """The declared columns ``keys``, in order; ``headers`` renames some for one table."""
    return [replace(COLUMNS[k], header=headers[k]) if k in headers else COLUMNS[k] for k in keys]


def trial_columns(
    *,
    repeats: bool,
    batch_search: bool,
    step_times: bool = False,
    energy: bool = False,
    cost: bool = False,
    compiled: bool = False,
    real_tokens: bool = False,
) -> list[Column]:
    """The Trials table: repeat statistics only when a trial ran more than once, the step-time dispersion only
    when step times were kept, energy only where a GPU counted it, cost only with a price, the largest batch only
    when the sweep searched for it, real (unpadded) tokens/s only where batches carried an attention mask with
    padding, the first step's time (which pays torch.compile's compilation, kept out of the
    steady-state figures) only when a trial compiled."""
    return select(
        "trial",
        "description",
        "status",
        "wall_time_s",
        "train_runtime_s",
        "samples_per_s",
        "samples_per_s_low",
        *(("runs", "samples_per_s_spread_pct", "run_noise_pct") if repeats else ()),
        *(("step_time_cv_pct", "step_mean_se_pct") if step_times else ()),
        *(("cost_per_m_tokens",) if cost else ()),
        "trainer_samples_per_s",
        "tokens_per_s",
        *(("real_tokens_per_s",) if real_tokens else ()),
        "achieved_tflops",
        "mfu_pct",
        *(("first_step_s",) if compiled else ()),
        *(("energy_j", "energy_per_sample_j") if energy else ()),
        "peak_gib",
        *(("peak_gib_min",) if repeats else ()),
        "predicted_gib",
        "estimate_error_pct",
        *(("max_batch_size",) if batch_search else ()),
        "speedup_vs_baseline",
        "memory_saved_pct",
        "final_loss",
        "parity_status",
        "notes",
    )


MEMORY_COLUMNS: list[Column] = [
    *select("trial"),
    Column(key="status", header="status", align="left"),
    *select(
        "world_size",
        "peak_gib",
        "peak_reserved_gib",
        "nvml_process_used_gib",
        "predicted_gib",
        "estimate_error_pct",
        "weights_gib",
        "gradients_gib",
        "optimizer_gib",
        "activations_gib",
        "other_gib",
        "alloc_retries",
        "step_time_median_s",
        "memory_notes",
        peak_gib="peak (GiB)",
        predicted_gib="estimate (GiB)",
        estimate_error_pct="estimate vs peak (%)",
    ),
]
"""The Memory table: where each trial's memory went."""


def _speed_cell(row: Row) -> str:
    """``15.00 (14.21–15.83)``: the steady samples/s with its 95% interval where the runs give one."""
    value = _num_or_none(row, "samples_per_s")
    if value is None:
        return "—"
    low, high = _num_or_none(row, "samples_per_s_low"), _num_or_none(row, "samples_per_s_high")
    return f"{value:.2f}" + ("" if low is None or high is None else f" ({low:.2f}–{high:.2f})")


VERDICT_WORDS = {"faster": "faster", "slower": "slower", "tie": "tie", "untested": "untested"}


def verdict_cell(row: Row) -> str:
    """The speed-up with its interval and the verdict in a word: ``1.50 (1.31–1.72) faster``."""
    if row.get("verdict") == "baseline" or row.get("is_baseline"):
        return "baseline"
    speed = speedup_cell(row)
    word = VERDICT_WORDS.get(str(row.get("verdict")), "")
    return speed if speed == "—" or not word else f"{speed} {word}"


def _fits_cell(row: Row) -> str:
    fits = row.get("fits_budget")
    return "—" if is_missing(fits) else ("yes" if fits else "no")


def flags(row: Row) -> tuple[tuple[str, str], ...]:
    """The row's flags as (badge, reason): what the slim table shows beside the status, the reason one click away."""
    out: list[tuple[str, str]] = []
    if row["status"] != "ok":
        out.append((row["status"], short(row.get("reason"), 300) or "no reason recorded"))
    if row.get("recommended"):
        fits = " that fits the budget" if row.get("budget_known") else ""
        out.append(
            ("recommended", f"tied on speed with the fastest trial{fits}, chosen as the Recommendation says")
            if row.get("chosen_of_tie")
            else ("recommended", f"the fastest trial{fits}")
        )
    if row.get("ties_with_fastest"):
        out.append(("ties", "on speed with the fastest trial (Recommendation says how the tie was broken)"))
    if row.get("unstable") is True:
        out.append(("may be unstable", short(row.get("unstable_reason"), 300) or "no reason recorded"))
    two_runs = not is_missing(row.get("repeats_n")) and row["repeats_n"] >= 2
    if row.get("verdict") == "untested" and two_runs and not row.get("unstable"):
        out.append(("untested", short(row.get("verdict_reason"), 300)))
    if row.get("parity_status") == "flagged":
        out.append(("loss flagged", short(row.get("parity_reason"), 300) or "no reason recorded"))
    if not is_missing(row.get("pruned")):
        out.append(("pruned", short(row.get("pruned"), 300)))
    if not is_missing(row.get("max_batch_of")):
        out.append(("max batch", f"{row['max_batch_of']} at its largest batch: compare samples/s, not step time"))
    return tuple(out)


SLIM_COLUMNS: list[Column] = [
    replace(COLUMNS["trial"], definition="The trial's name in the recipe."),
    replace(COLUMNS["description"], definition="What the trial turns on, from its strategy."),
    Column(
        key="samples_per_s",
        header="samples/s (95% interval)",
        unit="samples/s",
        cell=_speed_cell,
        definition="Steady-state samples/s of all processes, geometric mean over the trial's runs; the interval "
        "rests on the run-to-run noise pooled over the sweep (the trial's own where the trials do not share one).",
    ),
    Column(
        key="speedup_vs_baseline",
        header="speed-up vs baseline (x)",
        unit="x",
        cell=verdict_cell,
        definition="Ratio of geometric means against the baseline, Dunnett's simultaneous 95% interval, and the "
        "verdict: faster, slower, tie (the interval holds 1 or the ratio is within 2%), or untested.",
    ),
    replace(
        COLUMNS["peak_gib"],
        definition="Training peak, max over ranks (GPU: allocated; CPU: resident set high-water mark).",
    ),
    Column(
        key="fits_budget",
        header="fits budget",
        align="left",
        cell=_fits_cell,
        definition="Whether the trial's peak (reserved where measured) is within the memory budget; — without one.",
    ),
    replace(
        COLUMNS["mfu_pct"],
        header="MFU (%)",
        definition="Model FLOPs per second per device over the device's peak dense rate for the dtype the "
        "matrix multiplications ran in (shown beside it).",
    ),
    Column(
        key="status",
        header="status and flags",
        align="left",
        cell=lambda row: "ok" if row["status"] == "ok" else "",
        definition="ok, or a badge saying how the trial failed; each badge's reason opens on a click.",
    ),
]
"""The first screen's table: what a decision needs, every other figure in All measurements."""


__all__ = [
    "COLUMNS",
    "MEMORY_COLUMNS",
    "SLIM_COLUMNS",
    "Column",
    "flags",
    "fmt",
    "interval_cell",
    "is_missing",
    "select",
    "short",
    "speedup_cell",
    "status_cell",
    "trial_columns",
    "verdict_cell",
]
