"""The harness's knobs; imports nothing heavy, so the command line's help is quick."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

# the least each knob can be: one scored token is predicted from the prefix alone, so a
# deviation needs a second one (with one, no query is compared and every deviation reads 0)
LEAST = {"prefix": 1, "score": 2, "chunk": 1, "generate": 0, "budget": 1, "page_size": 1}


@dataclass(frozen=True)
class Settings:
    prefix: int = 1024  # tokens written before scoring
    score: int = 1024  # tokens scored
    chunk: int = 16  # scored tokens per forward pass (one page: decode-like)
    generate: int = 32  # greedy tokens after the scored text
    budget: int = 256  # tokens kept by evictors / read by sparse
    page_size: int = 16
    dtype: str = "float16"  # the cache's dtype; the model runs in its own

    def __post_init__(self) -> None:
        for name, least in LEAST.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {v!r}")
