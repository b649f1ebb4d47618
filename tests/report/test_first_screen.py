"""The report's first screen in a real browser: at 1280 px wide, the answer, the ranked chart and the slim trials
table are on the first screen (1280 x 900) without horizontal scrolling.

Headless Chromium (``tests/helpers/browser.py`` says how it is found and run) loads the report with a probe that
measures where those three elements are; the same probe on the report with its answer removed shows the test
fails when the answer is missing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.browser import run_chromium
from helpers.report import ENV, constructed_rows, write_run

from hfscale import report

pytestmark = pytest.mark.browser

WIDTH, HEIGHT = 1280, 900
PROBE = """<script>
window.addEventListener("load", () => {
  const where = (selector) => {
    const e = document.querySelector(selector);
    if (!e) return null;
    const r = e.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, height: r.height};
  };
  const out = {
    answer: where("#answer"), chart: where("#ranking img"), table: where("table.slim"),
    header: where("table.slim thead"), first_row: where("table.slim tbody tr"),
    scroll_width: document.documentElement.scrollWidth, inner_width: window.innerWidth,
  };
  document.body.setAttribute("data-probe", JSON.stringify(out));
});
</script>"""


def _probe(page: Path, tmp_path: Path) -> dict:
    dom = run_chromium(tmp_path, f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars", "--dump-dom",
                        page.as_uri()).stdout  # fmt: skip
    found = re.search(r'data-probe="([^"]*)"', dom)
    assert found, dom[:2000]
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def _on_first_screen(probe: dict) -> list[str]:
    """What is not on the first screen (empty when all is)."""
    missing = []
    for name in ("answer", "chart"):
        box = probe[name]
        if box is None or box["height"] <= 0 or box["bottom"] > HEIGHT or box["right"] > WIDTH:
            missing.append(f"{name}: {box}")
    for name in ("header", "first_row"):
        box = probe[name]
        if box is None or box["bottom"] > HEIGHT:
            missing.append(f"table {name}: {box}")
    if probe["scroll_width"] > probe["inner_width"]:
        missing.append(f"horizontal scrolling: {probe['scroll_width']} px of content in {probe['inner_width']}")
    return missing


@pytest.fixture
def html_report(tmp_path: Path) -> report.ReportPaths:
    return report.write_report(write_run(tmp_path / "run", constructed_rows(), ENV), memory_budget_bytes=5 * 2**30)


def test_answer_chart_and_slim_table_are_on_the_first_screen(html_report: report.ReportPaths, tmp_path: Path) -> None:
    page = html_report.html.read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    probe = _probe(probed, tmp_path)
    assert _on_first_screen(probe) == [], probe
    shot = tmp_path / "first-screen.png"
    run_chromium(tmp_path, f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={shot}", html_report.html.as_uri())
    assert shot.stat().st_size > 10_000

    # The same check on the page without its answer section fails, naming it.
    start, end = page.index('<section id="answer"'), page.index("</section>", page.index('<section id="answer"'))
    unanswered = tmp_path / "unanswered.html"
    unanswered.write_text(page[:start] + page[end + len("</section>") :].replace("</body>", PROBE + "</body>"),
                          encoding="utf-8")  # fmt: skip
    missing = _on_first_screen(_probe(unanswered, tmp_path))
    assert missing and missing[0].startswith("answer: None"), missing
