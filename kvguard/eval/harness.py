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
4. Compare against "none", the 16-bit cache that drops nothing, on the same
   text: perplexity change (absolute and relative), the KL divergence of the
   next-token distributions and top-1 agreement at every scored position, and
   greedy agreement (information only: one flipped token changes every later one).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..hf import cache_kwarg
from ..policy import Fidelity, Measurement
from ..types import Subject
from .headwise import HeadwiseCache
from .methods import Method
from .probe import ProbeCache
from .settings import Settings

SUBJECT = Subject("eval", "harness", "fidelity")
TOP_K = 1024  # the reference's next-token log-probabilities kept per scored position (see NextTokens)

# a configuration's gate status
PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "evictor not measured"


class NextTokens:
    """The reference's next-token distributions at the scored positions, bounded in memory: the
    TOP_K most likely tokens' ids and float32 log-probabilities per position (1,024 positions:
    8 MB, where the whole float32 distribution over 49,152 tokens would be 200 MB). The KL
    divergence against it lumps the other tokens into one outcome: exact when the reference
    puts no mass there, never above the full KL otherwise (grouping outcomes can only lower
    a KL divergence); SmolLM2 leaves 1-2 % of its mass outside its top 1,024 on average."""

    def __init__(self):
        self.ids: list[torch.Tensor] = []  # [T, K] int32 per block of positions
        self.logp: list[torch.Tensor] = []  # [T, K] float32

    def add(self, logp: torch.Tensor) -> None:
        vals, idx = logp.topk(min(TOP_K, logp.shape[-1]), dim=-1)
        self.ids.append(idx.to(torch.int32))
        self.logp.append(vals)

    def compare(self, block: int, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL(p_ref || q) per position, whether q's argmax is the reference's) for the block-th
        block of positions that `add` was given, q as log-probabilities."""
        ids, logp = self.ids[block].long(), self.logp[block]
        if logq.shape[0] != ids.shape[0]:
            raise ValueError("the reference was measured at other positions")
        logq_k = logq.gather(-1, ids)
        p = logp.exp()
        kl = (p * (logp - logq_k)).sum(-1)
        p_rest = (1 - p.sum(-1)).clamp_min(0)
        q_rest = (1 - logq_k.exp().sum(-1)).clamp_min(1e-30)
        rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), 0.0)
        return (kl + rest).clamp_min(0), logq.argmax(-1) == ids[:, 0]


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
    agreement: float = math.nan  # greedy tokens equal to "none"'s, position by position (information only)
    ppl_delta_rel: float = math.nan  # ppl_delta / "none"'s perplexity
    kl: float = math.nan  # mean over the scored positions of KL(p_none || p_this), nats
    top1: float = math.nan  # share of the scored positions whose most likely next token is "none"'s
    prefix: int = 0  # tokens written before scoring and scored (0: the report's settings)
    score: int = 0
    reference: NextTokens | None = field(default=None, repr=False, compare=False)  # kept for "none" only

    @property
    def mean_layer_deviation(self) -> float:
        return sum(self.deviation) / len(self.deviation)

    @property
    def worst_layer_deviation(self) -> float:
        return max(self.deviation)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "reference"} | {
            "mean_layer_deviation": self.mean_layer_deviation, "worst_layer_deviation": self.worst_layer_deviation}


@dataclass
class Summary:
    """One configuration over every text. The gate holds when every text is within the bound."""

    method: str
    kind: str
    key: str
    description: str
    mean_layer_deviation: float  # mean over texts of the mean over layers
    worst_layer_deviation: float  # max over texts and layers
    worst_text_deviation: float  # max over texts of the mean over layers
    deviation_per_layer: list[float]  # mean over texts
    ppl: float
    ppl_delta: float  # mean over texts
    worst_ppl_delta: float
    held_ratio: float
    read_ratio: float
    evicted: int  # tokens dropped, summed over texts
    agreement: float  # greedy, information only
    ttft_ms: float
    decode_tps: float
    ppl_delta_rel: float = math.nan  # mean over texts
    worst_ppl_delta_rel: float = math.nan
    kl: float = math.nan  # mean over texts
    worst_kl: float = math.nan
    top1: float = math.nan  # mean over texts
    status: str = FAIL  # PASS, FAIL or NOT_MEASURED
    evictor_fired: bool | None = None  # None: no evictor; False: it dropped nothing while scoring
    prefix: int = 0  # measured at other lengths than the report's settings (0: at them)
    score: int = 0
    texts: list[TextResult] = field(default_factory=list)
    retrieval: list[int] = field(default_factory=list)  # retrieval probe: 1/0 per trial, per seed each depth
    retrieval_s: float = 0.0  # the probe's wall time for this configuration

    @property
    def retrieval_text(self) -> str:
        """Keys found over trials, e.g. "14/15"; "—" where the probe did not run."""
        return f"{sum(self.retrieval)}/{len(self.retrieval)}" if self.retrieval else "—"

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def footprint(self) -> float:
        """Fraction of the 16-bit KV bytes held, or read for a read-time selector."""
        return self.held_ratio * self.read_ratio

    def span(self, attr: str) -> tuple[float, float]:
        """(min, max) over the texts of a TextResult attribute."""
        xs = [getattr(t, attr) for t in self.texts]
        return (min(xs), max(xs)) if xs else (math.nan, math.nan)  # no text: a probe-only summary

    def measurement(self) -> Measurement:
        """What the gate and policy calibration read: each number on the worst text."""
        return Measurement(self.worst_text_deviation, self.worst_ppl_delta, self.worst_layer_deviation,
                           self.worst_ppl_delta_rel, self.evictor_fired)


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
        return HeadwiseCache(model.config, SUBJECT, evictor=evictor, merge=method.merge, num_pages=pages,
                             num_hot_pages=pages, **options)
    if method.evict_prefix_only:
        options["auto_compact"] = False
    return ProbeCache(model.config, SUBJECT, sparse_pages=method.sparse_pages, num_pages=pages,
                      num_hot_pages=pages, **options)


@torch.no_grad()
def run(model, ids: torch.Tensor, text: str, method: Method, s: Settings, *,
        reference: NextTokens | None = None, keep: bool = False) -> TextResult:
    """One text through one configuration: prefix, scored continuation, greedy tokens.
    `reference`: the reference's next tokens at the same positions, for KL and top-1
    agreement; `keep`: keep this run's, to be the reference of others."""
    n, end = s.prefix, s.prefix + s.score
    cache = _cache(model, method, s, end + s.generate)
    kw = {cache_kwarg(model): cache}
    kept = NextTokens() if keep else None
    kl, top1 = [], []

    def score(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = logits.float().log_softmax(-1)
        if kept is not None:
            kept.add(logp)
        if reference is not None:
            d, same = reference.compare(len(kl), logp)
            kl.append(d)
            top1.append(same)
        return F.nll_loss(logp, targets, reduction="none")

    try:
        # (1) the prefix: time to first token
        t0 = time.perf_counter()
        last = model(ids[:, :n], logits_to_keep=1, **kw).logits[0, -1]
        ttft = time.perf_counter() - t0
        if method.evict_prefix_only and not method.per_head:
            cache.manager.compact(cache.seqs[0])
        # (2) the continuation, teacher-forced, each chunk's attention measured
        nll = [score(last[None], ids[0, n : n + 1])]
        cache.scoring = True
        for start in range(n, end - 1, s.chunk):
            stop = min(start + s.chunk, end - 1)
            logits = model(ids[:, start:stop], **kw).logits[0]
            nll.append(score(logits, ids[0, start + 1 : stop + 1]))
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
    ppl = math.exp(torch.cat(nll).mean().item())
    # the median step: robust to other processes taking the CPU for a while
    tps = 1.0 / statistics.median(steps) if steps else math.nan
    result = TextResult(method.name, method.kind, method.key, text, cache.deviation(), ppl,
                        stats.bytes_held / stats.bytes_16bit_equivalent, read, stats.tokens_evicted, tokens, ttft,
                        tps, prefix=n, score=s.score, reference=kept)
    if reference is not None:
        result.kl = torch.cat(kl).double().mean().item()
        result.top1 = torch.cat(top1).double().mean().item()
    return result


def compare(result: TextResult, reference: TextResult) -> None:
    """The numbers against the reference on the same text; KL and top-1 agreement were
    measured while `result` ran against the reference's kept next tokens (its own: 0 and 1)."""
    result.ppl_delta = result.ppl - reference.ppl
    result.ppl_delta_rel = result.ppl_delta / reference.ppl
    if result is reference:
        result.kl, result.top1 = 0.0, 1.0
    same = [a == b for a, b in zip(result.tokens, reference.tokens)]
    result.agreement = sum(same) / len(same) if same else math.nan  # --generate 0: no greedy tokens


def evictor_fired(method: Method, results: list[TextResult]) -> bool | None:
    """None when the configuration has no evictor; else whether it dropped tokens while
    scoring on every text (the read-time simulations drop nothing: whether they read less)."""
    if not method.options.get("evictor"):
        return None
    if method.per_head:
        return all(r.read_ratio < 1 for r in results)
    return all(r.evicted > 0 for r in results)


def gate(s: Summary, bound: Fidelity) -> str:
    """PASS within every bound; FAIL beyond one (an evictor that never fired cannot make a
    configuration that already fails pass); NOT_MEASURED when within the bounds but the
    evictor never fired: what was measured is the rest of the configuration, not the evictor."""
    if s.measurement().exceeded(bound):
        return FAIL
    return NOT_MEASURED if s.evictor_fired is False else PASS


def summarize(method: Method, results: list[TextResult], bound: Fidelity) -> Summary:
    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs)

    layers = len(results[0].deviation)
    s = Summary(
        method.name, method.kind, method.key, method.description,
        mean_layer_deviation=mean(r.mean_layer_deviation for r in results),
        worst_layer_deviation=max(r.worst_layer_deviation for r in results),
        worst_text_deviation=max(r.mean_layer_deviation for r in results),
        deviation_per_layer=[mean(r.deviation[i] for r in results) for i in range(layers)],
        ppl=mean(r.ppl for r in results), ppl_delta=mean(r.ppl_delta for r in results),
        worst_ppl_delta=max(r.ppl_delta for r in results),
        held_ratio=mean(r.held_ratio for r in results), read_ratio=mean(r.read_ratio for r in results),
        evicted=sum(r.evicted for r in results),
        agreement=mean(r.agreement for r in results), ttft_ms=1000 * mean(r.ttft_s for r in results),
        decode_tps=mean(r.decode_tps for r in results),
        ppl_delta_rel=mean(r.ppl_delta_rel for r in results), worst_ppl_delta_rel=max(r.ppl_delta_rel for r in results),
        kl=mean(r.kl for r in results), worst_kl=max(r.kl for r in results), top1=mean(r.top1 for r in results),
        evictor_fired=evictor_fired(method, results), texts=results)
    s.status = gate(s, bound)
    return s
