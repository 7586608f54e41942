"""The harness's knobs; imports nothing heavy, so the command line's help is quick."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    prefix: int = 1024  # tokens written before scoring
    score: int = 1024  # tokens scored
    chunk: int = 16  # scored tokens per forward pass (one page: decode-like)
    generate: int = 32  # greedy tokens after the scored text
    budget: int = 256  # tokens kept by evictors / read by sparse
    page_size: int = 16
    dtype: str = "float16"  # the cache's dtype; the model runs in its own
