"""The HTML report's figures as a reader meets them: no label overlaps another label or a
point, labels stay in the figure, and the per-layer legend covers no data."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text

from kvguard.eval import plots
from kvguard.eval.report import from_json

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    # the shipped measurement: 18 methods and 6 policies, clustered at a few memory ratios
    return from_json(json.loads((REPO / "docs" / "fidelity" / "fidelity.json").read_text(encoding="utf-8")))


def boxes(fig):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ax = fig.axes[0]
    # the text's own box (an Annotation's extent would include its leader line)
    labels = [(t.get_text(), Text.get_window_extent(t, r)) for t in ax.texts]
    points = [p for c in ax.collections for p in ax.transData.transform(c.get_offsets())]
    return r, ax, labels, points


def assert_readable(fig, n_points: int):
    r, ax, labels, points = boxes(fig)
    assert len(points) == n_points and labels
    named = sorted(n for text, _ in labels for n in text.split(", "))
    assert len(named) == len(set(named)) >= len(labels)
    for (a, box_a), (b, box_b) in itertools.combinations(labels, 2):
        assert not box_a.overlaps(box_b), f"labels {a!r} and {b!r} overlap"
    for text, box in labels:
        for x, y in points:
            assert not box.contains(x, y), f"label {text!r} covers a point at {(x, y)}"
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1), text


def test_scatter_labels_do_not_overlap(report):
    fig = plots.scatter_figure(report, lambda s: s.ppl_delta, "ΔPPL", "Compression vs perplexity", logy=True)
    try:
        assert_readable(fig, len(list(plots._distinct(report))))
    finally:
        plt.close(fig)


def test_labels_of_a_tight_cluster_do_not_overlap():
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [0.13 + 0.001 * i for i in range(8)] + [0.5, 0.5]  # eight nearly on top of each other, two the same
    ys = [1.0 + 0.05 * i for i in range(8)] + [2.0, 2.0]
    ax.scatter(xs, ys)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 3)
    plots.place_labels(ax, [(x, y, f"method-{i}") for i, (x, y) in enumerate(zip(xs, ys))])
    try:
        assert_readable(fig, 10)
        assert "method-8, method-9" in [t.get_text() for t in ax.texts]  # one label for one spot
    finally:
        plt.close(fig)


def test_layer_legend_lies_outside_the_data_area(report):
    fig = plots.layers_figure(report)
    try:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend, area = ax.get_legend().get_window_extent(r), ax.get_window_extent(r)
        assert legend.x0 >= area.x1, (legend, area)
        fig.savefig(plots.io.BytesIO(), format="png", dpi=plots.DPI, bbox_inches="tight")  # kept in the image
        assert len(ax.get_legend().get_texts()) == len(ax.get_lines())
    finally:
        plt.close(fig)


def test_html_tables_show_no_markdown(report, monkeypatch):
    from kvguard.eval import report as report_module

    monkeypatch.setattr(plots, "figures", lambda r: [])
    page = report_module.to_html(report)
    assert "evictor not measured" in page and "`" not in page  # chat, rag, reasoning: never fired
