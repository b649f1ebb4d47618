"""Reports of run folders: the comparison table (pandas), a report model, Markdown and HTML from one set of templates.

``hfscale report RUN`` (:func:`write_report`, which the sweep also calls at its end) writes ``report.md``,
``report.html`` (self-contained), ``results.csv`` and the plots; ``hfscale compare RUN_A RUN_B``
(:func:`write_comparison`) puts the same trials of two runs side by side. From Python, :func:`load_run` and
:func:`compare_runs` return the tables as pandas DataFrames.

The floors of the package: ``analysis`` (typed rows -> the table, with ``breakdown``, ``recommend``, ``machine`` and
``ranks``: each machine of a multi-machine run, and each rank's memory with its machine),
``columns`` (each column declared once with its unit and alignment), ``model`` (the report as sections), ``render``
(Jinja2 templates in ``templates/``), ``plots`` (matplotlib, imported when a plot is drawn), ``compare``, ``cli``.
"""

from __future__ import annotations

from hfscale.core.units import parse_memory_size
from hfscale.report.analysis import (
    ReportError,
    Summary,
    load_run,
    resolve_baseline,
    summarize,
    summarize_run,
    with_parity,
)
from hfscale.report.breakdown import MemoryBreakdown
from hfscale.report.compare import compare_runs, write_comparison
from hfscale.report.machine import env_header, format_bytes
from hfscale.report.recommend import Recommendation, pareto_front
from hfscale.report.write import ReportPaths, write_report

__all__ = [
    "MemoryBreakdown",
    "Recommendation",
    "ReportError",
    "ReportPaths",
    "Summary",
    "compare_runs",
    "env_header",
    "format_bytes",
    "load_run",
    "pareto_front",
    "parse_memory_size",
    "resolve_baseline",
    "summarize",
    "summarize_run",
    "with_parity",
    "write_comparison",
    "write_report",
]
