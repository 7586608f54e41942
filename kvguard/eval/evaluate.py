"""`evaluate`: every configuration on every text, then the policies' calibration."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from ..policy import Fidelity, Measurement, Policy, PolicyDecision, calibrate
from .harness import Summary, TextResult, compare, run, summarize, token_ids
from .methods import Method, policy_method
from .settings import Settings

REFERENCE = "none"


@dataclass
class Report:
    model: str
    settings: Settings
    texts: dict[str, int]  # name -> characters
    summaries: list[Summary]
    decisions: list[PolicyDecision] = field(default_factory=list)
    bound: Fidelity = field(default_factory=Fidelity)
    environment: dict = field(default_factory=dict)

    def by_method(self) -> dict[str, Summary]:
        return {s.method: s for s in self.summaries}


def environment() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "device": "cpu (reference attention path, no kernels)"}


def evaluate(model, tokenizer, texts: dict[str, str], methods: list[Method], settings: Settings | None = None,
             policies: list[Policy] = (), *, bound: Fidelity | None = None, model_name: str = "",
             progress: bool = True) -> Report:
    """Measure each method (and each policy, with its downgrade steps as calibration
    needs them) on each text. "none" is always measured first: it is the reference."""
    s = settings or Settings()
    bound = bound or Fidelity()
    ids = {name: token_ids(tokenizer, text, s.prefix + s.score) for name, text in texts.items()}
    todo = [m for m in methods if m.name != REFERENCE]
    reference = Method(REFERENCE, "baseline", {"codec": "fp16"}, description="16-bit pages, nothing dropped")
    plan = [reference, *todo, *(policy_method(p) for p in policies)]
    bar = tqdm(total=len(plan) * len(ids), desc="kvguard eval", unit="run", disable=not progress)
    refs: dict[str, TextResult] = {}
    summaries: dict[str, Summary] = {}

    # (effective configuration, page size) -> the method measured for it; the key does not name the page
    # size, which a policy sets for itself
    measured_as: dict[tuple[str, int], str] = {}

    def measure(method: Method) -> Summary:
        if method.name in summaries:
            return summaries[method.name]
        page_size = method.options.get("page_size", s.page_size)
        effective = method.effective_key(s.prefix, s.prefix + s.score + s.generate, page_size)
        if (effective, page_size) in measured_as:  # the same computation under another name: measured once
            bar.update(len(ids))
            same = summaries[measured_as[effective, page_size]]
            why = "" if effective == method.key else "; its evictor never fires at this length"
            summaries[method.name] = replace(same, method=method.name, kind=method.kind, key=method.key,
                                             description=f"{method.description} (measured as {same.method}{why})")
            return summaries[method.name]
        results = []
        for name, x in ids.items():
            bar.set_postfix_str(f"{method.name} on {name}")
            r = run(model, x, name, method, s)
            if method.name == REFERENCE:
                refs[name] = r
            compare(r, refs[name])
            results.append(r)
            bar.update()
        summaries[method.name] = summarize(method, results, bound.max_attention_deviation, bound.max_ppl_increase)
        measured_as[effective, page_size] = method.name
        return summaries[method.name]

    for m in plan[: len(plan) - len(policies)]:
        measure(m)
    decisions = []
    for p in policies:
        def by_step(layers, policy=p):
            step = [st.key for st in policy.steps()].index(layers.key)
            if step > 0:
                bar.total += len(ids)
            got = measure(policy_method(policy, step))
            return Measurement(got.worst_text_deviation, got.worst_ppl_delta)

        decisions.append(calibrate(p, by_step))
    bar.close()
    return Report(model_name, s, {k: len(v) for k, v in texts.items()}, list(summaries.values()), decisions, bound,
                  environment())
