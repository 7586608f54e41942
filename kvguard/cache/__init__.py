"""The paged KV cache: pool, sequences, attention, tiers, prefix index, events."""

from .config import CacheConfig
from .events import EventQueue
from .layered import LayeredManager, open_manager
from .manager import CacheManager, CacheStats

__all__ = ["CacheConfig", "CacheManager", "CacheStats", "EventQueue", "LayeredManager", "open_manager"]
