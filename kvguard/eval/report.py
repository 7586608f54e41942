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


def _gate_head(r: Report) -> str:
    b = r.bound
    rel = f", ΔPPL <{100 * b.max_ppl_increase_rel:g} %" if b.max_ppl_increase_rel is not None else ""
    return (f"gate (mean <{pct(b.max_attention_deviation)}, layer <{pct(b.max_layer_deviation)}, "
            f"ΔPPL <{b.max_ppl_increase:g}{rel})")


def _configuration(s: Summary) -> str:
    return f"`{s.key}`" + (f" at {s.prefix:,}+{s.score:,} tokens" if s.prefix else "")


def _span(s: Summary, attr: str, fmt) -> str:
    lo, hi = s.span(attr)
    return "—" if math.isnan(lo) else f"{fmt(lo)} – {fmt(hi)}"


def _known(fmt):
    """`fmt` for a number, a dash for one not measured (NaN: no greedy tokens, an older report)."""
    return lambda x: "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt(x)


_pp = _known(lambda x: f"{100 * x:+.2f} %")  # a relative perplexity change, in percent
_kl = _known(lambda x: f"{x:.5f}")
_top1 = _known(lambda x: f"{x:.1%}")
_greedy = _known(lambda x: f"{x:.0%}")
_ms = _known(lambda x: f"{x:.0f}")  # timings: not measured without greedy tokens, or where merged in
_tps = _known(lambda x: f"{x:.1f}")


# The report's columns, each once: (heading, value of a Summary) for the summary table, (heading,
# value of a TextResult) per text, (CSV field, value of a TextResult, value of a Summary) for the
# CSV. A new measurement adds its line to each list; `r` is the Report.
SUMMARY_COLUMNS = [
    ("method", lambda s, r: s.method),
    ("configuration", lambda s, r: _configuration(s)),
    ("held", lambda s, r: f"{s.held_ratio:.3f}"),
    ("read", lambda s, r: f"{s.read_ratio:.3f}"),
    ("deviation (mean of layers)", lambda s, r: pct(s.mean_layer_deviation)),
    ("deviation, texts min–max", lambda s, r: _span(s, "mean_layer_deviation", pct)),
    ("worst layer", lambda s, r: pct(s.worst_layer_deviation)),
    ("ΔPPL", lambda s, r: f"{s.ppl_delta:+.4f}"),
    ("ΔPPL, texts min–max", lambda s, r: _span(s, "ppl_delta", "{:+.4f}".format)),
    ("ΔPPL/PPL", lambda s, r: _pp(s.ppl_delta_rel)),
    ("KL (nats)", lambda s, r: _kl(s.kl)),
    ("top-1 agreement", lambda s, r: _top1(s.top1)),
    ("greedy agreement (info)", lambda s, r: _greedy(s.agreement)),
    ("TTFT ms", lambda s, r: _ms(s.ttft_ms)),
    ("decode tok/s", lambda s, r: _tps(s.decode_tps)),
    (_gate_head, lambda s, r: s.status),
]
# the retrieval probe (needle.py): keys found, reported, not gated; a column only where it ran
RETRIEVAL_COLUMN = ("retrieval", lambda s, r: s.retrieval_text)
TEXT_COLUMNS = [
    ("method", lambda s, t: s.method),
    ("text", lambda s, t: t.text),
    ("deviation", lambda s, t: pct(t.mean_layer_deviation)),
    ("worst layer", lambda s, t: pct(t.worst_layer_deviation)),
    ("PPL", lambda s, t: f"{t.ppl:.3f}"),
    ("ΔPPL", lambda s, t: f"{t.ppl_delta:+.4f}"),
    ("ΔPPL/PPL", lambda s, t: _pp(t.ppl_delta_rel)),
    ("KL (nats)", lambda s, t: _kl(t.kl)),
    ("top-1 agreement", lambda s, t: _top1(t.top1)),
    ("greedy agreement (info)", lambda s, t: _greedy(t.agreement)),
]
CSV_FIELDS = [
    ("held_ratio", lambda t: t.held_ratio, lambda s: s.held_ratio),
    ("read_ratio", lambda t: t.read_ratio, lambda s: s.read_ratio),
    ("mean_layer_deviation", lambda t: t.mean_layer_deviation, lambda s: s.mean_layer_deviation),
    ("worst_layer_deviation", lambda t: t.worst_layer_deviation, lambda s: s.worst_layer_deviation),
    ("ppl", lambda t: t.ppl, lambda s: s.ppl),
    ("ppl_delta", lambda t: t.ppl_delta, lambda s: s.ppl_delta),
    ("ppl_delta_rel", lambda t: t.ppl_delta_rel, lambda s: s.ppl_delta_rel),
    ("kl", lambda t: t.kl, lambda s: s.kl),
    ("top1", lambda t: t.top1, lambda s: s.top1),
    ("greedy_agreement", lambda t: t.agreement, lambda s: s.agreement),
    ("ttft_ms", lambda t: 1000 * t.ttft_s, lambda s: s.ttft_ms),
    ("decode_tps", lambda t: t.decode_tps, lambda s: s.decode_tps),
    ("evicted", lambda t: t.evicted, lambda s: s.evicted),
    ("status", lambda t: "", lambda s: s.status),
]


def summary_table(r: Report) -> tuple[list[str], list[list[str]]]:
    columns = SUMMARY_COLUMNS + ([RETRIEVAL_COLUMN] if r.settings.probe else [])
    head = [h(r) if callable(h) else h for h, _ in columns]
    return head, [[cell(s, r) for _, cell in columns] for s in r.summaries]


def seeds_table(r: Report) -> tuple[list[str], list[list[str]]]:
    """Each of our methods named like a seed method (h2o, h2o-prefix, ...) beside the seeds' claim."""
    head = ["seed method", "ours", "seeds: ratio", "ours: ratio", "seeds: deviation", "ours: deviation",
            "seeds", "ours", "seed claim holds"]
    rows, ours = [], r.by_method()
    for name, (ratio, dev, verdict) in SEEDS.items():
        for mine in [m for m in ours if m == name or m.startswith(name + "-")]:
            s = ours[mine]
            got = "PASS" if s.mean_layer_deviation < r.bound.max_attention_deviation else "FAIL"
            holds = "yes" if got == verdict and s.mean_layer_deviation <= max(2 * dev, dev + 0.001) else "no"
            rows.append([name, mine, f"{ratio:.2f}", f"{s.footprint:.2f}" + (" (read)" if s.read_ratio < 1 else ""),
                         f"{dev:.4f}", f"{s.mean_layer_deviation:.4f}", verdict, got, holds])
    return head, rows


def text_table(r: Report) -> tuple[list[str], list[list[str]]]:
    head = [h for h, _ in TEXT_COLUMNS]
    return head, [[cell(s, t) for _, cell in TEXT_COLUMNS] for s in r.summaries for t in s.texts]


def decision_table(r: Report) -> tuple[list[str], list[list[str]]]:
    head = ["policy", "deviation, mean of layers (worst text)", "worst layer", "ΔPPL (worst text)", "ΔPPL/PPL",
            "evictor", "outcome", "in force"]
    rows = [[d.policy, pct(d.mean_layer_deviation),
             "—" if d.worst_layer_deviation is None else pct(d.worst_layer_deviation), f"{d.ppl_delta:+.4f}",
             _pp(d.ppl_increase_rel), d.evictor, d.outcome,
             f"`{d.config}`" if d.config else "—"] for d in r.decisions]
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
            rows.append(base | {"text": t.text} | {name: of(t) for name, of, _ in CSV_FIELDS})
        rows.append(base | {"text": "all"} | {name: of(s) for name, _, of in CSV_FIELDS})
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

    # NaN, JSON's null: without greedy tokens (--generate 0), or in a report older than the field
    undefined = ("ppl_delta", "worst_ppl_delta", "agreement", "decode_tps", "ttft_ms", "ppl_delta_rel", "worst_ppl_delta_rel",
                 "kl", "worst_kl", "top1")
    derived = ("mean_deviation", "mean_layer_deviation", "worst_layer_deviation")  # TextResult's properties
    renamed = {"deviation": "mean_layer_deviation", "worst_layer": "worst_layer_deviation"}  # older reports

    summaries = []
    for d in data["summaries"]:
        texts = [TextResult(**{k: (num(v) if k in undefined else v)
                               for k, v in t.items() if k not in derived}) for t in d["texts"]]
        fields = {renamed.get(k, k): (num(v) if k in undefined else v) for k, v in d.items() if k != "passed"}
        if "passed" in d and "status" not in d:  # older reports passed an evictor that never fired
            evicts = "@" in d["key"].replace("+sparse@", "")
            fields["evictor_fired"] = (None if not evicts else d["read_ratio"] < 1 if d["kind"] == "simulation"
                                       else d["evicted"] > 0)
            fields["status"] = ("FAIL" if not d["passed"] else "evictor not measured"
                                if fields["evictor_fired"] is False else "PASS")
        summaries.append(Summary(**(fields | {"texts": texts})))
    decisions = [PolicyDecision.from_details(d, Subject("*", "*", "*")) for d in data["decisions"]]
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
