"""The retrieval probe (pass key in a haystack): does a configuration still recall a fact from far back?

A random five-digit pass key is planted ("The pass key is 48213. Remember it. 48213 is the pass key.")
at several depths of a filler context of real text (one of the harness's texts, read at run time),
the model is asked for it at the end, in SmolLM2-Instruct's chat template with the answer begun
("The pass key is"), and a few tokens are generated greedily through the configuration's cache. A
trial succeeds when the first number in the answer is the key. Accuracy over depths x seeds; each
seed draws its own key and its own stretch of the text.

The context is fed as when serving a long prompt with chunked prefill: its first `budget` tokens in
one pass (no evictor fires below budget + one page), then `chunk` tokens at a time, so a continuous
evictor compacts between chunks whenever the sequence passes its budget by a page, and again before
the question. The `-prefix` methods (and the per-head simulations) prefill the context in one pass,
compress it once, then read the question and answer keeping every later token, as in the harness.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..hf import cache_kwarg
from .harness import _cache
from .methods import Method
from .settings import ProbeSettings, Settings

INSTRUCTION = ("There is a pass key hidden in the following text. Find it and memorize it. "
               "I will quiz you about the pass key.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key?"
ANSWER = "The pass key is"


@dataclass(frozen=True)
class Trial:
    depth: int
    seed: int
    ids: torch.Tensor  # [1, n] the prompt up to and including the answer's start
    context: int  # tokens of the prompt before the question (what the evictors act on before it)
    key: str


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def trials(tokenizer, filler: str, p: ProbeSettings) -> list[Trial]:
    """The prompts, seed by seed: for each seed (its key, its stretch of text), one per depth. The
    filler's tokens are cut at line ends where they can be, so the needle starts a sentence of its own."""
    if getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                             add_generation_prompt=True)
        before, after = head.split("\x00")
    else:  # a base model: the same words without the turns
        before, after = "", "\n"
    pre = _tokens(tokenizer, before + INSTRUCTION)
    text = _tokens(tokenizer, filler)
    out = []
    for seed in range(p.seeds):
        rng = random.Random(seed)
        key = str(rng.randint(10000, 99999))
        needle = _tokens(tokenizer, NEEDLE.format(key=key))
        post = _tokens(tokenizer, QUESTION + after + ANSWER)
        n = p.length - len(pre) - len(needle) - len(post)
        if n < 16:
            raise ConfigError(f"--probe-length {p.length} leaves no room for a haystack; give at least "
                              f"{len(pre) + len(needle) + len(post) + 16}")
        if len(text) < n:
            raise ConfigError(f"the probe's text has {len(text)} tokens; --probe-length {p.length} needs {n}")
        start = rng.randrange(0, len(text) - n + 1)
        hay = text[start:start + n]
        for depth in p.depths:
            at = round(n * depth / 100)
            if 0 < at < n:  # back to the last line end within 64 tokens, if there is one
                ends = [i + 1 for i in range(max(0, at - 64), at) if "\n" in tokenizer.decode(hay[i])]
                at = ends[-1] if ends else at
            ctx = pre + hay[:at] + needle + hay[at:]
            out.append(Trial(depth, seed, torch.tensor([ctx + post]), len(ctx), key))
    return out


def answer(tokenizer, tokens: list[int]) -> str:
    """The first number in the generated text ('' when there is none)."""
    m = re.search(r"\d+", tokenizer.decode(tokens))
    return m.group() if m else ""


@torch.no_grad()
def run_trial(model, tokenizer, trial: Trial, method: Method, s: Settings, p: ProbeSettings) -> bool:
    ids, n = trial.ids, trial.context
    cache = _cache(model, method, s, ids.shape[1] + p.answer_tokens)
    cache.measure = False  # no shadow copy: nothing is compared here
    kw = {cache_kwarg(model): cache}
    try:
        if method.evict_prefix_only:  # prefill, compress once, keep every later token
            model(ids[:, :n], logits_to_keep=1, **kw)
            if not method.per_head:
                cache.manager.compact(cache.seqs[0])
        else:
            first = min(n, s.budget)  # nothing fires below budget + a page: one pass
            model(ids[:, :first], logits_to_keep=1, **kw)
            for start in range(first, n, p.chunk):
                model(ids[:, start:min(start + p.chunk, n)], logits_to_keep=1, **kw)
        logits = model(ids[:, n:], logits_to_keep=1, **kw).logits[0, -1]
        tokens = []
        for _ in range(p.answer_tokens):
            tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([tokens[-1:]]), **kw).logits[0, -1]
    finally:
        cache.free()
    return answer(tokenizer, tokens) == trial.key


def probe(model, tokenizer, method: Method, s: Settings, prompts: list[Trial], p: ProbeSettings,
          bar=None) -> tuple[list[int], float]:
    """1/0 per trial (seed by seed, each depth in turn, as `trials` orders them) and the wall time in seconds."""
    t0 = time.perf_counter()
    hits = []
    for t in prompts:
        if bar is not None:
            bar.set_postfix_str(f"{method.name}: depth {t.depth} %, seed {t.seed}")
        hits.append(int(run_trial(model, tokenizer, t, method, s, p)))
        if bar is not None:
            bar.update()
    return hits, time.perf_counter() - t0


def methods_for(summaries, available: dict[str, Method], policies=()) -> dict[str, Method]:
    """The configuration behind each measured row: a built-in method by name, a policy's step k by
    "policy~k" (policy_method's names)."""
    from .methods import policy_method

    by_name = dict(available)
    for pol in policies:
        for step in range(len(pol.steps())):
            m = policy_method(pol, step)
            by_name[m.name] = m
    unknown = [s.method for s in summaries if s.method not in by_name]
    if unknown:
        raise ConfigError(f"the probe does not know the configuration of {unknown}: give the --policies folder "
                          "the report was measured with, and --budget/--page-size as it was")
    return {s.method: by_name[s.method] for s in summaries}


def add_retrieval(report, model, tokenizer, filler: str, methods: dict[str, Method], p: ProbeSettings,
                  progress: bool = True, only: set[str] | None = None) -> None:
    """Run the probe for every row of `report` (`methods`: each row's configuration), or for the rows
    named in `only` (the others keep what an earlier probe with the same settings found), once per
    configuration that actually runs at the probe's length (an evictor that never fires there is its
    codec), and put it into the report."""
    from dataclasses import replace

    from tqdm.auto import tqdm

    s = report.settings
    todo = [row for row in report.summaries if only is None or row.method in only]
    kept = [row for row in report.summaries if row not in todo and row.retrieval]
    if kept and s.probe != p:
        raise ConfigError(f"the report's rows were probed with other settings ({s.probe.describe()}); probe "
                          "every row again, or give the same --probe-* settings")
    prompts = trials(tokenizer, filler, p)
    context = min(t.context for t in prompts)
    effective = {}
    for row in report.summaries:
        m = methods[row.method]
        page = m.options.get("page_size", s.page_size)
        effective[row.method] = (m.effective_key(context, p.length + p.answer_tokens, page), page)
    done: dict[tuple[str, int], tuple[list[int], float]] = {effective[r.method]: (r.retrieval, r.retrieval_s)
                                                            for r in kept}
    bar = tqdm(total=len({effective[r.method] for r in todo} - set(done)) * len(prompts),
               desc="kvguard eval: retrieval", unit="trial", disable=not progress)
    try:
        for row in todo:
            e = effective[row.method]
            if e not in done:
                done[e] = probe(model, tokenizer, methods[row.method], s, prompts, p, bar)
            row.retrieval, row.retrieval_s = done[e]
    finally:
        bar.close()
    report.settings = replace(s, probe=p)


def depth_table(report) -> tuple[list[str], list[list[str]]]:
    """Keys found per depth (over the seeds) and in all, with the probe's wall time, per configuration."""
    p = report.settings.probe
    head = ["method", *(f"depth {d} %" for d in p.depths), "retrieval", "probe s"]
    rows = []
    for row in report.summaries:
        if not row.retrieval:
            continue
        per = [row.retrieval[i::len(p.depths)] for i in range(len(p.depths))]  # trials go seed by seed
        rows.append([row.method, *(f"{sum(x)}/{len(x)}" for x in per), row.retrieval_text, f"{row.retrieval_s:.0f}"])
    return head, rows
