"""The report's figures (matplotlib, no display), as base64 PNG."""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

XLABEL = "KV bytes held (sparse: read) / 16-bit"


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _distinct(report):
    """One point per measurement: a policy measured as a built-in method is not drawn twice."""
    seen = set()
    for s in report.summaries:
        signature = (s.deviation, s.ppl_delta, s.held_ratio, s.read_ratio)
        if signature not in seen:
            seen.add(signature)
            yield s


def _scatter(report, y, ylabel: str, title: str, logy: bool = False) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for s in _distinct(report):
        ax.scatter(s.footprint, y(s), color="tab:green" if s.passed else "tab:red", zorder=3)
        ax.annotate(s.method, (s.footprint, y(s)), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(XLABEL)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("symlog", linthresh=0.01)
    ax.grid(alpha=0.3)
    return _png(fig)


def figures(report) -> list[tuple[str, str]]:
    """(caption, base64 PNG) of each figure."""
    out = [
        ("Compression vs perplexity change (green: passes the gate)",
         _scatter(report, lambda s: s.ppl_delta, "ΔPPL against the 16-bit cache", "Compression vs perplexity",
                  logy=True)),
        ("Compression vs decode throughput (CPU, reference attention path)",
         _scatter(report, lambda s: s.decode_tps, "decode tokens/s (median step)", "Compression vs throughput")),
        ("Compression vs latency (time to first token: prefill of the prefix)",
         _scatter(report, lambda s: s.ttft_ms, "time to first token, ms", "Compression vs latency")),
    ]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for s in report.summaries:
        if s.kind not in ("baseline", "policy"):
            ax.plot(range(len(s.deviation_per_layer)), [max(x, 1e-6) for x in s.deviation_per_layer],
                    label=s.method, lw=1.2)
    ax.axhline(report.bound.max_attention_deviation, color="k", ls="--", lw=0.8, label="gate")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("‖O′−O‖ / ‖O‖")
    ax.set_title("Attention-output deviation per layer")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    out.append(("Attention-output deviation per layer (mean over texts)", _png(fig)))
    return out
