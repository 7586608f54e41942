"""Residency: which tier a sequence's pages live in, and moving them between the device and the tiers.

`offload` moves a sequence's oldest full device pages that nobody shares to a lower tier (CPU,
disk, Redis), freeing device pages; `fetch_all` brings them back before anything reads them.
Each move is reported in one event, the pages moved before a failure included. A tier copy that
outlives its move (it could not be erased) is kept on the sequence and erased with it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from ..errors import ConfigError, OutOfPages
from ..types import PageId
from . import events as ev
from .block_tables import BlockTables
from .config import CacheConfig
from .pages import SPLIT, PageRef, PageStore, page_name
from .sequence import Sequence
from .split import VALUES
from .tiers import Tier


class Residency:
    def __init__(self, cfg: CacheConfig, store: PageStore, tables: BlockTables, tiers: dict[str, Tier],
                 emit: Callable[[ev.CacheEvent], None]):
        self.cfg = cfg
        self.store = store
        self.tables = tables
        self.tiers = tiers
        self.emit = emit
        self.split = None  # the K/V split (split.ValueSplit) when the cache has one

    def offload(self, seq: Sequence, tier: str, max_pages: int | None = None) -> int:
        """Move the sequence's oldest full device pages that no other sequence shares to a
        lower tier, freeing device pages. Returns how many moved."""
        pools = self.store.pools
        if tier not in self.tiers:
            raise ConfigError(f"unknown tier {tier!r}; this cache has {sorted(self.tiers) or 'none'}")
        full = min(seq.lengths) // self.cfg.page_size
        cand = [i for i, r in enumerate(seq.pages[:full])
                if r.where in pools and pools[r.where].ref[int(r.page)] == 1]
        cand = cand[:max_pages] if max_pages is not None else cand
        if not cand:
            return 0
        moved, nbytes, stored = [], 0, 0
        try:
            for i in cand:
                r = seq.pages[i]
                key = f"{seq.id}-{uuid.uuid4().hex}"
                try:
                    stored += self.tiers[tier].put(key, pools[r.where].page_blob(PageId(int(r.page))))
                except BaseException:  # the tier may have stored it before failing (a reply lost)
                    self.erase_or_keep(seq, tier, key)
                    raise
                nbytes += pools[r.where].page_bytes
                self.store.release(r.where, [PageId(int(r.page))], seq.subject)
                moved.append(page_name(r.where, r.page))
                seq.pages[i] = PageRef(tier, key, r.where)
        finally:  # pages moved before a failing put are recorded too
            if moved:
                self.report_offload(seq, moved, nbytes, tier, stored)
        return len(moved)

    def fetch_all(self, seq: Sequence, values: bool = True) -> None:
        """Bring the sequence's offloaded pages back to the device, and (with `values`) the
        values the K/V split holds in CPU memory. Raises OutOfPages, having moved nothing, when
        a pool has too few free pages for them. A tier read that fails stops the fetch there:
        the pages brought back before stay fetched, the failing one stays in its tier and no
        device page is left taken."""
        self._fetch_pages(seq)
        if values and self.split is not None and self.split.away(seq):
            self.split.join(seq)

    def _fetch_pages(self, seq: Sequence) -> None:
        if not self.tables.layout(seq).away:
            return
        pools = self.store.pools
        away = [i for i, r in enumerate(seq.pages) if r.where not in pools]
        need: dict[str, int] = {}
        for i in away:
            need[seq.pages[i].pool] = need.get(seq.pages[i].pool, 0) + 1
        for pool, n in need.items():
            if pools[pool].free_count < n:
                raise OutOfPages(f"no free {pool} page to fetch an offloaded page back into ({n} needed, "
                                 f"{pools[pool].free_count} free); free or offload other sequences first")
        by_tier: dict[str, list[int]] = {}
        for i in away:
            by_tier.setdefault(seq.pages[i].where, []).append(i)
        for tier, idxs in by_tier.items():
            got, nbytes = [], 0
            try:
                for i in idxs:
                    r = seq.pages[i]
                    blob = self.tiers[tier].get(str(r.page))
                    new = pools[r.pool].allocate(1, seq.subject)  # room checked above
                    try:
                        pools[r.pool].load_blob(new[0], blob)
                    except BaseException:  # the copy stays the page's one home: the device page goes back
                        self.store.release(r.pool, new, seq.subject)
                        raise
                    # the device page holds it now; a copy that cannot be erased (it may be half
                    # overwritten) is kept on the sequence and erased with it
                    seq.pages[i] = PageRef(r.pool, new[0], r.pool)
                    self.erase_or_keep(seq, tier, str(r.page))
                    got.append(page_name(r.pool, new[0]))
                    nbytes += pools[r.pool].page_bytes
            finally:  # pages fetched before a failure are recorded too
                if got:
                    self.report_fetch(seq, got, nbytes, tier)

    def report_offload(self, seq: Sequence, pages: list[str], nbytes: int, dst: str, stored: int,
                       fields: tuple[str, ...] = ()) -> None:
        """The event of pages moved off the device (`fields`: the part of each, the K/V split's)."""
        self.emit(ev.PagesOffloaded(seq=seq.id, subject=seq.subject, pages=tuple(pages),
                                    n_tokens=len(pages) * self.cfg.page_size, bytes=nbytes, src="device", dst=dst,
                                    stored_bytes=stored, fields=fields))

    def report_fetch(self, seq: Sequence, pages: list[str], nbytes: int, src: str,
                     fields: tuple[str, ...] = ()) -> None:
        """The event of pages brought back to the device (`fields` as report_offload's)."""
        self.emit(ev.PagesFetched(seq=seq.id, subject=seq.subject, pages=tuple(pages),
                                  n_tokens=len(pages) * self.cfg.page_size, bytes=nbytes, src=src, dst="device",
                                  fields=fields))

    def erase_or_keep(self, seq: Sequence, tier: str, key: str) -> None:
        """Erase a tier copy the sequence no longer needs; one that cannot be erased now is kept
        on the sequence (`stale`) and erased with it."""
        try:
            self.tiers[tier].erase(key)
        except Exception:
            seq.stale.append((tier, key))

    def tier_copies(self, seq: Sequence) -> list[tuple[str, str]]:
        """Every lower-tier copy of the sequence's data: its offloaded pages and stale copies."""
        pools = self.store.pools
        return [(r.where, str(r.page)) for r in seq.pages if r.where not in pools] + seq.stale

    def offloaded(self, seq: Sequence) -> dict[str, int]:
        """Pages of the sequence per tier."""
        out: dict[str, int] = {}
        for r in seq.pages:
            if r.where not in self.store.pools:
                out[r.where] = out.get(r.where, 0) + 1
            elif r.where == SPLIT:  # the values alone (the K/V split)
                out[VALUES] = out.get(VALUES, 0) + 1
        return out

    def closing(self, seq: Sequence) -> None:
        """A sequence is being released: the K/V split's reads of it are reported."""
        if self.split is not None:
            self.split.flush(seq)
