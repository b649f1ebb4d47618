"""The report's plots, drawn from the analysis's table: Pareto front, memory breakdown, loss curves, two runs.

matplotlib is imported when a plot is drawn (``pip install 'hfscale[report]'``); each figure is a ``Figure`` on its
own Agg canvas (no pyplot, no global backend switch). Every trial gets its own colour (no colour repeats within a
plot) and point labels are placed where they do not overprint one another.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hfscale.core.units import GIB
from hfscale.report.model import RANKING_FIGURE, Figure

if TYPE_CHECKING:
    import pandas as pd

    from hfscale.report.analysis import Summary

COMPONENT_COLORS = {
    "weights": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "other": "#BBBBBB",
}


def _new_figure(width_in: float, height_in: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure as MplFigure
    except ImportError as exc:
        raise ImportError("reports draw their plots with matplotlib: pip install 'hfscale[report]'") from exc
    fig = MplFigure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def distinct_colors(n: int) -> list[Any]:
    """``n`` colours, none repeated: tab10 up to 10, tab20 up to 20, else evenly spaced on a continuous map."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](i / (n - 1)) for i in range(n)]


_OFFSETS = ((6, 6), (6, -12), (-6, 6), (-6, -12), (6, 16), (6, -22), (-6, 16), (-6, -22), (14, 0), (-14, 0))


def place_labels(ax: Any, points: Sequence[tuple[str, float, float]], fontsize: float = 8) -> None:
    """Annotate each point with its name at the first of a few offsets whose box overlaps no label placed so far
    (boxes estimated from the text length, in display points: cheap, and enough for a few dozen trials)."""
    placed: list[tuple[float, float, float, float]] = []
    scale = ax.figure.dpi / 72
    for name, x, y in points:
        px, py = ax.transData.transform((x, y)) / scale
        width, height = 0.6 * fontsize * len(name), fontsize
        choice = _OFFSETS[0]
        for dx, dy in _OFFSETS:
            left = px + dx - (width if dx < 0 else 0)
            box = (left, py + dy, left + width, py + dy + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                choice = (dx, dy)
                placed.append(box)
                break
        else:
            placed.append((px, py, px + width, py + height))
        ax.annotate(
            name,
            (x, y),
            xytext=choice,
            textcoords="offset points",
            fontsize=fontsize,
            ha="right" if choice[0] < 0 else "left",
        )


def _measured(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["status"] == "ok") & frame["samples_per_s"].notna() & frame["peak_gib"].notna()]


def plot_pareto(summary: Summary) -> bytes | None:
    rows = _measured(summary.trials)
    if rows.empty:
        return None
    fig = _new_figure(8.0, 5.0)
    ax = fig.add_subplot()
    rec = summary.recommendation
    other, front = rows[~rows["on_pareto_front"]], rows[rows["on_pareto_front"]].sort_values("samples_per_s")
    bars = rows[rows["samples_per_s_low"].notna()] if "samples_per_s_low" in rows else rows.iloc[0:0]
    if not bars.empty:
        ax.errorbar(
            bars["samples_per_s"],
            bars["peak_gib"],
            xerr=[
                bars["samples_per_s"] - bars["samples_per_s_low"],
                bars["samples_per_s_high"] - bars["samples_per_s"],
            ],
            fmt="none",
            ecolor="#555555",
            elinewidth=1,
            capsize=3,
            label="95% interval",
        )
    ax.scatter(other["samples_per_s"], other["peak_gib"], s=40, color="#999999", label="dominated")
    ax.scatter(front["samples_per_s"], front["peak_gib"], s=60, color="#C44E52", label="Pareto front")
    if len(front) > 1:
        ax.step(front["samples_per_s"], front["peak_gib"], where="pre", color="#C44E52", linewidth=1, alpha=0.6)
    base = rows[rows["trial"] == summary.baseline]
    if not base.empty:
        ax.scatter(
            base["samples_per_s"], base["peak_gib"], s=160, facecolors="none", edgecolors="black", label="baseline"
        )
    best = rows[rows["trial"] == rec.fastest]
    if not best.empty:
        ax.scatter(
            best["samples_per_s"], best["peak_gib"], s=260, marker="*", color="#E1A100", label="recommended", zorder=3
        )
    top = float(rows["peak_gib"].max())
    budget_gib = None if rec.budget_bytes is None else rec.budget_bytes / GIB
    if budget_gib is not None and budget_gib <= top * 1.5:
        ax.axhline(budget_gib, color="#555555", linestyle="--", linewidth=1, label=f"budget {budget_gib:.3g} GiB")
        top = max(top, budget_gib)
    ax.set_xlabel("samples/s (steady state, all processes)")
    ax.set_ylabel("peak memory (GiB, max over ranks)")
    ax.set_title("Peak memory against throughput: lower right is better")
    ax.grid(True, alpha=0.3)
    # From zero: a 2 MiB difference must not look like a factor of ten.
    ax.set_xlim(0, 1.15 * float(rows["samples_per_s"].max()))
    ax.set_ylim(0, 1.2 * top)
    place_labels(ax, [(r["trial"], r["samples_per_s"], r["peak_gib"]) for _, r in rows.iterrows()])
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


RANKING_COLORS = {
    "faster": "#2E8B57",
    "tie": "#9E9E9E",
    "slower": "#C44E52",
    "untested": "#8FB3D9",
    "baseline": "#333333",
}
"""The ranked chart's bar colour by verdict against the baseline."""


def _ranking_speed(rows: pd.DataFrame) -> tuple[str, str, str, str]:
    """The figure the ranked chart ranks by: the speed-up with its interval, or samples/s without a baseline."""
    if rows["speedup_vs_baseline"].notna().any():
        return "speedup_vs_baseline", "speedup_low", "speedup_high", "speed-up vs baseline (x, 95% interval)"
    return "samples_per_s", "samples_per_s_low", "samples_per_s_high", "samples/s (steady, 95% interval)"


def plot_ranking(summary: Summary) -> bytes | None:
    """Ok trials ranked by speed-up (interval bars: overlapping bars are ties) beside their peak memory (the budget
    dashed)."""
    rows = _measured(summary.trials)
    if rows.empty:
        return None
    key, low_key, high_key, label = _ranking_speed(rows)
    rows = rows.sort_values(key, ascending=False, na_position="last")
    fig = _new_figure(11.5, 0.95 + 0.24 * len(rows))
    speed_ax, memory_ax = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    y = list(range(len(rows)))
    pairs = zip(rows["trial"], rows["verdict"], strict=True)
    verdicts = ["baseline" if trial == summary.baseline else str(verdict) for trial, verdict in pairs]
    colors = [RANKING_COLORS.get(v, RANKING_COLORS["untested"]) for v in verdicts]
    values = rows[key].astype(float)
    speed_ax.barh(y, values.fillna(0.0), color=colors, height=0.62)
    low = rows[low_key].astype(float) if low_key in rows else values * float("nan")
    high = rows[high_key].astype(float) if high_key in rows else values * float("nan")
    has = low.notna() & high.notna()
    if has.any():
        speed_ax.errorbar(values[has], [i for i, h in zip(y, has, strict=True) if h],
                          xerr=[values[has] - low[has], high[has] - values[has]], fmt="none", ecolor="black",
                          elinewidth=1, capsize=3)  # fmt: skip
    if key == "speedup_vs_baseline":
        speed_ax.axvline(1.0, color="black", linewidth=0.8)
    speed_ax.set_xlabel(label, fontsize=9)
    speed_ax.set_yticks(y, rows["trial"].tolist(), fontsize=8)
    speed_ax.invert_yaxis()
    memory_ax.barh(y, rows["peak_gib"].astype(float), color="#4C72B0", height=0.62)
    rec = summary.recommendation
    if rec.budget_bytes is not None:
        budget_gib = rec.budget_bytes / GIB
        if budget_gib <= 1.5 * float(rows["peak_gib"].max()):
            memory_ax.axvline(budget_gib, color="#C44E52", linestyle="--", linewidth=1.2)
            memory_ax.text(budget_gib, -0.7, f" budget {budget_gib:.3g} GiB", fontsize=8, color="#C44E52")
    memory_ax.set_xlabel("peak memory (GiB, max over ranks)", fontsize=9)
    for ax in (speed_ax, memory_ax):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    handles = [_patch(color, name) for name, color in RANKING_COLORS.items() if name in verdicts]
    speed_ax.legend(handles=handles, fontsize=7, loc="lower right")
    return _png(fig)


def _patch(color: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def plot_breakdown(summary: Summary) -> bytes | None:
    rows = summary.trials[summary.trials["weights_gib"].notna()]
    if rows.empty:
        return None
    fig = _new_figure(8.0, 1.6 + 0.45 * len(rows))
    ax = fig.add_subplot()
    y = list(range(len(rows)))
    left = [0.0] * len(rows)
    deepspeed = rows["optimizer_in_gradients"].astype(bool).tolist()
    for name, color in COMPONENT_COLORS.items():
        widths = rows[f"{name}_gib"].fillna(0.0).astype(float).tolist()
        bars = ax.barh(y, widths, left=left, color=color, label=name, height=0.6)
        if name == "gradients":  # DeepSpeed: the optimizer states are in this bar; hatch it in their colour
            for bar, hatched in zip(bars, deepspeed, strict=True):
                if hatched:
                    bar.set_hatch("//")
                    bar.set_edgecolor(COMPONENT_COLORS["optimizer"])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    if any(deepspeed):
        ax.barh(
            [0],
            [0],
            color=COMPONENT_COLORS["gradients"],
            hatch="//",
            edgecolor=COMPONENT_COLORS["optimizer"],
            label="gradients + optimizer states (DeepSpeed)",
        )
    peaks = rows["peak_gib"].tolist()
    ax.scatter(
        [p for p in peaks if p == p],
        [i for i, p in enumerate(peaks) if p == p],
        marker="|",
        s=300,
        color="black",
        label="peak",
    )
    estimates = rows["predicted_gib"].tolist()
    if any(e == e for e in estimates):
        ax.scatter(
            [e for e in estimates if e == e],
            [i for i, e in enumerate(estimates) if e == e],
            marker="D",
            s=40,
            facecolors="none",
            edgecolors="black",
            label="estimate",
        )
    ax.set_yticks(y, rows["trial"].tolist(), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GiB (max over ranks)")
    ax.set_title("Memory breakdown per trial (first step's phases)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=8)
    return _png(fig)


def plot_loss(summary: Summary) -> bytes | None:
    rows = summary.trials[summary.trials["loss_curve"].map(lambda c: isinstance(c, list) and len(c) > 1)]
    if rows.empty:
        return None
    fig = _new_figure(8.0, 4.0)
    ax = fig.add_subplot()
    for color, (_, r) in zip(distinct_colors(len(rows)), rows.iterrows(), strict=True):
        scale = r.get("loss_scale")
        scale = 1.0 if scale is None or scale != scale or scale <= 0 else float(scale)
        curve = [v / scale for v in r["loss_curve"]]
        label = r["trial"] if scale == 1.0 else f"{r['trial']} (÷ {scale:g})"
        style = "-" if r["status"] == "ok" else ":"
        ax.plot(range(1, len(curve) + 1), curve, style, color=color, linewidth=1.2, label=label)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss (same seed and data in every trial)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    return _png(fig)


def ranking_caption(summary: Summary) -> str:
    """The ranking plot's caption, naming the intervals as the table's verdicts have them."""
    speed = summary.speed
    if speed.floor is not None:
        family = f"Šidák; no mean narrower than one run of the noise floor, {speed.floor.sd:.1%}"
    else:
        family = "Dunnett" if speed.shared else "Dunnett's T3: each pair's own noise"
    return (
        f"Ok trials, fastest first: the speed-up against the baseline with its 95% interval ({family}; bars that "
        "overlap 1 are ties), coloured by verdict, beside each trial's peak memory and the budget (dashed)."
    )


def report_figures(summary: Summary) -> list[Figure]:
    """The report's plots that have something to show, in report order."""
    made = [
        (
            RANKING_FIGURE,
            "Speed-up and peak memory",
            plot_ranking,
            ranking_caption(summary),
        ),
        (
            "report_pareto.png",
            "Peak memory against throughput",
            plot_pareto,
            "Each ok trial; the Pareto front (nothing else is both faster and smaller) in red, the recommended trial "
            "starred, the baseline circled, the budget dashed.",
        ),
        (
            "report_memory.png",
            "Memory breakdown",
            plot_breakdown,
            "Per trial with the phases measured; the black mark is the training peak, the open diamond the estimate. "
            "How each part is derived is under the Memory table.",
        ),
        (
            "report_loss.png",
            "Training loss",
            plot_loss,
            "Per optimizer step; dotted lines are trials that did not finish ok. A curve logged at a known multiple "
            "of the baseline's (gradient accumulation or process count: the loss check's scale) is divided by it "
            "first, as the legend says (÷ N).",
        ),
    ]
    figures = []
    for name, title, draw, caption in made:
        png = draw(summary)
        if png:
            figures.append(Figure(name=name, title=title, caption=caption, png=png))
    return figures


def plot_compare(pairs: pd.DataFrame, label_a: str, label_b: str) -> bytes | None:
    """Samples/s and peak memory of the trials in both runs, as paired bars (``compare_runs``'s rows)."""
    pairs = pairs[pairs["samples_per_s_a"].notna() | pairs["samples_per_s_b"].notna()]
    if pairs.empty:
        return None
    fig = _new_figure(9.0, 1.5 + 0.4 * len(pairs))
    axes = fig.subplots(1, 2, sharey=True)
    y = list(range(len(pairs)))
    for ax, key, label in ((axes[0], "samples_per_s", "samples/s"), (axes[1], "peak_gib", "peak memory (GiB)")):
        ax.barh([i - 0.2 for i in y], pairs[f"{key}_a"].fillna(0.0), height=0.4, label=label_a)
        ax.barh([i + 0.2 for i in y], pairs[f"{key}_b"].fillna(0.0), height=0.4, label=label_b)
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(y, pairs["trial"].tolist(), fontsize=8)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8)
    fig.suptitle("Same trials, two runs")
    return _png(fig)


__all__ = [
    "distinct_colors",
    "place_labels",
    "plot_breakdown",
    "plot_compare",
    "plot_loss",
    "plot_pareto",
    "plot_ranking",
    "ranking_caption",
    "report_figures",
]
