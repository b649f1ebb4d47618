"""Markdown and HTML from one report model, through the Jinja2 templates in ``templates/``.

Both templates walk the same sections; what differs is only how a span, a cell or a figure is written. HTML is
escaped by Jinja's autoescape and is self-contained: inline CSS, plots as base64 PNG, no network.
"""

from __future__ import annotations

import base64
import functools
import re
from typing import Any

from hfscale.report.model import Report


def _md_cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@functools.cache
def _environment(kind: str) -> Any:
    try:
        import jinja2
    except ImportError as exc:  # a dependency of hfscale; missing only in a broken install
        raise ImportError("reports are rendered with jinja2: pip install hfscale (it depends on jinja2)") from exc

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("hfscale.report", "templates"),
        autoescape=kind == "html",
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["md_cell"] = _md_cell
    env.filters["b64"] = _b64
    return env


def _tidy(text: str) -> str:
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def to_markdown(report: Report) -> str:
    """The report as Markdown; figures are linked by file name (written beside it)."""
    return _tidy(_environment("md").get_template("report.md.j2").render(report=report))


def to_html(report: Report) -> str:
    """The report as one self-contained HTML page."""
    return _tidy(_environment("html").get_template("report.html.j2").render(report=report))


__all__ = ["to_html", "to_markdown"]
