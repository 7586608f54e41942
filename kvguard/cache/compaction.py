"""Compaction: the evictor picks the surviving tokens, which move into fewer pages; the rest are freed.

Evicting really frees pages (unlike masking). Pages before the first position that moves stay
as they are; from there the survivors of each layer and KV head are gathered and written into
fresh pages, 16-bit where the sinks and the window are and in the codec's pool elsewhere.

Compaction adds no error where the page layout lets it: survivors written into codec pages keep
their codes and scales (kernels/compact.py: values per token always; keys, one scale per page and
channel, where a page's survivors stay together), and `arrange` orders each head's survivors so
that they do. Only survivors that must join another page's grid are requantized, from their
exactly decoded values.

A new page whose survivors are one old page's tokens, whole, in every layer and head, is that
old page, relinked rather than copied: StreamingLLM's compaction by a page's worth of tokens
shifts every page after the sinks so, and only the sinks' page is rebuilt. A K/V split page
stays in the split's pool then (its values in host memory); one whose survivors are copied
comes home first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvguard.kernels import quantize as kq

from ..compress.codecs import Codec
from ..compress.evictors import Evictor
from ..errors import InputError, OutOfPages
from . import events as ev
from . import paged
from .config import CacheConfig
from .pages import HOT, MAIN, SPLIT, PageRef, PageStore
from .quantize import Quantizer
from .residency import Residency
from .sequence import Sequence


class Compactor:
    def __init__(self, cfg: CacheConfig, codec: Codec, evictor: Evictor | None, store: PageStore,
                 residency: Residency, quantizer: Quantizer, emit: Callable[[ev.CacheEvent], None]):
        self.cfg = cfg
        self.codec = codec
        self.evictor = evictor
        self.store = store
        self.residency = residency
        self.quantizer = quantizer
        self.emit = emit

    def auto_compact(self, seq: Sequence, layer: int) -> None:
        """Before a step's first layer: compact a sequence that outgrew the evictor's budget.
        Best effort: a sequence whose offloaded pages have no room to come back stays as it
        is (the append then takes pages as it would without an evictor)."""
        c = self.cfg
        if layer == 0 and self.evictor and c.auto_compact and len(set(seq.lengths)) == 1:
            if seq.lengths[0] >= self.evictor.budget + c.page_size:
                try:
                    self.compact(seq)
                except OutOfPages:
                    return  # no room to fetch its offloaded pages: left over budget for now

    def arrange(self, keep: torch.Tensor, seq: Sequence, first: int, main_pages: list[int]) -> torch.Tensor:
        """Each head's survivors in an order that keeps them with their page-mates: keep [layers,
        H, new_len] (sorted) reordered within the slots of the new codec pages `main_pages` that
        hold neither sinks nor the window, so that most new pages take one old page's survivors
        whole and their codes and scales move unchanged (kernels/compact.py).

        Per head: the old codec pages with the most survivors there become the new pages' anchors,
        in their old order; their holes take first the survivors that come from 16-bit pages
        (encoded now for the first time), then those of the other old pages (requantized to the
        anchor's scales where they fit). Within a page tokens stay in position order, so slots
        keep their neighbours (SnapKV pools over them). Attention is order-free over keys and a
        compacted sequence has no causal mask, so only the slots' contents change."""
        s = self.cfg.page_size
        new_len = keep.shape[-1]
        lo, hi = self.evictor.sink, new_len - self.evictor.window  # slots outside the sinks and the window
        pages = [[j for j in range(p * s, (p + 1) * s) if lo <= j < hi] for p in main_pages]
        pages = [p for p in pages if p]
        slots = [j for p in pages for j in p]
        if not slots:
            return keep
        quantized = [r.where == MAIN for r in seq.pages]
        rows = keep.reshape(-1, new_len)
        got = rows[:, slots].tolist()
        for r, toks in enumerate(got):
            groups: dict[int, list[int]] = {}
            fresh = []
            for t in toks:
                if quantized[t // s]:
                    groups.setdefault(t // s, []).append(t)
                else:
                    fresh.append(t)
            anchors = sorted(sorted(groups, key=lambda p: (-len(groups[p]), p))[: len(pages)])
            rest = fresh + [t for p in sorted(groups) if p not in anchors for t in groups[p]]
            filled = []
            for i, page in enumerate(pages):
                mine = groups[anchors[i]] if i < len(anchors) else []
                rest += mine[len(page):]  # more than the page holds (a page cut by the window)
                filled.append(mine[: len(page)])
            at = 0
            for page, mine in zip(pages, filled):
                need = len(page) - len(mine)
                mine += rest[at : at + need]
                at += need
                mine.sort()
            got[r] = [t for mine in filled for t in mine]
        rows = rows.clone()
        rows[:, slots] = torch.tensor(got, dtype=rows.dtype)
        return rows.reshape(keep.shape)

    def _columns(self, slots: list[int], width: int, device: torch.device | None = None) -> torch.Tensor:
        """The token columns (from page `first` on) of new pages `slots`, those below `width`."""
        s = self.cfg.page_size
        return torch.tensor([j * s + i for j in slots for i in range(s) if j * s + i < width], dtype=torch.long,
                            device=device)

    def _whole_pages(self, keep: torch.Tensor, seq: Sequence, first: int, quantized: set[int]) -> dict[int, int]:
        """New pages (index from `first`) whose survivors in every layer and head are one old
        page's tokens, whole and in order: {new: old page index}. They move by relinking, with
        no copy (StreamingLLM's compaction by a page shifts every page after the sinks so), where
        the old page is on the device in the pool the new one needs (a codec or K/V split page
        where the codec's goes, a 16-bit one where a 16-bit one goes)."""
        s = self.cfg.page_size
        full = (keep.shape[-1] - first * s) // s
        if full <= 0:
            return {}
        rows = keep.reshape(-1, keep.shape[-1])[:, first * s: (first + full) * s].reshape(-1, full, s)
        base = rows[0, :, 0]
        whole = ((rows == rows[:1]).all(0).all(-1) & (rows[0] == base[:, None] + torch.arange(s)).all(-1)
                 & (base % s == 0))
        split_home = SPLIT in self.store.pools and self.store.codec_pool  # the pool split pages came from
        codec = (MAIN, SPLIT) if split_home == MAIN else (MAIN,)
        window = (HOT, SPLIT) if split_home == HOT else (HOT,)
        out = {}
        for j in whole.nonzero().flatten().tolist():
            p = int(base[j]) // s
            if seq.pages[p].where in (codec if j in quantized else window):
                out[j] = p
        return out

    def _value_norms(self, seq: Sequence, length: int) -> torch.Tensor:
        """Each position's value L1 norm as the pages hold it, [layers, H, length] on the CPU,
        for an evictor that scores by mass × ‖v‖ (its pages fetched back to the device first)."""
        self.residency.fetch_all(seq)
        c = self.cfg
        return torch.stack([self.store.gather(seq.pages, layer, torch.float32)[1][:, :length].abs().sum(-1)
                            for layer in range(c.num_layers)]).cpu()

    def compact(self, seq: Sequence) -> ev.TokensEvicted | None:
        """Run the evictor (the cache has one) and move the survivors into fewer pages, freeing
        the rest. Returns the event, or None when nothing was evicted (within budget, or no free
        page to compact into). Raises OutOfPages, changing nothing, when the sequence's
        offloaded pages have no room to come back to the device."""
        if len(set(seq.lengths)) != 1:
            raise InputError("compact between steps: every layer must hold the same number of tokens")
        length, s = seq.lengths[0], self.cfg.page_size
        values = self._value_norms(seq, length) if self.evictor.needs_values else None
        keep = self.evictor.select(length, seq.mass[..., :length].cpu(), values, page_size=s)
        if keep is None:
            return None
        c = self.cfg
        if keep.dim() == 1:  # one set for the sequence: the same positions in every layer and head
            keep = keep.expand(c.num_layers, c.num_kv_heads, keep.shape[0])
        new_len = keep.shape[-1]
        ident = (keep == torch.arange(new_len)).flatten(0, -2).all(0).int()
        same = int(ident.cumprod(0).sum())  # leading positions that move in no layer or head
        first = same // s  # pages before this one stay as they are
        n_new = math.ceil((new_len - first * s) / s)
        quantized = [j for j in range(n_new) if self.codec.quantized and self.quantizer.quantizable(first + j, new_len)
                     and (first + j + 1) * s <= new_len]
        relinked = self._whole_pages(keep, seq, first, set(quantized))
        self.residency.fetch_all(seq, values=False)
        # the survivors that are copied come from pages on the device: the K/V split's pages
        # among their sources come home first (not those that move whole)
        rel = (keep[..., first * s:] - first * s).to(c.device)  # [layers, H, new_len - first * s]
        copied = [j for j in range(n_new) if j not in relinked]
        if copied and self.residency.split is not None:
            sources = (keep[..., first * s:][..., self._columns(copied, rel.shape[-1])] // s).unique().tolist()
            self.residency.split.join(seq, [p for p in sources if seq.pages[p].where == SPLIT])
        old_refs = seq.pages[first:]
        # per layer and head, the surviving positions from page `first` on (rows are sorted
        # and their first `same` >= first * s entries are 0, 1, 2, ...)
        main_slots = [j for j in quantized if j not in relinked]
        hot_slots = [j for j in copied if j not in main_slots]
        pools = self.store.pools
        got_hot = pools[HOT].allocate(len(hot_slots), seq.subject)
        got_main = pools[MAIN].allocate(len(main_slots), seq.subject) if main_slots else []
        if got_hot is None or got_main is None:
            if got_hot:
                self.store.release(HOT, got_hot, seq.subject)
            if got_main:
                self.store.release(MAIN, got_main, seq.subject)
            return None
        if main_slots:
            keep = self.arrange(keep, seq, first, [first + j for j in main_slots])
            rel = (keep[..., first * s:] - first * s).to(c.device)
        new_refs = [None] * n_new
        for j, p in relinked.items():
            new_refs[j] = seq.pages[p]
        for j, p in zip(hot_slots, got_hot):
            new_refs[j] = PageRef(HOT, p, HOT)
        for j, p in zip(main_slots, got_main):
            new_refs[j] = PageRef(MAIN, p, MAIN)
        # survivors written into codec pages move with their codes and scales (kernels/compact.py):
        # each new slot's source, page * S + offset in the codec's pool, or -1 - that in the 16-bit one
        if main_slots:
            cols = self._columns(main_slots, rel.shape[-1], c.device)
            src = rel[..., cols]  # [layers, H, len(main_slots) * S]
            where = torch.tensor([r.where == MAIN for r in old_refs], device=c.device)
            page = torch.tensor([int(r.page) for r in old_refs], device=c.device)
            slot = page[src // s] * s + src % s
            src_main = torch.where(where[src // s], slot, -1 - slot)
            if c.use_kernels:
                dst_main = paged.page_ids(got_main, c.device)
                src_main = src_main.to(torch.int32)
        if hot_slots:  # the 16-bit slots' sources: only the old pages they come from are read
            src = rel[..., self._columns(hot_slots, rel.shape[-1], c.device)]  # [layers, H, columns] positions from page `first` on
            need = (src // s).unique()
            lut = torch.zeros(len(old_refs), dtype=torch.long, device=c.device)
            lut[need] = torch.arange(len(need), device=c.device)
            src = lut[src // s] * s + src % s  # into the needed pages' tokens
            sources = [old_refs[i] for i in need.tolist()]
        for layer in range(c.num_layers):
            if main_slots:
                main_pool, hot_pool = pools[MAIN], pools[HOT]
                if c.use_kernels:
                    paged.compact_pages(main_pool.fields[layer], src_main[layer].contiguous(), dst_main,
                                        hot_pool.fields[layer])
                else:
                    kq.compact(main_pool.fields[layer], src_main[layer], torch.tensor(got_main),
                               hot_pool.fields[layer], group=getattr(self.codec, "group", kq.INT4_GROUP))
            if not hot_slots:
                continue
            k, v = self.store.gather(sources, layer, c.dtype)  # [H, sources * S, D], none a split page
            idx = src[layer].unsqueeze(-1).expand(-1, -1, c.head_dim)
            k, v = k.gather(1, idx), v.gather(1, idx)
            pad = len(hot_slots) * s - k.shape[1]  # the last slot may be part of a page
            if pad:
                z = torch.zeros(c.num_kv_heads, pad, c.head_dim, dtype=c.dtype, device=c.device)
                k, v = torch.cat([k, z], 1), torch.cat([v, z], 1)
            # [H, N*S, D] -> [N, H, S, D]
            k = k.reshape(c.num_kv_heads, len(hot_slots), s, c.head_dim).transpose(0, 1)
            v = v.reshape(c.num_kv_heads, len(hot_slots), s, c.head_dim).transpose(0, 1)
            pools[HOT].write(layer, got_hot, {"k": k, "v": v})
        moved = set(relinked.values())  # old pages that are new ones now
        freed, _ = self.store.release_refs([r for i, r in enumerate(old_refs, first) if i not in moved], seq.subject)
        seq.pages = seq.pages[:first] + new_refs
        seq.lengths = [new_len] * c.num_layers
        # H2O's mass accumulates for good; SnapKV's votes are those of the queries since the
        # last compaction (its observation window in decode), so they start again from zero
        old_mass = seq.mass_buf
        seq.mass = (torch.zeros_like(seq.mass_buf[..., :new_len]) if self.evictor.fresh_votes
                    else seq.mass_buf.gather(-1, keep.to(seq.mass_buf.device)))
        old_mass.zero_()
        seq.evicted += length - new_len
        seq.positional = False
        if got_main:  # the survivors written into codec pages were (re)quantized
            self.emit(self.quantizer.event(seq, got_main))
        event = eviction(self.store, seq, freed, length - new_len, new_len, evictor=self.evictor.name)
        self.emit(event)
        return event


def eviction(store: PageStore, seq: Sequence, freed: list[str], n: int, kept: int, *, evictor: str = "",
             reason: str = "") -> ev.TokensEvicted:
    """The `evict` event of n tokens dropped from a sequence, its pages `freed`: a compaction's
    (the evictor's name) or a sliding window's (window.py: no evictor, the reason)."""
    return ev.TokensEvicted(seq=seq.id, subject=seq.subject, pages=tuple(freed), n_tokens=n,
                            bytes=store.bytes_of(freed), evictor=evictor, kept=kept, reason=reason)
