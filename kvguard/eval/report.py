"""The harness's results as Markdown, CSV, JSON and a self-contained HTML page."""

from __future__ import annotations

import csv
import html
import json
import math
from dataclasses import asdict
from pathlib import Path

from .evaluate import Report
from .harness import Summary

# The seeds' table (the same numbers for seven 4B-14B models at 8192 tokens): ratio, deviation, result.
SEEDS = {"none": (1.00, 0.0000, "PASS"), "int8": (0.50, 0.0020, "PASS"), "int4": (0.25, 0.0080, "PASS"),
         "h2o": (0.30, 0.0050, "PASS"), "streamingllm": (0.20, 0.0120, "FAIL"), "sparse": (0.35, 0.0040, "PASS"),
         "snapkv": (0.28, 0.0060, "PASS")}


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def summary_table(r: Report) -> tuple[list[str], list[list[str]]]:
    head = ["method", "configuration", "held", "read", "deviation (mean of layers)", "worst layer", "ΔPPL",
            "greedy agreement", "TTFT ms", "decode tok/s", f"gate (<{pct(r.bound.max_attention_deviation)}, "
            f"ΔPPL<{r.bound.max_ppl_increase})"]
    rows = [[s.method, f"`{s.key}`" + (" (evictor never fired)" if s.kind in ("evictor", "policy")
                                          and "@" in s.key and not s.evicted else ""), f"{s.held_ratio:.3f}", f"{s.read_ratio:.3f}", pct(s.deviation),
             pct(s.worst_layer), f"{s.ppl_delta:+.4f}", f"{s.agreement:.0%}", f"{s.ttft_ms:.0f}",
             f"{s.decode_tps:.1f}", "PASS" if s.passed else "FAIL"] for s in r.summaries]
    if r.settings.probe:  # the retrieval probe (needle.py): keys found, reported, not gated
        head.append("retrieval")
        rows = [row + [s.retrieval_text] for row, s in zip(rows, r.summaries)]
    return head, rows


def seeds_table(r: Report) -> tuple[list[str], list[list[str]]]:
    """Each of our methods named like a seed method (h2o, h2o-prefix, ...) beside the seeds' claim."""
    head = ["seed method", "ours", "seeds: ratio", "ours: ratio", "seeds: deviation", "ours: deviation",
            "seeds", "ours", "seed claim holds"]
    rows, ours = [], r.by_method()
    for name, (ratio, dev, verdict) in SEEDS.items():
        for mine in [m for m in ours if m == name or m.startswith(name + "-")]:
            s = ours[mine]
            got = "PASS" if s.deviation < r.bound.max_attention_deviation else "FAIL"
            holds = "yes" if got == verdict and s.deviation <= max(2 * dev, dev + 0.001) else "no"
            rows.append([name, mine, f"{ratio:.2f}", f"{s.footprint:.2f}" + (" (read)" if s.read_ratio < 1 else ""),
                         f"{dev:.4f}", f"{s.deviation:.4f}", verdict, got, holds])
    return head, rows


def text_table(r: Report) -> tuple[list[str], list[list[str]]]:
    head = ["method", "text", "deviation", "worst layer", "PPL", "ΔPPL", "greedy agreement"]
    rows = [[s.method, t.text, pct(t.mean_deviation), pct(max(t.deviation)), f"{t.ppl:.3f}", f"{t.ppl_delta:+.4f}",
             f"{t.agreement:.0%}"] for s in r.summaries for t in s.texts]
    return head, rows


def decision_table(r: Report) -> tuple[list[str], list[list[str]]]:
    head = ["policy", "measured deviation (worst text)", "ΔPPL (worst text)", "outcome", "in force"]
    rows = [[d.policy, pct(d.deviation), f"{d.ppl_delta:+.4f}", d.outcome, f"`{d.config}`" if d.config else "—"]
            for d in r.decisions]
    return head, rows


def settings_line(r: Report) -> str:
    s = r.settings
    return (f"model {r.model or 'SmolLM2-135M-Instruct'}; texts {', '.join(r.texts)}; prefix {s.prefix} tokens, "
            f"{s.score} scored in chunks of {s.chunk}, {s.generate} greedy tokens; evictor/sparse budget "
            f"{s.budget} tokens; page {s.page_size}; cache dtype {s.dtype}; "
            + ", ".join(f"{k} {v}" for k, v in r.environment.items())
            + (f"; {s.probe.describe()}" if s.probe else ""))


def to_markdown(r: Report) -> str:
    parts = ["# kvguard fidelity", "", settings_line(r), "", _table(*summary_table(r)), "",
             "## Against the seeds' table", "", _table(*seeds_table(r)), ""]
    if r.decisions:
        parts += ["## Policy calibration", "", _table(*decision_table(r)), ""]
    if r.settings.probe:
        from .needle import depth_table

        parts += ["## Retrieval probe", "", r.settings.probe.describe(), "", _table(*depth_table(r)), ""]
    parts += ["## Per text", "", _table(*text_table(r)), ""]
    return "\n".join(parts)


def to_rows(r: Report) -> list[dict]:
    rows = []
    for s in r.summaries:
        base = {"method": s.method, "kind": s.kind, "key": s.key}
        for t in s.texts:
            rows.append(base | {"text": t.text, "held_ratio": t.held_ratio, "read_ratio": t.read_ratio,
                                "deviation_mean": t.mean_deviation, "deviation_worst_layer": max(t.deviation),
                                "ppl": t.ppl, "ppl_delta": t.ppl_delta, "agreement": t.agreement,
                                "ttft_ms": 1000 * t.ttft_s, "decode_tps": t.decode_tps, "passed": ""})
        rows.append(base | {"text": "all", "held_ratio": s.held_ratio, "read_ratio": s.read_ratio,
                            "deviation_mean": s.deviation, "deviation_worst_layer": s.worst_layer, "ppl": s.ppl,
                            "ppl_delta": s.ppl_delta, "agreement": s.agreement, "ttft_ms": s.ttft_ms,
                            "decode_tps": s.decode_tps, "passed": s.passed})
        if r.settings.probe:  # the probe runs on one text: its accuracy is in the "all" row
            for row in rows[-len(s.texts) - 1:]:
                row["retrieval"] = s.retrieval_text if row["text"] == "all" else ""
    return rows


def to_json(r: Report) -> dict:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    summaries = []
    for s in r.summaries:
        d = asdict(s)
        d["texts"] = [t.as_dict() for t in s.texts]
        summaries.append(d)
    return clean({"model": r.model, "settings": asdict(r.settings), "environment": r.environment,
                  "bound": r.bound.model_dump(), "texts": r.texts, "summaries": summaries,
                  "decisions": [d.details() | {"op": d.op} for d in r.decisions],
                  "seeds": {k: {"ratio": v[0], "deviation": v[1], "result": v[2]} for k, v in SEEDS.items()}})


def from_json(data: dict) -> Report:
    """A Report back from `to_json`'s output, to render it again without measuring."""
    from ..policy import Fidelity, PolicyDecision
    from ..types import Subject
    from .harness import TextResult
    from .settings import Settings

    def num(x):
        return math.nan if x is None else x

    # NaN, JSON's null, without greedy tokens (--generate 0)
    undefined = ("ppl_delta", "worst_ppl_delta", "agreement", "decode_tps")

    summaries = []
    for d in data["summaries"]:
        texts = [TextResult(**{k: (num(v) if k in undefined else v)
                               for k, v in t.items() if k != "mean_deviation"}) for t in d["texts"]]
        fields = {k: (num(v) if k in undefined else v) for k, v in d.items()}
        summaries.append(Summary(**(fields | {"texts": texts})))
    decisions = [PolicyDecision(subject=Subject("*", "*", "*"), **{k: v for k, v in d.items() if k != "op"}
                                | {"pages": tuple(d["pages"])}) for d in data["decisions"]]
    return Report(data["model"], Settings(**data["settings"]), data["texts"], summaries, decisions,
                  Fidelity(**data["bound"]), data["environment"])


def to_html(r: Report) -> str:
    from .plots import figures

    def table(head, rows):
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        tr = "".join("<tr>" + "".join(f"<td>{html.escape(c.replace('`', ''))}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{th}</tr></thead><tbody>{tr}</tbody></table>"

    imgs = "".join(f'<figure><img alt="{html.escape(t)}" src="data:image/png;base64,{b64}">'
                   f"<figcaption>{html.escape(t)}</figcaption></figure>" for t, b64 in figures(r))
    style = ("body{font:14px system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
             "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;white-space:nowrap}"
             "td:first-child,th:first-child{text-align:left}td:nth-child(2){white-space:normal}"
             # figures at their own size (labels stay legible), one under the other on a narrow screen
             "figure{display:inline-block;margin:0 1em 1em 0;max-width:100%}img{max-width:100%}")
    body = [f"<h1>kvguard fidelity</h1><p>{html.escape(settings_line(r))}</p>", table(*summary_table(r)), imgs,
            "<h2>Against the seeds' table</h2>", table(*seeds_table(r))]
    if r.decisions:
        body += ["<h2>Policy calibration</h2>", table(*decision_table(r))]
    body += ["<h2>Per text</h2>", table(*text_table(r))]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kvguard fidelity</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def write(r: Report, out: Path, formats=("md", "csv", "json", "html")) -> list[Path]:
    """Write fidelity.<fmt> files into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        p = out / f"fidelity.{fmt}"
        if fmt == "md":
            p.write_text(to_markdown(r), encoding="utf-8")
        elif fmt == "json":
            p.write_text(json.dumps(to_json(r), indent=1), encoding="utf-8")
        elif fmt == "csv":
            rows = to_rows(r)
            with p.open("w", newline="", encoding="utf-8") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        elif fmt == "html":
            p.write_text(to_html(r), encoding="utf-8")
        paths.append(p)
    return paths
