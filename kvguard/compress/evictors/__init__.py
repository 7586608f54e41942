"""Evictors by name."""

from __future__ import annotations

from ...errors import ConfigError
from .base import Evictor
from .h2o import H2O
from .snapkv import SnapKV
from .streaming import StreamingLLM

EVICTORS: dict[str, type[Evictor]] = {e.name: e for e in (StreamingLLM, H2O, SnapKV)}


def make_evictor(name: str, **options) -> Evictor:
    if name not in EVICTORS:
        raise ConfigError(f"unknown evictor {name!r}; choose one of {sorted(EVICTORS)}")
    try:
        return EVICTORS[name](**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad options for evictor {name!r}: {e}") from None


__all__ = ["EVICTORS", "Evictor", "H2O", "SnapKV", "StreamingLLM", "make_evictor"]
