"""The HTML report in a real browser: headless Chromium renders it, every plot loads, the page is not blank.

Needs Debian's ``chromium`` package (``apt-get install -y chromium``) or ``CHROMIUM_PATH`` pointing at a Chromium or
Chrome binary; skipped with that reason where neither is found. Chromium runs with networking cut off (every host
resolves to nothing), so the report must carry everything it shows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.browser import run_chromium
from helpers.report import ENV, constructed_rows, write_run

from hfscale import report

pytestmark = pytest.mark.browser

PROBE = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const b = document.body;
  b.setAttribute("data-images", images.length);
  b.setAttribute("data-loaded", images.filter((i) => i.complete && i.naturalWidth > 0).length);
  b.setAttribute("data-widths", images.map((i) => i.naturalWidth + "x" + i.naturalHeight).join(","));
  b.setAttribute("data-rows", document.querySelectorAll("table.trials tbody tr").length);
  b.setAttribute("data-page-height", document.documentElement.scrollHeight);
});
</script>"""


@pytest.fixture
def html_report(tmp_path: Path) -> report.ReportPaths:
    return report.write_report(write_run(tmp_path / "run", constructed_rows(), ENV), memory_budget_bytes=5 * 2**30)


def test_report_renders_and_its_images_load(html_report: report.ReportPaths, tmp_path: Path) -> None:
    probed = tmp_path / "probed.html"
    # A broken image beside the report's own shows that the probe tells a failed load from a good one.
    control = '<img id="control" alt="" src="data:image/png;base64,iVBORw0KGgoAAAAAAAA">'
    page = html_report.html.read_text(encoding="utf-8")
    probed.write_text(page.replace("</body>", control + PROBE + "</body>"), encoding="utf-8")
    dom = run_chromium(tmp_path, "--dump-dom", probed.as_uri()).stdout
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', dom.split("<body", 1)[1].split(">", 1)[0]))
    n_figures = len(html_report.figures)
    assert n_figures == 4
    assert attrs["images"] == str(n_figures + 1), attrs
    assert attrs["loaded"] == str(n_figures), attrs
    # Decoded at the size they were drawn (the ranked chart 11.5 in wide, the others 8 in, at 100 dpi); the control
    # is last and did not decode.
    widths = [w.split("x")[0] for w in attrs["widths"].split(",")]
    assert widths == ["1150", "800", "800", "800", "0"], attrs
    assert int(attrs["rows"]) == len(constructed_rows())
    assert int(attrs["page-height"]) > 2000


def test_report_screenshot_is_not_blank(html_report: report.ReportPaths, tmp_path: Path) -> None:
    image_mod = pytest.importorskip("PIL.Image")
    np = pytest.importorskip("numpy")
    shot = tmp_path / "report.png"
    run_chromium(
        tmp_path, "--hide-scrollbars", "--window-size=1400,9000", f"--screenshot={shot}", html_report.html.as_uri()
    )
    with image_mod.open(shot) as img:
        assert img.size == (1400, 9000)
        rgb = np.asarray(img.convert("RGB"), dtype=np.int16)
    gray = rgb.mean(axis=2)
    stddev = float(gray.std())
    dark = float((gray < 128).mean())
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    # The Pareto front and the activations bars are drawn in #C44E52: the plots are on screen, not only text.
    plot_red = int(((r >= 170) & (r <= 215) & (g >= 55) & (g <= 100) & (b >= 60) & (b <= 105)).sum())
    assert stddev > 15, f"screenshot looks blank: pixel standard deviation {stddev:.1f}"
    assert dark > 0.01, f"almost no dark pixels ({dark:.2%}): text did not render"
    assert plot_red > 500, f"only {plot_red} pixels of the plots' red: the plots did not render"
