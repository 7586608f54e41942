"""The cache's configuration: a small dataclass for the hot path."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

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
        if self.use_kernels is None:
            self.use_kernels = self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
        elif self.use_kernels and self.dtype == torch.float32:
            raise ConfigError("the Triton kernels take fp16 or bf16 K/V; use the reference path for float32")
