"""The report's figures (matplotlib, no display), as base64 PNG.

Methods cluster (several codecs hold the same bytes, several evictors the same budget), so
labels are placed, not just offset: each label takes the first spot around its point, nearest
first, whose box overlaps no other label, no point and stays inside the axes, with a leader
line when it had to move away; points that coincide share one label. Legends sit outside the
axes, so they cover no data.
"""

from __future__ import annotations

import base64
import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

XLABEL = "KV bytes held (sparse: read) / 16-bit"
DPI = 90
MARKER_PX = 5  # half the side of the box a point's marker is kept clear within
SAME_PX = 3  # points closer than this share a label
# (dx, dy, ha, va): directions around a point, the label extending away from it
DIRECTIONS = [(1, 0.4, "left", "bottom"), (1, -0.4, "left", "top"), (-1, 0.4, "right", "bottom"),
              (-1, -0.4, "right", "top"), (0, 1, "center", "bottom"), (0, -1, "center", "top"),
              (1, 1, "left", "bottom"), (-1, 1, "right", "bottom"), (1, -1, "left", "top"),
              (-1, -1, "right", "top")]
COLORS = {"PASS": "tab:green", "FAIL": "tab:red"}  # orange: evictor not measured
RADII = (4, 10, 18, 28, 40, 56, 75)  # points


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _distinct(report):
    """One point per measurement: a policy measured as a built-in method is not drawn twice."""
    seen = set()
    for s in report.summaries:
        signature = (s.mean_layer_deviation, s.ppl_delta, s.held_ratio, s.read_ratio)
        if signature not in seen:
            seen.add(signature)
            yield s


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(ax, points: list[tuple[float, float, str]], fontsize: float = 8) -> list:
    """Annotate each (x, y, label) so that no two labels overlap each other or a point, inside
    the axes where there is room; returns the annotations. Call after limits and scales are set."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    groups: list[list] = []  # [x, y, px, py, labels]
    for x, y, label in points:
        px, py = to_px((x, y))
        for g in groups:
            if math.hypot(g[2] - px, g[3] - py) < SAME_PX:
                g[4].append(label)
                break
        else:
            groups.append([x, y, px, py, [label]])
    markers = [Bbox.from_bounds(g[2] - MARKER_PX, g[3] - MARKER_PX, 2 * MARKER_PX, 2 * MARKER_PX) for g in groups]
    frame = ax.get_window_extent(renderer)
    # the most crowded points choose first, while there is still room around them
    crowd = [sum(math.hypot(g[2] - h[2], g[3] - h[3]) < 60 for h in groups) for g in groups]
    placed: list[Bbox] = []
    annotations = []
    for i in sorted(range(len(groups)), key=lambda i: -crowd[i]):
        x, y, _, _, labels = groups[i]
        text = ", ".join(labels)
        best = None
        for radius in RADII:
            for dx, dy, ha, va in DIRECTIONS:
                norm = math.hypot(dx, dy)
                offset = (radius * dx / norm, radius * dy / norm)
                a = ax.annotate(text, (x, y), xytext=offset, textcoords="offset points", ha=ha, va=va,
                                fontsize=fontsize)
                box = a.get_window_extent(renderer).padded(1)
                a.remove()
                cost = sum(_overlap(box, b) for b in placed) + sum(_overlap(box, m) for m in markers)
                outside = box.width * box.height - _overlap(box, frame)
                cost += 2 * outside
                if best is None or cost < best[0]:
                    best = (cost, offset, ha, va, box, radius)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        _, offset, ha, va, box, radius = best
        arrow = {"arrowstyle": "-", "color": "0.5", "lw": 0.6, "shrinkA": 0, "shrinkB": 3} if radius > 10 else None
        annotations.append(ax.annotate(text, (x, y), xytext=offset, textcoords="offset points", ha=ha, va=va,
                                       fontsize=fontsize, arrowprops=arrow))
        placed.append(box)
    return annotations


def scatter_figure(report, y, ylabel: str, title: str, logy: bool = False):
    fig, ax = plt.subplots(figsize=(8.5, 5.5), dpi=DPI)
    points = []
    for s in _distinct(report):
        value = y(s)
        if value is None or not math.isfinite(value):
            continue
        ax.scatter(s.footprint, value, color=COLORS.get(s.status, "tab:orange"), zorder=3, s=18)
        points.append((s.footprint, value, s.method))
    ax.set_xlabel(XLABEL)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("symlog", linthresh=0.01)
    ax.margins(x=0.12, y=0.12)  # room for the labels of the outermost points
    ax.grid(alpha=0.3)
    place_labels(ax, points)
    return fig


def layers_figure(report):
    fig, ax = plt.subplots(figsize=(9.5, 5), dpi=DPI)
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for s in report.summaries:
        if s.kind not in ("baseline", "policy"):
            ax.plot(range(len(s.deviation_per_layer)), [max(x, 1e-6) for x in s.deviation_per_layer],
                    label=s.method, lw=1.2)
    ax.axhline(report.bound.max_attention_deviation, color="k", ls="--", lw=0.8, label="gate (mean)")
    ax.axhline(report.bound.max_layer_deviation, color="k", ls=":", lw=0.8, label="gate (worst layer)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("‖O′−O‖ / ‖O‖")
    ax.set_title("Attention-output deviation per layer")
    # outside the axes: inside, it covered the layers where INT8 crosses the gate
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(alpha=0.3)
    return fig


def figures(report) -> list[tuple[str, str]]:
    """(caption, base64 PNG) of each figure."""
    return [
        ("Compression vs perplexity change (green: passes the gate)",
         _png(scatter_figure(report, lambda s: s.ppl_delta, "ΔPPL against the 16-bit cache",
                             "Compression vs perplexity", logy=True))),
        ("Compression vs decode throughput (CPU, reference attention path)",
         _png(scatter_figure(report, lambda s: s.decode_tps, "decode tokens/s (median step)",
                             "Compression vs throughput"))),
        ("Compression vs latency (time to first token: prefill of the prefix)",
         _png(scatter_figure(report, lambda s: s.ttft_ms, "time to first token, ms", "Compression vs latency"))),
        ("Attention-output deviation per layer (mean over texts)", _png(layers_figure(report))),
    ]
