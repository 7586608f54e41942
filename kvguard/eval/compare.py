"""Reports of `kvguard eval` on several models, side by side (`kvguard eval --compare A.json B.json`).

Each report was measured and gated on its own model; this only lays them out together: per
method, each model's bytes held, deviation, worst layer, ΔPPL and gate; per policy, each model's
outcome and the configuration in force, and whether the models' gates agree (a policy accepted
for one model and refused or downgraded for another says so).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError


def load_reports(paths: list[str]) -> list[dict]:
    reports = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
            data["summaries"], data["decisions"], data["model"]  # noqa: B018 - the fields compared
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{p} is no kvguard eval report (fidelity.json): {e}") from None
        reports.append(data)
    if len(reports) < 2:
        raise ConfigError("--compare takes two or more fidelity.json reports")
    return reports


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.2f} %"


def _span(x: dict, field: str, fmt) -> str:
    """A summary's min–max over its texts of a per-text field ('' with one text or none)."""
    vals = [t[field] for t in x.get("texts") or [] if isinstance(t, dict) and t.get(field) is not None]
    return "" if len(vals) < 2 else f" ({fmt(min(vals))} – {fmt(max(vals))})"


def side_by_side(reports: list[dict]) -> str:
    """Markdown: the methods' and the policies' tables, a column group per report's model."""
    names = [r["model"] for r in reports]
    out = ["# kvguard fidelity, side by side", ""]
    for r in reports:
        s = r.get("settings", {})
        out.append(f"- {r['model']}: texts {', '.join(r.get('texts', []))}; prefix {s.get('prefix')}, "
                   f"{s.get('score')} scored; budget {s.get('budget')}")
    by = [{x["method"]: x for x in r["summaries"]} for r in reports]
    methods = list(dict.fromkeys(m for b in by for m in b))
    out += ["", "## Methods", "",
            "| method | " + " | ".join(f"{n}: held / deviation (texts min–max) / worst layer / ΔPPL (texts "
                                     f"min–max) / gate" for n in names) + " |",
            "|---|" + "---|" * len(names)]
    for m in methods:
        cells = []
        for b in by:
            x = b.get(m)
            cells.append("not measured" if x is None else
                         f"{x['held_ratio']:.3f} / {_pct(x['mean_layer_deviation'])}"
                         f"{_span(x, 'mean_layer_deviation', _pct)} / {_pct(x['worst_layer_deviation'])} / "
                         f"{x['ppl_delta']:+.4f}{_span(x, 'ppl_delta', '{:+.4f}'.format)} / {x['status']}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    decided = [{d["policy"]: d for d in r["decisions"]} for r in reports]
    policies = list(dict.fromkeys(p for d in decided for p in d))
    out += ["", "## Policies (each gated on its own model)", "",
            "| policy | " + " | ".join(f"{n}: outcome (in force)" for n in names) + " | the models agree |",
            "|---|" + "---|" * len(names) + "---|"]
    for p in policies:
        got = [d.get(p) for d in decided]
        cells = ["not measured" if d is None else
                 f"{d['outcome']} ({'—' if d['outcome'] == 'refuse' else '`' + str(d.get('config')) + '`'})"
                 for d in got]
        outcomes = {(d["outcome"], d.get("config")) for d in got if d is not None}
        if len(outcomes) == 1 and None not in got:
            agree = "yes"
        elif len({o for o, _ in outcomes}) == 1 and None not in got:
            agree = "no: another step in force"
        else:
            agree = "no: " + ", ".join(f"{n} {d['outcome'] if d else 'not measured'}" for n, d in zip(names, got))
        out.append(f"| {p} | " + " | ".join(cells) + f" | {agree} |")
    return "\n".join(out) + "\n"
