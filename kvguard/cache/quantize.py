"""Quantize on write: full 16-bit pages that left the sinks and the window move into the codec's pool.

A shared prompt page already quantized by another sequence (found by its prefix hash) is shared
rather than encoded again. Every page moved is reported in a `PagesQuantized` event, built here
alone (compaction's requantized survivors are reported through `event` too).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from ..compress.codecs import Codec
from ..types import PageId
from . import events as ev
from . import paged
from .block_tables import BlockTables
from .config import CacheConfig
from .pages import HOT, MAIN, PageRef, PageStore, page_name
from .sequence import Sequence


class Quantizer:
    def __init__(self, cfg: CacheConfig, codec: Codec, store: PageStore, tables: BlockTables,
                 emit: Callable[[ev.CacheEvent], None]):
        self.cfg = cfg
        self.codec = codec
        self.store = store
        self.tables = tables
        self.emit = emit

    def quantizable(self, i: int, length: int) -> bool:
        """Whether page i of a sequence of `length` tokens is past the 16-bit sinks and window."""
        s = self.cfg.page_size
        return (i + 1) * s <= length - self.cfg.fp_window and i * s >= self.cfg.fp_sink

    def event(self, seq: Sequence, pages: list, keys: tuple[str, str, str] | None = None) -> ev.PagesQuantized:
        """The event of codec pages `pages` (ids in the codec's pool) written for a sequence; with
        `keys` (pool, pool before, codec), of the keys alone of pages (ids in that pool) that moved
        between pools of different key codecs (the K/V split's kv_split.keys)."""
        s, pools = self.cfg.page_size, self.store.pools
        if keys is None:
            pool, after, before, codec, fields = MAIN, pools[MAIN].page_bytes, pools[HOT].page_bytes, self.codec.name, ()
        else:
            pool, frm, codec = keys
            after, before = (pools[p].page_bytes - pools[p].value_bytes() for p in (pool, frm))
            fields = ("k",)
        return ev.PagesQuantized(
            seq=seq.id, subject=seq.subject, pages=tuple(page_name(pool, p) for p in pages),
            n_tokens=len(pages) * s, bytes=len(pages) * after, codec=codec, bytes_before=len(pages) * before,
            fields=fields)

    def report_keys(self, seq: Sequence, pages: list, to: str, frm: str) -> None:
        """Emit the `quantize` of the keys of pages moved from pool `frm` to `to` in another key codec."""
        self.emit(self.event(seq, pages, (to, frm, self.store.pools[to].codec.key_codec.name)))

    def quantize_ready(self, seqs: list[Sequence]) -> None:
        """Re-encode the sequences' full pages that left the 16-bit sinks and window: one
        quantize-on-write call per layer for all of them (a batch's rows cross a page boundary
        on the same step), then each sequence's pages swapped, released and reported."""
        if not self.codec.quantized:
            return
        s = self.cfg.page_size
        prefix = self.store.prefix
        hot, main = self.store.pools[HOT], self.store.pools[MAIN]
        plans = []  # (seq, todo, prefix hashes {i: h}, reused {i: main page}, fresh, new main pages)
        planned = {}  # prefix hash -> main page of a shared page quantized by an earlier row here
        for seq in seqs:
            length = min(seq.lengths)
            # the 16-bit pages i with i * s >= fp_sink and (i + 1) * s <= length - fp_window
            idx = self.tables.layout(seq).idx[HOT]
            todo = idx[bisect.bisect_left(idx, -(-self.cfg.fp_sink // s)):
                       bisect.bisect_left(idx, (length - self.cfg.fp_window) // s)]
            if not todo:
                continue
            hashes = {i: prefix.hash_of((HOT, int(seq.pages[i].page))) for i in todo}
            reused = {}  # a shared page someone else already quantized: take their copy
            for i, h in hashes.items():
                hit = prefix.get(h) if h else None
                if hit and hit[0] == MAIN:
                    reused[i] = hit[1]
                elif h and h in planned:
                    reused[i] = planned[h]
            fresh = [i for i in todo if i not in reused]
            new = main.allocate(len(fresh), seq.subject)
            if new is None:  # no room in the codec pool: the pages stay 16-bit
                continue
            for i, p in zip(fresh, new):
                if hashes[i]:
                    planned.setdefault(hashes[i], p)
            plans.append((seq, todo, hashes, reused, fresh, new))
        src = [PageId(int(seq.pages[i].page)) for seq, _, _, _, fresh, _ in plans for i in fresh]
        dst = [p for *_, new in plans for p in new]
        if src and self.cfg.use_kernels:  # the page ids copied to the device once for every layer
            src_ids, dst_ids = paged.page_ids(src, hot.device), paged.page_ids(dst, main.device)
        for layer in range(self.cfg.num_layers if src else 0):
            if self.cfg.use_kernels:
                paged.quantize_pages(hot.fields[layer], main.fields[layer], src_ids, dst_ids)
            else:
                k, v = hot.decode(layer, src, self.cfg.dtype)
                main.write(layer, dst, self.codec.encode(k, v))
        for seq, todo, hashes, reused, fresh, new in plans:
            old = [PageId(int(seq.pages[i].page)) for i in todo]
            for i, p in zip(fresh, new):
                if hashes[i]:
                    prefix.put(hashes[i], (MAIN, p))
                seq.pages[i] = PageRef(MAIN, p, MAIN)
            for i, p in reused.items():
                main.share(PageId(p), seq.subject)
                seq.pages[i] = PageRef(MAIN, p, MAIN)
            self.store.release(HOT, old, seq.subject)
            self.emit(self.event(seq, [seq.pages[i].page for i in todo]))
