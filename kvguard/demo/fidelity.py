"""Part 2 of the demo: what each scenario policy costs on the real model, and the gate's decision.

The fidelity harness (kvguard.eval) runs SmolLM2-135M over Python's own standard library
source with each policy's cache, measures the attention-output deviation and perplexity
change against a 16-bit cache, and calibrates each policy against its bound. A short run,
so evictors whose budget is longer than the text do not fire; the numbers `kvguard eval`
measured on long texts (docs/fidelity/fidelity.json) are quoted for them.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

from ..policy import Policy
from .savings import print_table

REPORT = Path(__file__).resolve().parents[2] / "docs" / "fidelity" / "fidelity.json"


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def decided(d) -> str:
    if d.outcome == "accept":
        return "accept"
    if d.outcome == "downgrade":
        return f"downgrade to step {d.step}: {d.config}"
    return "refuse (no configuration of it may run)"


def show_fidelity(policies: dict[str, Policy], *, prefix: int, score: int, threads: int = 1) -> None:
    import torch

    from ..eval.evaluate import evaluate
    from ..eval.settings import Settings
    from ..eval.texts import stdlib_code
    from ..hf.model import load_smollm2, smollm2_gguf

    print(f"\n== 2. What it costs: each policy's cache on the real model (SmolLM2-135M), {prefix} tokens of "
          f"Python source written, the next {score} scored\n")
    if threads > 0:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2()
    settings = Settings(prefix=prefix, score=score, chunk=16, generate=0)
    report = evaluate(model, tokenizer, {"stdlib-code": stdlib_code()}, [], settings, list(policies.values()),
                      model_name=smollm2_gguf().name, progress=sys.stderr.isatty())
    measured = report.by_method()
    head = ["policy", "measured here", "evicted", "deviation", "worst layer", "ΔPPL", "bound", "gate"]
    table = [head]
    idle = []
    for d in report.decisions:
        s = measured[d.policy]
        p = policies[d.policy]
        if p.evictor and not s.evicted:
            idle.append(p)
        table.append([d.policy, s.key.split("+")[0] + ("" if s.evicted or not p.evictor else " (evictor idle)"),
                      f"{s.evicted:,}", pct(s.mean_layer_deviation), pct(s.worst_layer_deviation), f"{s.ppl_delta:+.4f}",
                      f"{pct(d.max_attention_deviation)}, {d.max_ppl_increase:g}", decided(d)])
    print_table(table)
    print(f"""
  deviation: ||O'-O|| / ||O|| of each attention layer's output for the scored tokens, this cache
    against a 16-bit cache of the same text, mean over the {len(next(iter(measured.values())).deviation_per_layer)} layers; the gate compares it
    (and the perplexity change, ΔPPL) with the policy's bound. The worst layer is shown for
    transparency and bounded too (3x the mean's bound unless the policy sets its own).
  ({time.perf_counter() - t0:.0f} s with the model load; 'kvguard eval' measures longer texts and every method.)""")
    for d in report.decisions:
        if d.outcome == "accept":
            continue
        over = ([f"moved attention {pct(d.mean_layer_deviation)}, over its bound of "
                 f"{pct(d.max_attention_deviation)}"] if d.mean_layer_deviation >= d.max_attention_deviation else [])
        if d.worst_layer_deviation is not None and d.worst_layer_deviation >= d.max_layer_deviation:
            over.append(f"moved one layer's attention {pct(d.worst_layer_deviation)}, over its bound of "
                        f"{pct(d.max_layer_deviation)}")
        if d.ppl_delta >= d.max_ppl_increase:
            over.append(f"changed perplexity by {d.ppl_delta:+.3f}, over its bound of {d.max_ppl_increase:g}")
        if not over and d.evictor == "not measured":
            over.append("kept its bound only because its evictor never fired at this length: the evictor "
                        "was not measured")
        then = ("so the gate refused it: no configuration of it may run" if d.outcome == "refuse" else
                f"so the gate stepped down to its first step within the bound: {d.config}")
        print(f"\n  {d.policy}: as written ({policies[d.policy].steps()[0].key}) it "
              + " and ".join(over) + f";\n    {then}.")
    if idle:
        _explain_eviction(idle, prefix + score)


def _explain_eviction(idle: list[Policy], length: int) -> None:
    names = ", ".join(p.name for p in idle)
    least = min(p.evictor.budget for p in idle)
    print("\n" + textwrap.fill(
        f"Eviction at this length: {length} tokens are below the smallest budget ({least:,}), so the evictors "
        f"of {names} keep every token; an evictor costs nothing until a sequence passes its budget.",
        width=98, initial_indent="  ", subsequent_indent="  "))
    try:
        data = json.loads(REPORT.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    s = data["settings"]
    decisions = {d["policy"]: d for d in data.get("decisions", [])}
    rows = {r.get("method"): r for r in data.get("summaries", [])}
    lines = []
    for p in idle:
        d = decisions.get(p.name)
        if d is None:
            continue
        gate = {"accept": "accepted", "refuse": "refused"}.get(d["outcome"], f"downgraded to {d['config']}")
        if d.get("evictor") == "not measured":
            gate += " (its evictor never fired)"
        row = rows.get(p.name) or {}
        at = f" at {row['prefix']:,}+{row['score']:,}" if row.get("prefix") else ""  # lengthened so its evictor fires
        lines.append(f"    {p.name:<14} deviation (worst text) {pct(d.get('mean_layer_deviation', d.get('deviation'))):>7}, ΔPPL {d['ppl_delta']:+.3f}{at} -> {gate}")
    if not lines:
        return
    print(f"""  On long text they do fire. 'kvguard eval' measured the policies as written at {s['prefix']:,} +
  {s['score']:,} tokens on {len(data['texts'])} texts, or as long as their budget where said ({REPORT.relative_to(REPORT.parents[2])}):
""" + "\n".join(lines) + f"""

  Why an evictor's deviation is large: an evicted token is gone, so every later query that would
  have attended to it reads a different output, and layers whose attention spreads over the whole
  context move by tens of percent; perplexity moves much less. That is the price of keeping
  {least:,} tokens instead of all of them, not a malfunction, and it is what the fidelity gate is for:
  before a policy serves a request, kvguard measures it, and a policy over its bound is downgraded
  to its next safer step (or refused, if its file says so). The decision is itself an audit record.""")
