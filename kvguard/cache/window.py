"""A sliding-window layer's pages: those every later query is past are freed as the sequence grows.

A layer of window W lets the query at position p see the keys at p - W + 1 .. p (transformers'
`sliding_window_overlay`: kv > q - W). Before a step's first layer writes, the leading pages
whose last token is at or before length - W (where length is the first new token's position)
can be read by no query of this step or a later one: they are overwritten, freed and reported in
one `evict` event whose reason is "window". Between steps a sequence then holds fewer than
W + page_size tokens (a prompt chunk adds its own tokens for that step); whole pages go, so
the tokens held stay in position order and the read path masks the first ones a query no
longer sees (attention.py's `window`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import events as ev
from .compaction import eviction
from .config import CacheConfig
from .pages import PageStore
from .sequence import Sequence

REASON = "window"


class Window:
    def __init__(self, cfg: CacheConfig, store: PageStore, emit: Callable[[ev.CacheEvent], None]):
        self.cfg = cfg
        self.store = store
        self.emit = emit

    def slide(self, seq: Sequence) -> ev.TokensEvicted | None:
        """Free the sequence's leading pages that fell out of the window (before a step's first
        layer, when every layer holds the same tokens). Returns the event, or None."""
        c = self.cfg
        if c.window is None or len(set(seq.lengths)) != 1:
            return None
        s, length = c.page_size, seq.lengths[0]
        drop = min((length - c.window + 1) // s, len(seq.pages))  # pages wholly at or before length - W
        if drop <= 0:
            return None
        n = drop * s
        freed, _ = self.store.release_refs(seq.pages[:drop], seq.subject)  # shared prompt pages: a reference
        del seq.pages[:drop]
        seq.lengths = [length - n] * c.num_layers
        old, seq.mass = seq.mass_buf, torch.zeros_like(seq.mass_buf)  # no evictor reads it; nothing left behind
        old.zero_()
        seq.evicted += n
        seq.positional = False
        event = eviction(self.store, seq, freed, n, length - n, reason=REASON)
        self.emit(event)
        return event
