"""The configurations the harness measures: built-in methods and policies.

A method is a set of CacheConfig options, plus, for "sparse", a read-time page
budget. The eviction methods and "sparse" share one token budget, so they are
compared at equal memory (evictors) or equal reads (sparse).

Evictors run in one of two ways. "continuous" is how the cache serves: it
compacts whenever a sequence passes its budget by a page, so the whole context,
scored tokens included, lives within the budget. "prefix" (the `-prefix`
methods) compresses the prefix once, after prefill, and then keeps every new
token: the protocol of SnapKV and of the seeds' table. H2O and SnapKV keep a
set of tokens per layer and KV head, as published; the `-shared` methods keep
one set for all layers and heads (what kvguard did first), and the
`-head-prefix` methods simulate per-head selection at read time (headwise.py),
a cross-check of the cache's own per-head compaction.

The budget methods (docs/fidelity.md, "Budgets") change how H2O and SnapKV
spend the same total: `-value` scores by mass × the value's norm (the cache
stores this: `-value` compacts whenever past the budget, `-value-prefix` the
prefix once); `-pyramid-`, `-adaptive-`, `-pyramid-adaptive-` and `-global-` give layers
and heads unequal shares, which the cache cannot store (a page holds every
layer and head), so they are read-time simulations of the prefix protocol, as
`-head-prefix` is (kind "simulation"). They run when named in --methods, not
by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..policy import Fidelity, Policy, config_key


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "baseline" | "codec" | "evictor" | "simulation" | "sparse" | "split" | "policy"
    options: dict = field(default_factory=dict)  # CacheConfig fields
    sparse_pages: int | None = None  # Quest-style: attend only the top-k pages of each query
    evict_prefix_only: bool = False  # compress the prefix once, keep every later token
    per_head: bool = False  # simulate the evictor per (layer, KV head) at read time (headwise.py)
    merge: bool = False  # with per_head: evicted tokens' values merged into kept ones (headwise.merge_values)
    description: str = ""
    fidelity: Fidelity | None = None  # its own bound (a policy's); None: the report's
    default: bool = True  # measured when --methods names none

    @property
    def key(self) -> str:
        """What the configuration is, whatever it is called (see kvguard.policy.config_key)."""
        return (config_key(self.options) + ("/prefix" if self.evict_prefix_only else "")
                + ("/per-head" if self.per_head else "") + ("/merge" if self.merge else "")
                + (f"+sparse@{self.sparse_pages}p" if self.sparse_pages else ""))

    def effective_key(self, prefix: int, total: int, page_size: int = 16) -> str:
        """The key of what actually runs: an evictor whose budget is never passed
        (continuous compaction needs budget + one page; `page_size` unless the method
        sets its own) is no evictor at all."""
        o = self.options
        if o.get("evictor"):
            budget = o["evictor_options"]["budget"]
            fires = budget < prefix if self.evict_prefix_only else budget + o.get("page_size", page_size) <= total
            if not fires:
                plain = {k: v for k, v in o.items() if k not in ("evictor", "evictor_options")}
                return replace(self, options=plain, evict_prefix_only=False).key
        return self.key

    def firing_prefix(self, prefix: int, score: int, page_size: int = 16) -> int:
        """The prefix at which the evictor fires while scoring `score` tokens: `prefix` when it
        already does, else its budget (continuous compaction then fires one page into the
        scored tokens and every page after) or, for a prefix-only evictor, budget + one page."""
        o = self.options
        if not o.get("evictor"):
            return prefix
        budget, page = o["evictor_options"]["budget"], o.get("page_size", page_size)
        if self.evict_prefix_only:
            return max(prefix, budget + page)
        return prefix if budget + page <= prefix + score - 1 else max(prefix, budget)


SPLIT_FRACTIONS = (5, 10, 25, 50)  # kvsplit@F: the top F % of the cold pages fetched
SPLIT_WINDOW = 128  # tokens whose values stay on the device


def builtin_methods(budget: int = 256, page_size: int = 16) -> dict[str, Method]:
    """none, int8, int8-window, int4, fp8, h2o, streamingllm, snapkv (each also -prefix),
    h2o-shared, snapkv-shared (each also -prefix), h2o-head-prefix, snapkv-head-prefix, sparse,
    kvsplit@5, kvsplit@10, kvsplit@25, kvsplit@50 (and, only when named, kvsplit-all@ the same).
    `budget`: tokens kept by each evictor, and read by sparse (budget // page_size pages)."""
    half = budget // 2
    evictors = {
        "h2o": ({"budget": budget, "sink": 4, "window": half},
                f"H2O: 4 sinks + heavy hitters + {half} recent (the paper's half/half), {budget} tokens"),
        "streamingllm": ({"budget": budget, "sink": 4, "window": budget - 4},
                         f"StreamingLLM: 4 sinks + the most recent tokens, {budget} tokens"),
        "snapkv": ({"budget": budget, "sink": 4, "window": min(32, half), "observe": 32},
                   f"SnapKV: 4 sinks + the observation window (32 queries) + keys they vote for "
                   f"(max-pooled over 7), {budget} tokens"),
    }
    methods = [
        Method("none", "baseline", {"codec": "fp16"}, description="16-bit pages, nothing dropped"),
        Method("int8", "codec", {"codec": "int8", "fp_sink": 4},
               description="INT8, keys per channel over a page, values per token; 16-bit sink page"),
        Method("int8-window", "codec", {"codec": "int8", "fp_sink": 4, "fp_window": 128},
               description="INT8 as above, the 128 most recent tokens 16-bit"),
        Method("int4", "codec", {"codec": "int4", "fp_sink": 4, "fp_window": 128},
               description="INT4 KIVI-style (value groups of 32); 16-bit sink page and 128-token window"),
        Method("fp8", "codec", {"codec": "fp8", "fp_sink": 4},
               description="FP8 e4m3 in INT8's layout; 16-bit sink page"),
    ]
    # the same codecs storing each head's K and V rotated (kvguard/compress/codecs/rotation.py), and
    # the INT4 variants that trade bytes for error: value groups of 64, a 512-token 16-bit window
    rot = {"codec_options": {"rotate": True}}
    methods += [
        Method("int8-rot", "codec", {"codec": "int8", "fp_sink": 4, **rot},
               description="INT8, stored Hadamard-rotated; 16-bit sink page"),
        Method("int8-window-rot", "codec", {"codec": "int8", "fp_sink": 4, "fp_window": 128, **rot},
               description="INT8 rotated, 16-bit sink page and 128-token window"),
        Method("fp8-rot", "codec", {"codec": "fp8", "fp_sink": 4, **rot},
               description="FP8 e4m3, stored Hadamard-rotated; 16-bit sink page"),
        Method("int4-rot", "codec", {"codec": "int4", "fp_sink": 4, "fp_window": 128, **rot},
               description="INT4 as int4, stored Hadamard-rotated"),
        Method("int4-rot-g64", "codec", {"codec": "int4", "fp_sink": 4, "fp_window": 128,
                                         "codec_options": {"rotate": True, "group": 64}},
               description="INT4 rotated, value groups of 64 (fewer scale bytes; reference path only)"),
        Method("int4-rot-w512", "codec", {"codec": "int4", "fp_sink": 4, "fp_window": 512, **rot},
               description="INT4 rotated, a 512-token 16-bit window"),
    ]
    for name, (options, text) in evictors.items():
        methods.append(Method(name, "evictor", {"evictor": name, "evictor_options": options},
                              description=f"{text}; compacts whenever past the budget"))
    for name, (options, text) in evictors.items():
        methods.append(Method(f"{name}-prefix", "evictor", {"evictor": name, "evictor_options": options},
                              evict_prefix_only=True, description=f"{text}; the prefix only, once"))
    for name in ("h2o", "snapkv"):
        options, text = evictors[name]
        shared = {**options, "per_head": False}
        methods.append(Method(f"{name}-shared", "evictor", {"evictor": name, "evictor_options": shared},
                              description=f"{text}, one keep set for all layers and heads; compacts "
                                          "whenever past the budget"))
        methods.append(Method(f"{name}-shared-prefix", "evictor", {"evictor": name, "evictor_options": shared},
                              evict_prefix_only=True,
                              description=f"{text}, one keep set for all layers and heads; the prefix only, once"))
    for name in ("h2o", "snapkv"):
        options, text = evictors[name]
        methods.append(Method(f"{name}-head-prefix", "simulation", {"evictor": name, "evictor_options": options},
                              evict_prefix_only=True, per_head=True,
                              description=f"{text}; the prefix once, each layer's KV head keeping its own "
                                          "tokens (read-time simulation of the above: frees nothing)"))
    methods += _budget_methods(evictors)
    methods.append(Method("sparse", "sparse", {"codec": "fp16"}, sparse_pages=max(1, budget // page_size),
                          description=f"Quest-style: each query reads its top {budget // page_size} pages "
                                      "by a key bound"))
    for pct in SPLIT_FRACTIONS:
        split = {"window": SPLIT_WINDOW, "fraction": pct / 100}
        text = (f"K/V split: values older than {SPLIT_WINDOW} tokens in CPU memory; each query reads the {pct} % "
                "of those pages with the most of its attention (exact scores)")
        methods.append(Method(f"kvsplit@{pct}", "split", {"codec": "fp16", "kv_split": split},
                              description=f"{text}; its softmax over what it read"))
        methods.append(Method(f"kvsplit-all@{pct}", "split",
                              {"codec": "fp16", "kv_split": split | {"normalize": "all"}}, default=False,
                              description=f"{text}; the pages not read keep their weight in the softmax"))
        for rerank in (None, 4, 8):  # Quest's bound alone; the bound's top R x k, then exact scores among them
            name = f"kvsplit-bound{f'-r{rerank}' if rerank else ''}@{pct}"
            text = (f"then the {pct} % of largest exact share among the {rerank} x as many of largest bound" if rerank
                    else "the pages picked by Quest's bound of their logits instead of exact scores")
            bound = {"score": "bound"} | ({"rerank": rerank} if rerank else {})
            methods.append(Method(name, "split", {"codec": "fp16", "kv_split": split | bound}, default=False,
                                  description=f"K/V split as kvsplit@{pct}, {text}"))
    for pct in SPLIT_FRACTIONS + (100,):  # INT8 pages (as `int8`, or `int8-rot`), the split's keys INT8 or INT4
        # (a longer context on a device); at 100 % every value is read: what the INT4 keys alone cost
        # (h: INT4 keys on the device pick, the INT8 keys kept in host memory attend)
        for keys, name, rotate in ((None, "int8+kvsplit", False), ("int4", "int8+kvsplit4", False),
                                   ("int4", "int8-rot+kvsplit4", True), ("int4", "int8+kvsplit4h", False),
                                   ("int4", "int8-rot+kvsplit4h", True)):
            host = name.endswith("h")
            split = {"window": SPLIT_WINDOW, "fraction": pct / 100} | ({"keys": keys} if keys else {}) \
                | ({"host_keys": True} if host else {})
            methods.append(Method(f"{name}@{pct}", "split", {"codec": "int8", "fp_sink": 4, "kv_split": split}
                                  | ({"codec_options": {"rotate": True}} if rotate else {}), default=False,
                                  description=f"INT8{' rotated' if rotate else ''}, 16-bit sink page; K/V split as "
                                              f"kvsplit@{pct}, the split pages' keys in {(keys or 'int8').upper()}"
                                              + (" on the device, INT8 in host memory for the pages read" if host
                                                 else "")))
    return {m.name: m for m in methods}


ALLOCATION_TEXT = {
    "pyramid": "layers' budgets falling linearly with depth (PyramidKV, beta 20)",
    "adaptive": "each layer's budget split over its KV heads by their joint top scores (Ada-KV, safeguard 0.2)",
    "pyramid-adaptive": "the pyramid's layer budgets, each split over the KV heads as Ada-KV does",
    "global": "the whole model's budget split over every layer and KV head by their joint top scores "
              "(Ada-KV's selection across layers too, safeguard 0.2)",
}


def _budget_methods(evictors: dict) -> list[Method]:
    """h2o/snapkv -value, -value-prefix (the cache), and -{allocation}[-value]-prefix (simulated)."""
    value_text = "scored by attention mass × the value's L1 norm (VATP)"
    out = []
    for name in ("h2o", "snapkv"):
        options, text = evictors[name]
        valued = {**options, "scoring": "value_aware"}
        out.append(Method(f"{name}-value", "evictor", {"evictor": name, "evictor_options": valued}, default=False,
                          description=f"{text}, {value_text}; compacts whenever past the budget"))
        out.append(Method(f"{name}-value-prefix", "evictor", {"evictor": name, "evictor_options": valued},
                          evict_prefix_only=True, default=False,
                          description=f"{text}, {value_text}; the prefix only, once"))
        paged = {**options, "granularity": "page"}
        out.append(Method(f"{name}-pages", "evictor", {"evictor": name, "evictor_options": paged}, default=False,
                          description=f"{text}, each head's whole pages dropped first (no requantization); "
                                      "compacts whenever past the budget"))
        for scoring, suffix, extra in (("mass", "", ""), ("value_aware", "-value", f", {value_text}")):
            out.append(Method(f"{name}{suffix}-merge-prefix", "simulation",
                              {"evictor": name, "evictor_options": {**options, "scoring": scoring}},
                              evict_prefix_only=True, per_head=True, merge=True, default=False,
                              description=f"{text}{extra}; each evicted token's value merged into the kept token "
                                          "with the most similar key, by mass (D2O/CaM's idea); the prefix only, "
                                          "once (read-time simulation)"))
        for allocation, how in ALLOCATION_TEXT.items():
            for scoring, suffix, extra in (("mass", "", ""), ("value_aware", "-value", f", {value_text}")):
                o = {**options, "allocation": allocation, "scoring": scoring}
                out.append(Method(f"{name}-{allocation}{suffix}-prefix", "simulation",
                                  {"evictor": name, "evictor_options": o}, evict_prefix_only=True, per_head=True,
                                  default=False,
                                  description=f"{text} on average: {how}{extra}; the prefix only, once "
                                              "(read-time simulation: the cache stores equal budgets only)"))
    return out


def policy_method(policy: Policy, step: int = 0) -> Method:
    p = policy.at(step)
    name = policy.name if step == 0 else f"{policy.name}~{step}"
    return Method(name, "policy", p.cache_options(), description=f"policy {policy.name}, step {step}: "
                  f"{p.steps()[0].key}", fidelity=policy.fidelity)


def select(names: list[str], available: dict[str, Method]) -> list[Method]:
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {sorted(available)}")
    return [available[n] for n in names]
