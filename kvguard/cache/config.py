"""The cache's configuration: a small dataclass for the hot path."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

import torch

from ..errors import ConfigError

NORMALIZE = ("read", "all")  # KVSplit.normalize
SPLIT_KEYS = (None, "int8", "fp8", "int4")  # KVSplit.keys
SPLIT_SCORES = ("exact", "bound")  # KVSplit.score


@dataclass(frozen=True)
class KVSplit:
    """The K/V split tier (split.py): values of full pages older than the last `window` tokens
    live in CPU memory; each read fetches the values of the cold pages its attention mass picks:
    the `top_k` pages, a `fraction` of the cold pages (rounded up), every page whose mass
    reaches `mass`, or the fewest pages that hold `coverage` of every query head's attention
    (the pages of least mass skipped while their masses sum to at most 1 - coverage: a bound
    on the attention left unread that does not grow with the context, as `mass`'s does); `mass`
    or `coverage` with `top_k` or `fraction`: those pages, at most that many (those of largest
    mass), so a step's reads are bounded; each query picks its own. `normalize`: the softmax of what
    a query reads, "read" (over the keys whose values it read: the pages not read drop out) or
    "all" (over every key: the pages not read keep their weight and add no value, which pulls
    the output towards zero by the mass skipped). `capacity`: how many pages the split's pool
    holds (their keys on the device, their values in host memory); default as many as the
    codec's pool. `keys`: the codec of the split pages' keys (int8, fp8 or int4; default the
    cache's): in a smaller one the device holds a longer context, keys encoded again as a page
    moves in (kvguard/compress/codecs/mixed.py). `score`: what ranks the pages, "exact" (the
    share of each query head's softmax in the page) or "bound" (Quest's upper bound of the
    page's logits from each channel's least and largest key, softmaxed over the cold pages; top_k
    or fraction only); `rerank` R with "bound": the R x k pages of largest bound, then the k of
    them with the largest exact share among them (kvguard/cache/picks.py). "bound" is measured on
    the reference path only: no kernel ranks pages by bound, so it is refused with kernels.
    `slots`: on the kernel path, device page slots a layer that keep the pages read last, so a
    page picked again is not read over the bus again (kvguard/cache/hot.py); at least twice the
    pages a step's rows pick, or the step reads in place. `host_keys` (with `keys` a smaller
    codec than the cache's, and `normalize: read`): a second copy of the split pages' keys, in the
    cache's codec, lives in host memory beside their values; the device's smaller keys then only
    pick the pages, and a query attends over the pages it read with the cache's keys, fetched with
    the values: the longer context of the smaller keys at the error of the cache's, for twice
    the bytes over the bus a page read."""

    window: int = 256
    top_k: int | None = None
    fraction: float | None = None
    mass: float | None = None
    coverage: float | None = None
    capacity: int | None = None
    normalize: str = "read"
    keys: str | None = None
    score: str = "exact"
    rerank: int | None = None
    slots: int | None = None
    host_keys: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ConfigError(f"kv_split window must be an integer >= 0, got {self.window!r}")
        given = [n for n in ("top_k", "fraction", "mass", "coverage") if getattr(self, n) is not None]
        if not given or (self.top_k is not None and self.fraction is not None) or (
                self.mass is not None and self.coverage is not None):
            raise ConfigError(f"kv_split takes one of top_k, fraction, mass and coverage, or mass or coverage with "
                              f"top_k or fraction as its cap; got {given or 'none'}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            raise ConfigError(f"kv_split top_k must be a positive integer, got {self.top_k!r}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ConfigError(f"kv_split fraction must be in (0, 1], got {self.fraction!r}")
        if self.mass is not None and not 0 < self.mass < 1:
            raise ConfigError(f"kv_split mass must be in (0, 1), got {self.mass!r}")
        if self.coverage is not None and (isinstance(self.coverage, bool) or not 0 < self.coverage < 1):
            raise ConfigError(f"kv_split coverage must be in (0, 1), got {self.coverage!r}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or isinstance(self.capacity, bool)
                                          or self.capacity < 1):
            raise ConfigError(f"kv_split capacity must be a positive integer, got {self.capacity!r}")
        if self.normalize not in NORMALIZE:
            raise ConfigError(f"kv_split normalize must be one of {', '.join(NORMALIZE)}, got {self.normalize!r}")
        if self.keys not in SPLIT_KEYS:
            raise ConfigError(f"kv_split keys must be one of {', '.join(k for k in SPLIT_KEYS if k)} or absent, "
                              f"got {self.keys!r}")
        if self.score not in SPLIT_SCORES:
            raise ConfigError(f"kv_split score must be one of {', '.join(SPLIT_SCORES)}, got {self.score!r}")
        if self.score == "bound" and (self.mass is not None or self.coverage is not None):
            raise ConfigError("kv_split score bound takes top_k or fraction: a bound gives no page its mass")
        if self.rerank is not None and (self.score != "bound" or not isinstance(self.rerank, int)
                                        or isinstance(self.rerank, bool) or self.rerank < 2):
            raise ConfigError(f"kv_split rerank must be an integer >= 2, with score bound; got {self.rerank!r} "
                              f"with score {self.score}")
        if self.slots is not None and (not isinstance(self.slots, int) or isinstance(self.slots, bool)
                                       or self.slots < 2):
            raise ConfigError(f"kv_split slots must be an integer >= 2, got {self.slots!r}")
        if not isinstance(self.host_keys, bool):
            raise ConfigError(f"kv_split host_keys must be true or false, got {self.host_keys!r}")
        if self.host_keys and (self.keys is None or self.normalize != "read"):
            raise ConfigError("kv_split host_keys keeps the cache's keys in host memory for the pages a query "
                              "reads: it needs keys in a smaller codec (kv_split keys) and normalize read")

    def pages(self, cold: int) -> int | None:
        """How many of `cold` pages a read fetches (at most, with `mass` or `coverage` too; None: by
        mass or coverage alone)."""
        if self.top_k is not None:
            return min(self.top_k, cold)
        if self.fraction is not None:
            return min(cold, math.ceil(self.fraction * cold - 1e-9))
        return None


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class CacheConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_query_heads: int | None = None  # defaults to num_kv_heads
    page_size: int = 16
    num_pages: int = 1024  # pages of the codec's pool
    num_hot_pages: int | None = None  # 16-bit pages for tails, sinks and windows; defaults to num_pages
    dtype: torch.dtype = torch.float16
    device: str | torch.device = "cpu"
    codec: str = "fp16"
    codec_options: dict = field(default_factory=dict)
    # Tokens that stay in 16-bit (rounded up to whole pages): the first `fp_sink` and the last `fp_window`.
    fp_sink: int = 0
    fp_window: int = 0
    evictor: str | None = None
    evictor_options: dict = field(default_factory=dict)
    auto_compact: bool = True
    # Triton kernels for quantize-on-write and decode attention: None = when on CUDA with 16-bit K/V.
    use_kernels: bool | None = None
    # Server-side secret that salts prefix hashes per tenant; random per process unless given.
    prefix_secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    # Whether full prompt pages may be shared between sequences of one tenant (publish_prefix).
    prefix_sharing: bool = True
    # The lower tiers pages may go to ("cpu", "disk", "redis"); None: whichever the cache is given.
    tiers: tuple[str, ...] | None = None
    # The K/V split tier: cold pages' values in CPU memory, fetched by attention mass (KVSplit's
    # fields as a dict, or a KVSplit); None: off.
    kv_split: KVSplit | dict | None = None
    # A sliding-window cache: every layer attends to its last `window` positions, and the pages
    # every later query is past are freed as the sequence grows (window.py). No evictor, no K/V
    # split, and the reference read path (no kernel masks a window).
    window: int | None = None
    # Per layer, its window (None: global) for a model that mixes sliding-window layers with global
    # ones (Gemma 3); `open_manager` (layered.py) gives each kind of layer a cache of its own.
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
            self.dtype = DTYPES[self.dtype]
        if self.dtype not in DTYPES.values():
            raise ConfigError(f"dtype must be float16, bfloat16 or float32, got {self.dtype}")
        self.num_query_heads = self.num_query_heads or self.num_kv_heads
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages", "num_query_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.num_query_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_query_heads {self.num_query_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.num_hot_pages is None:
            self.num_hot_pages = self.num_pages
        if self.fp_sink < 0 or self.fp_window < 0:
            raise ConfigError("fp_sink and fp_window must be >= 0")
        self.device = torch.device(self.device)
        if self.tiers is not None:
            self.tiers = tuple(t for t in self.tiers if t != "device")  # the pools themselves
        if isinstance(self.kv_split, dict):
            known = {f.name for f in fields(KVSplit)}
            unknown = sorted(set(self.kv_split) - known)
            if unknown:
                raise ConfigError(f"kv_split takes {', '.join(sorted(known))}, not {unknown}")
            self.kv_split = KVSplit(**self.kv_split)
        elif self.kv_split is not None and not isinstance(self.kv_split, KVSplit):
            raise ConfigError(f"kv_split must be a mapping or a KVSplit, got {type(self.kv_split).__name__}")
        self._check_windows()
        if self.use_kernels is None:
            self.use_kernels = (self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
                                and self.window is None)
        elif self.use_kernels and self.dtype == torch.float32:
            raise ConfigError("the Triton kernels take fp16 or bf16 K/V; use the reference path for float32")
        if self.use_kernels and self.kv_split is not None and self.kv_split.score != "exact":
            raise ConfigError("kv_split score bound has no kernel: it is measured on the reference path "
                              "(use_kernels=False) only")

    def _check_windows(self) -> None:
        w = self.window
        if w is not None:
            if not isinstance(w, int) or isinstance(w, bool) or w < 1:
                raise ConfigError(f"window must be a positive integer, got {w!r}")
            if self.evictor or self.kv_split is not None:
                raise ConfigError("a sliding-window cache frees what leaves its window itself: give it no evictor "
                                  "and no kv_split (they apply to a model's global layers)")
            if self.use_kernels:
                raise ConfigError("no kernel masks a sliding window: a sliding-window cache reads on the "
                                  "reference path (use_kernels=False)")
        if self.layer_windows is not None:
            lw = tuple(self.layer_windows)
            if len(lw) != self.num_layers or any(
                    x is not None and (not isinstance(x, int) or isinstance(x, bool) or x < 1) for x in lw):
                raise ConfigError(f"layer_windows takes one window (a positive integer) or None per layer, "
                                  f"{self.num_layers} in all; got {self.layer_windows!r}")
            self.layer_windows = None if all(x is None for x in lw) else lw

