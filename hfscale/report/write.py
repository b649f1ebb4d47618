"""Writing a report's files: the Markdown and its plots, the HTML, the CSV."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hfscale.report.analysis import summarize_run
from hfscale.report.model import Figure, Report, build_report
from hfscale.report.render import to_html, to_markdown

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
REPORT_CSV = "results.csv"


@dataclass(frozen=True, kw_only=True)
class ReportPaths:
    """The files a report wrote."""

    markdown: Path
    html: Path
    csv: Path
    figures: tuple[Path, ...] = field(default_factory=tuple)
    """PNG plots beside the Markdown (the HTML embeds the same images)."""


def csv_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The table as the CSV holds it: every scalar column unrounded; list columns (loss curve, per-repeat values)
    joined with spaces."""
    out = frame.copy()
    for column in out.columns:
        if out[column].map(lambda v: isinstance(v, list)).any():
            out[column] = out[column].map(lambda v: " ".join(repr(float(x)) for x in v) if isinstance(v, list) else v)
    return out.drop(columns=["loss_curve", "stderr_tail"], errors="ignore")


def write_files(
    out: Path, report: Report, figures: Sequence[Figure], frame: pd.DataFrame, names: tuple[str, str, str]
) -> ReportPaths:
    """Write ``report`` as Markdown and HTML, its figures beside them, and ``frame`` as CSV, under ``names``."""
    out.mkdir(parents=True, exist_ok=True)
    figure_paths = []
    for fig in figures:
        path = out / fig.name
        path.write_bytes(fig.png)
        figure_paths.append(path)
    paths = ReportPaths(markdown=out / names[0], html=out / names[1], csv=out / names[2], figures=tuple(figure_paths))
    paths.markdown.write_text(to_markdown(report), encoding="utf-8")
    paths.html.write_text(to_html(report), encoding="utf-8")
    csv_frame(frame).to_csv(paths.csv, index=False)
    return paths


def write_report(
    run_dir: str | Path,
    *,
    memory_budget_bytes: int | None = None,
    out_dir: str | Path | None = None,
    price_per_hour: float | None = None,
) -> ReportPaths:
    """Write ``report.md``, ``report.html``, ``results.csv`` and the plots for a run folder.

    Args:
        run_dir: a folder written by the sweep (holds ``results.jsonl``).
        memory_budget_bytes: per-device memory the recommendation must fit in; None takes the GPU memory
            ``environment.json`` records, else recommends without a budget and says so.
        out_dir: where to write; the run folder by default.
        price_per_hour: price of one device for an hour; adds the cost per million tokens.

    Raises:
        ReportError: when the folder has no results.
        ImportError: when matplotlib is missing (``pip install 'hfscale[report]'``).
    """
    from hfscale.report.plots import report_figures

    summary = summarize_run(run_dir, memory_budget_bytes=memory_budget_bytes, price_per_hour=price_per_hour)
    figures = report_figures(summary)
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    paths = write_files(
        out, build_report(summary, figures), figures, summary.trials, (REPORT_MD, REPORT_HTML, REPORT_CSV)
    )
    logger.info("report for %s written to %s", run_dir, out)
    return paths


__all__ = ["REPORT_CSV", "REPORT_HTML", "REPORT_MD", "ReportPaths", "csv_frame", "write_files", "write_report"]
