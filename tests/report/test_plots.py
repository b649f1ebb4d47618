"""hfscale.report.plots: every plot is a PNG, colours never repeat, labels do not overprint."""

from __future__ import annotations

import pytest
from helpers.report import ENV, constructed_rows

from hfscale import report

pytest.importorskip("matplotlib", reason="reports need the report extra: pip install 'hfscale[report]'")


from hfscale.report.plots import _new_figure, distinct_colors, place_labels, report_figures


@pytest.mark.parametrize("n", [1, 10, 11, 20, 35])
def test_colours_do_not_repeat(n: int) -> None:
    colors = distinct_colors(n)
    assert len(colors) == n and len({tuple(round(c, 6) for c in color) for color in colors}) == n


def test_labels_of_close_points_do_not_overprint() -> None:
    fig = _new_figure(8.0, 5.0)
    ax = fig.add_subplot()
    ax.set_xlim(0, 60)
    ax.set_ylim(0, 9)
    # bert_large's bs4-fp16 and bs4-bf16: 51.57 and 50.63 samples/s at the same peak.
    points = [("bs4-fp16", 51.57, 6.424), ("bs4-bf16", 50.63, 6.424), ("bs1-acc4", 15.43, 6.309), ("bs4", 32.24, 6.99)]
    place_labels(ax, points)
    fig.canvas.draw()
    boxes = [text.get_window_extent() for text in ax.texts]
    assert len(boxes) == len(points)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)


def test_report_figures_are_pngs() -> None:
    figures = report_figures(report.summarize(constructed_rows(), environment=ENV))
    names = ["report_ranking.png", "report_pareto.png", "report_memory.png", "report_loss.png"]
    assert [f.name for f in figures] == names
    assert all(f.png.startswith(b"\x89PNG\r\n\x1a\n") for f in figures)
    assert report_figures(report.summarize([])) == []
