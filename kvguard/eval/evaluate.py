"""`evaluate`: every configuration on every text, then the policies' calibration."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..policy import Fidelity, Policy, PolicyDecision, calibrate
from .harness import Summary, TextResult, compare, evictor_fired, gate, run, summarize, token_ids
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
             progress: bool = True, fire_evictors: bool = False) -> Report:
    """Measure each method (and each policy, with its downgrade steps as calibration
    needs them) on each text. "none" is always measured first: it is the reference.

    `fire_evictors`: a configuration whose evictor would not fire at the settings' length
    is measured with a longer prefix (Method.firing_prefix), against a reference at that
    length, where the model's context holds it; otherwise it is reported as
    "evictor not measured"."""
    s = settings or Settings()
    bound = bound or Fidelity()
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    ids: dict[tuple[str, int], object] = {}  # (text, tokens) -> token ids

    def tokens(name: str, n: int):
        if (name, n) not in ids:
            ids[name, n] = token_ids(tokenizer, texts[name], n)
        return ids[name, n]

    for name in texts:
        tokens(name, s.prefix + s.score)
    todo = [m for m in methods if m.name != REFERENCE]
    reference = Method(REFERENCE, "baseline", {"codec": "fp16"}, description="16-bit pages, nothing dropped")
    plan = [reference, *todo, *(policy_method(p) for p in policies)]
    bar = tqdm(total=len(plan) * len(texts), desc="kvguard eval", unit="run", disable=not progress)
    refs: dict[tuple[str, int, int], TextResult] = {}  # (text, prefix, score) -> the reference's run
    summaries: dict[str, Summary] = {}

    # (effective configuration, page size, prefix) -> the method measured for it; the key does not
    # name the page size, which a policy sets for itself
    measured_as: dict[tuple[str, int, int], str] = {}

    def reference_run(name: str, at: Settings) -> TextResult:
        if (name, at.prefix, at.score) not in refs:
            bar.set_postfix_str(f"{REFERENCE} on {name} at {at.prefix}+{at.score}")
            r = run(model, tokens(name, at.prefix + at.score), name, reference, at, keep=True)
            compare(r, r)
            refs[name, at.prefix, at.score] = r
        return refs[name, at.prefix, at.score]

    def length(method: Method, page_size: int) -> tuple[Settings, str]:
        """The settings to measure a method at, and why they differ from the report's."""
        if not fire_evictors:
            return s, ""
        prefix = method.firing_prefix(s.prefix, s.score, page_size)
        if prefix == s.prefix:
            return s, ""
        need = prefix + s.score + s.generate
        if limit is not None and need > limit:
            return s, f"; its evictor needs {need:,} tokens to fire, beyond the model's {limit:,}"
        try:
            for name in texts:
                tokens(name, prefix + s.score)
        except ConfigError as e:
            return s, f"; not measured at {prefix:,}+{s.score:,} tokens: {e}"
        return replace(s, prefix=prefix), f"; measured at {prefix:,}+{s.score:,} tokens so that its evictor fires"

    def measure(method: Method) -> Summary:
        if method.name in summaries:
            return summaries[method.name]
        page_size = method.options.get("page_size", s.page_size)
        at, why = length(method, page_size)
        own = method.fidelity or bound
        effective = method.effective_key(at.prefix, at.prefix + at.score + at.generate, page_size)
        if (effective, page_size, at.prefix) in measured_as:  # the same computation under another name: once
            bar.update(len(texts))
            same = summaries[measured_as[effective, page_size, at.prefix]]
            if effective != method.key:
                why += "; its evictor never fires at this length"
            got = replace(same, method=method.name, kind=method.kind, key=method.key,
                          description=f"{method.description} (measured as {same.method}{why})",
                          evictor_fired=evictor_fired(method, same.texts))
            got.status = gate(got, own)
            summaries[method.name] = got
            return got
        results = []
        for name in texts:
            ref = reference_run(name, at)
            if method.name == REFERENCE:
                r = ref
            else:
                bar.set_postfix_str(f"{method.name} on {name}")
                r = run(model, tokens(name, at.prefix + at.score), name, method, at, reference=ref.reference)
                compare(r, ref)
            results.append(r)
            bar.update()
        got = summarize(replace(method, description=method.description + why), results, own)
        if at != s:
            got.prefix, got.score = at.prefix, at.score
        summaries[method.name] = got
        measured_as[effective, page_size, at.prefix] = method.name
        return got

    for m in plan[: len(plan) - len(policies)]:
        measure(m)
    decisions = []
    for p in policies:
        def by_step(layers, policy=p):
            step = [st.key for st in policy.steps()].index(layers.key)
            if step > 0:
                bar.total += len(texts)
            return measure(policy_method(policy, step)).measurement()

        decisions.append(calibrate(p, by_step))
    bar.close()
    for r in refs.values():
        r.reference = None  # the next tokens were for comparing; the report does not carry them
    return Report(model_name, s, {k: len(v) for k, v in texts.items()}, list(summaries.values()), decisions, bound,
                  environment())
