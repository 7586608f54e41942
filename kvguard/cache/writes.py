"""The write path: new tokens' K/V into 16-bit pages, then the pages that left the window quantized.

write → encode → page: a row past the evictor's budget is compacted first, a sliding-window
cache's pages out of its window freed (window.py; both on the first layer),
the 16-bit pages the new tokens need are taken (all or none), the tokens are written in one
index copy per layer, and once every layer holds them the full pages past the 16-bit sinks and
window are re-encoded into the codec's pool (`quantize.py`).
"""

from __future__ import annotations

import torch

from ..compress.codecs.rotation import Rotation
from .block_tables import BlockTables
from .compaction import Compactor
from .config import CacheConfig
from .pages import HOT, PageRef, PageStore
from .quantize import Quantizer
from .sequence import Sequence


class Writer:
    def __init__(self, cfg: CacheConfig, store: PageStore, tables: BlockTables, quantizer: Quantizer,
                 compactor: Compactor, rotation: Rotation | None = None):
        self.cfg = cfg
        self.store = store
        self.tables = tables
        self.quantizer = quantizer
        self.compactor = compactor
        self.rotation = rotation
        self.split = None  # the K/V split (split.ValueSplit) when the cache has one
        self.window = None  # a sliding-window cache's Window (window.py)

    def append(self, seqs: list[Sequence], layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int]) -> bool:
        """counts[i] new tokens for seqs[i], their K/V [sum(counts), H, D] row after row: compact
        a row past the evictor's budget (first layer), take the 16-bit pages the tokens need (all
        or none), write them, and account for them. False, writing nothing, when the 16-bit pool
        has too few free pages."""
        if layer == 0:  # a step's first layer: rows past the evictor's budget are compacted first,
            for seq in seqs:  # then the K/V split moves the values of pages that left its window
                if self.window is not None:  # a sliding-window cache frees the pages it is past
                    self.window.slide(seq)
                self.compactor.auto_compact(seq, layer)
                if self.split is not None:
                    self.split.settle(seq)
        if not self.reserve(seqs, layer, counts):
            return False
        if k.shape[0]:
            self.write_tokens(layer, self.tables.token_rows(seqs, layer, counts), k, v)
        n_layers = self.cfg.num_layers
        ready = [seq for seq, n in zip(seqs, counts) if n and seq.written(layer, n, n_layers)]
        if ready:
            self.quantizer.quantize_ready(ready)
        return True

    def reserve(self, seqs: list[Sequence], layer: int, counts: list[int]) -> bool:
        """Give each row the 16-bit pages its next counts[i] tokens of `layer` start; False,
        taking none, when the pool has too few free pages for all of them."""
        s = self.cfg.page_size
        need = [max(0, -(-(seq.lengths[layer] + n) // s) - len(seq.pages)) for seq, n in zip(seqs, counts)]
        if any(need):
            hot = self.store.pools[HOT]
            if hot.free_count < sum(need):
                return False
            for seq, n in zip(seqs, need):
                if n:
                    seq.pages.extend(PageRef(HOT, p, HOT) for p in hot.allocate(n, seq.subject))
        return True

    def write_tokens(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [T, H, D] into the 16-bit pool at rows [T * H] of BlockTables.token_rows' form."""
        d = self.cfg.head_dim
        if self.rotation is not None:
            k, v = self.rotation(k), self.rotation(v)
        fields = self.store.pools[HOT].fields[layer]  # [P, H, S, D]
        fields["k"].view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
        fields["v"].view(-1, d).index_copy_(0, rows, v.reshape(-1, d))
