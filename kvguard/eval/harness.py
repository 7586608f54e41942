"""The fidelity protocol of docs/fidelity.md, for each text and configuration.

1. Score: the first `prefix` tokens are prefilled into the configured cache;
   the next `score` tokens are fed in chunks of `chunk`, teacher-forced. Each
   scored chunk's attention output is compared with the output over the same
   K/V uncompressed (ProbeCache), and each next token's log-probability summed
   into a perplexity.
2. Generate: the prefix again into a fresh cache, then `generate` greedy tokens:
   time to first token, decode tokens per second, and the tokens themselves.
3. Compare: perplexity change and greedy agreement against "none", the 16-bit
   cache that drops nothing, on the same text.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..hf import cache_kwarg
from ..types import Subject
from .methods import Method
from .probe import ProbeCache
from .settings import Settings

SUBJECT = Subject("eval", "harness", "fidelity")


@dataclass
class TextResult:
    method: str
    kind: str
    key: str
    text: str
    deviation: list[float]  # per layer
    ppl: float
    held_ratio: float  # bytes held / 16-bit bytes of every token seen, at the end of scoring
    read_ratio: float  # keys read / keys visible (< 1 for sparse only)
    evicted: int  # tokens the evictor dropped while scoring (0: the evictor never fired)
    tokens: list[int]  # greedy
    ttft_s: float
    decode_tps: float
    ppl_delta: float = math.nan  # against "none" on the same text
    agreement: float = math.nan  # greedy tokens equal to "none"'s, position by position

    @property
    def mean_deviation(self) -> float:
        return sum(self.deviation) / len(self.deviation)

    def as_dict(self) -> dict:
        return asdict(self) | {"mean_deviation": self.mean_deviation}


@dataclass
class Summary:
    """One configuration over every text. The gate holds when every text is within the bound."""

    method: str
    kind: str
    key: str
    description: str
    deviation: float  # mean over texts of the mean over layers
    worst_layer: float  # max over texts and layers
    worst_text_deviation: float
    deviation_per_layer: list[float]  # mean over texts
    ppl: float
    ppl_delta: float  # mean over texts
    worst_ppl_delta: float
    held_ratio: float
    read_ratio: float
    evicted: int  # tokens dropped, summed over texts
    agreement: float
    ttft_ms: float
    decode_tps: float
    passed: bool = False
    texts: list[TextResult] = field(default_factory=list)


def token_ids(tokenizer, text: str, n: int) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise ConfigError(f"a text has {ids.shape[1]} tokens; the protocol needs prefix + score = {n}")
    return ids


def _cache(model, method: Method, s: Settings, total: int, measure: bool) -> ProbeCache:
    pages = math.ceil(total / s.page_size) + 8
    options = {"page_size": s.page_size, "dtype": s.dtype} | method.options
    return ProbeCache(model.config, SUBJECT, sparse_pages=method.sparse_pages, measure=measure, num_pages=pages,
                      num_hot_pages=pages, **options)


@torch.no_grad()
def score(model, ids: torch.Tensor, method: Method, s: Settings) -> tuple[list[float], float, float, float, int]:
    """(deviation per layer, perplexity, held ratio, read ratio, tokens evicted) of one text."""
    n, end = s.prefix, s.prefix + s.score
    cache = _cache(model, method, s, end, measure=True)
    try:
        kw = cache_kwarg(model)
        last = model(ids[:, :n], logits_to_keep=1, **{kw: cache}).logits[0, -1]
        nll = [F.cross_entropy(last.float()[None], ids[0, n : n + 1])]
        cache.scoring = True
        for start in range(n, end - 1, s.chunk):
            stop = min(start + s.chunk, end - 1)
            logits = model(ids[:, start:stop], **{kw: cache}).logits[0].float()
            nll.append(F.cross_entropy(logits, ids[0, start + 1 : stop + 1], reduction="none"))
        stats = cache.stats()
        read = sum(cache.read) / len(cache.read) if cache.read else 1.0
        ppl = math.exp(torch.cat([x.reshape(-1) for x in nll]).mean().item())
        return cache.deviation(), ppl, stats.bytes_held / stats.bytes_16bit_equivalent, read, stats.tokens_evicted
    finally:
        cache.free()


@torch.no_grad()
def generate(model, ids: torch.Tensor, method: Method, s: Settings) -> tuple[list[int], float, float]:
    """(greedy tokens, time to first token s, decode tokens/s of the median step) after the prefix."""
    cache = _cache(model, method, s, s.prefix + s.generate, measure=False)
    try:
        kw = cache_kwarg(model)
        t0 = time.perf_counter()
        logits = model(ids[:, : s.prefix], logits_to_keep=1, **{kw: cache}).logits[0, -1]
        tokens = [int(logits.argmax())]
        ttft, steps = time.perf_counter() - t0, []
        for _ in range(s.generate - 1):
            t1 = time.perf_counter()
            logits = model(torch.tensor([[tokens[-1]]]), **{kw: cache}).logits[0, -1]
            tokens.append(int(logits.argmax()))
            steps.append(time.perf_counter() - t1)
        # the median step: robust to other processes taking the CPU for a while
        return tokens, ttft, 1.0 / statistics.median(steps) if steps else math.nan
    finally:
        cache.free()


def run(model, ids: torch.Tensor, text: str, method: Method, s: Settings) -> TextResult:
    dev, ppl, held, read, evicted = score(model, ids, method, s)
    tokens, ttft, tps = generate(model, ids, method, s)
    return TextResult(method.name, method.kind, method.key, text, dev, ppl, held, read, evicted, tokens, ttft, tps)


def compare(result: TextResult, reference: TextResult) -> None:
    result.ppl_delta = result.ppl - reference.ppl
    same = [a == b for a, b in zip(result.tokens, reference.tokens)]
    result.agreement = sum(same) / len(same)


def summarize(method: Method, results: list[TextResult], bound_dev: float, bound_ppl: float) -> Summary:
    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs)

    layers = len(results[0].deviation)
    s = Summary(
        method.name, method.kind, method.key, method.description,
        deviation=mean(r.mean_deviation for r in results),
        worst_layer=max(max(r.deviation) for r in results),
        worst_text_deviation=max(r.mean_deviation for r in results),
        deviation_per_layer=[mean(r.deviation[i] for r in results) for i in range(layers)],
        ppl=mean(r.ppl for r in results), ppl_delta=mean(r.ppl_delta for r in results),
        worst_ppl_delta=max(r.ppl_delta for r in results),
        held_ratio=mean(r.held_ratio for r in results), read_ratio=mean(r.read_ratio for r in results),
        evicted=sum(r.evicted for r in results),
        agreement=mean(r.agreement for r in results), ttft_ms=1000 * mean(r.ttft_s for r in results),
        decode_tps=mean(r.decode_tps for r in results), texts=results)
    s.passed = s.worst_text_deviation < bound_dev and s.worst_ppl_delta < bound_ppl
    return s
