"""The fidelity protocol of docs/fidelity.md, for each text and configuration.

1. Prefix: the first `prefix` tokens are prefilled into the configured cache
   (timed: time to first token).
2. Score: the next `score` tokens are fed in chunks of `chunk` (one page by
   default, so each query sees its own page 16-bit and every older page as
   stored, as in decode), teacher-forced. Each chunk's attention output is
   compared with the output over the same K/V uncompressed (ProbeCache), and
   each next token's log-probability goes into a perplexity.
3. Generate: `generate` greedy tokens after the whole text, each decode step
   timed (decode tokens/s of the median step).
4. Compare: perplexity change and greedy agreement against "none", the 16-bit
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
from .headwise import HeadwiseCache
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
    retrieval: list[int] = field(default_factory=list)  # retrieval probe: 1/0 per trial, per seed each depth
    retrieval_s: float = 0.0  # the probe's wall time for this configuration

    @property
    def retrieval_text(self) -> str:
        """Keys found over trials, e.g. "14/15"; "—" where the probe did not run."""
        return f"{sum(self.retrieval)}/{len(self.retrieval)}" if self.retrieval else "—"

    @property
    def footprint(self) -> float:
        """Fraction of the 16-bit KV bytes held, or read for a read-time selector."""
        return self.held_ratio * self.read_ratio


def token_ids(tokenizer, text: str, n: int) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise ConfigError(f"a text has {ids.shape[1]} tokens; the protocol needs prefix + score = {n}")
    return ids


def _cache(model, method: Method, s: Settings, total: int) -> ProbeCache:
    # compaction writes the survivors into fresh pages before it frees the old ones
    pages = 2 * math.ceil(total / s.page_size) + 8
    options = {"page_size": s.page_size, "dtype": s.dtype} | method.options
    if method.per_head:  # the cache holds everything; the simulation evicts at read time
        evictor = {"name": options.pop("evictor"), **options.pop("evictor_options")}
        return HeadwiseCache(model.config, SUBJECT, evictor=evictor, num_pages=pages, num_hot_pages=pages, **options)
    if method.evict_prefix_only:
        options["auto_compact"] = False
    return ProbeCache(model.config, SUBJECT, sparse_pages=method.sparse_pages, num_pages=pages,
                      num_hot_pages=pages, **options)


@torch.no_grad()
def run(model, ids: torch.Tensor, text: str, method: Method, s: Settings) -> TextResult:
    """One text through one configuration: prefix, scored continuation, greedy tokens."""
    n, end = s.prefix, s.prefix + s.score
    cache = _cache(model, method, s, end + s.generate)
    kw = {cache_kwarg(model): cache}
    try:
        # (1) the prefix: time to first token
        t0 = time.perf_counter()
        last = model(ids[:, :n], logits_to_keep=1, **kw).logits[0, -1]
        ttft = time.perf_counter() - t0
        if method.evict_prefix_only and not method.per_head:
            cache.manager.compact(cache.seqs[0])
        # (2) the continuation, teacher-forced, each chunk's attention measured
        nll = [F.cross_entropy(last.float()[None], ids[0, n : n + 1])]
        cache.scoring = True
        for start in range(n, end - 1, s.chunk):
            stop = min(start + s.chunk, end - 1)
            logits = model(ids[:, start:stop], **kw).logits[0].float()
            nll.append(F.cross_entropy(logits, ids[0, start + 1 : stop + 1], reduction="none"))
        cache.scoring = cache.measure = False
        stats = cache.stats()
        read = sum(cache.read) / len(cache.read) if cache.read else 1.0
        # (3) greedy tokens after the whole text, each decode step timed
        tokens, steps = [], []
        logits = model(ids[:, end - 1 : end], **kw).logits[0, -1]
        for _ in range(s.generate):
            tokens.append(int(logits.argmax()))
            t1 = time.perf_counter()
            logits = model(torch.tensor([tokens[-1:]]), **kw).logits[0, -1]
            steps.append(time.perf_counter() - t1)
    finally:
        cache.free()
    ppl = math.exp(torch.cat([x.reshape(-1) for x in nll]).mean().item())
    # the median step: robust to other processes taking the CPU for a while
    tps = 1.0 / statistics.median(steps) if steps else math.nan
    return TextResult(method.name, method.kind, method.key, text, cache.deviation(), ppl,
                      stats.bytes_held / stats.bytes_16bit_equivalent, read, stats.tokens_evicted, tokens, ttft, tps)


def compare(result: TextResult, reference: TextResult) -> None:
    result.ppl_delta = result.ppl - reference.ppl
    same = [a == b for a, b in zip(result.tokens, reference.tokens)]
    result.agreement = sum(same) / len(same) if same else math.nan  # --generate 0: no greedy tokens


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
