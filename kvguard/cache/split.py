"""The K/V split tier: keys stay on the device, the values of cold pages live in host memory.

For a sequence whose policy enables it (`CacheConfig.kv_split`), its full pages of the codec's
pool older than the last `window` tokens move, between steps (`settle`), into the split's pool,
whose key fields are on the device (in the codec, or a smaller one: `kv_split.keys`, then
encoded again and reported as a `quantize` of their keys) and whose value fields are in host
memory, pinned where CUDA is present. The codec's page is freed: the device keeps keys only.

A read scores every key on the device exactly and takes the softmax over all of them. Each
query picks the cold pages whose attention mass matters: the `top_k` pages with the largest
mass (the largest over its query heads of the probability in the page), a `fraction` of them,
every page whose mass reaches `mass`, or the fewest pages that hold `coverage` of every query
head's attention (with `top_k` or `fraction`, at most that many); with
`score: bound`, by Quest's upper bound of each page's logits instead. Only their values are
read. With `normalize: read` (the default) the query's softmax is then over the keys whose values it read; with `all` the pages not read keep
their share of it and contribute no value (on SmolLM2 that costs far more: docs/fidelity.md,
"K/V split"). Either way the one approximation is the values skipped.

On the kernel path (`attend_step`, one query per row) nothing goes through the host: a pass over
the keys (kernels/page_scores.py) gives each page's log-sum-exp, the pages are picked on the
device (kernels/page_pick.py), and the decode kernels read the picked pages' values in place in
pinned host memory, mapped into the device's address space: no staging copy, no wait (with
`normalize: all` its output is rescaled to the whole softmax's); with `slots`, the pages read
last are kept in device slots and read there (hot.py). A chunk of queries
(`attend_chunk`: a prefill's, once its older pages moved) picks the same way, each query its
own pages; the pages any of them picked are gathered into device memory once and the other
pools take the prefill kernel. Elsewhere (`attend`: the CPU, an evictor that needs each key's
mass) the same picks are made from dense fp32 scores and the picked values copied in
(split_dense.py).

With `host_keys` the split pages also keep the cache's keys in host memory beside their values
(MixedCodec's exact keys): the device's smaller keys score and pick the pages, and a query
attends over the pages it read with the cache's keys, read with the values (in place, into
slots, or copied in). A page moved back to the device takes those keys as they are.

Every move is an event: `settle` one `offload` (`fields: ["v"]`, `["k", "v"]` with exact keys,
the split pages), a read one
`fetch` per step of a sequence across all layers (the pages read in any layer, the bytes read),
after the last layer; on the kernel path when the host next looks (`drain`: at the next step,
or before the sequence is released), so that recording costs the step no wait. What needs whole
pages on the device (`kv`, compaction) brings them back first (`join`, one `fetch`). Erasure
frees split pages as any other: keys and values are overwritten before the page is used again.
"""

from __future__ import annotations

import bisect
from collections import deque

import torch

from ..errors import OutOfPages
from ..kernels.quantize import decode_pages
from ..types import PageId, SeqId
from . import split_dense
from .block_tables import BlockTables
from .config import CacheConfig
from .hot import HotValues
from .pages import SPLIT, PageRef, PageStore, page_name
from .sequence import Sequence

VALUES = "cpu-values"  # the split's pages as Residency.offloaded counts them
STAGE_BYTES = 512 << 20  # device memory for a chunk's picked pages (a layer's); past it, read in place


class ValueSplit:
    def __init__(self, cfg: CacheConfig, store: PageStore, tables: BlockTables, residency, recoded):
        self.cfg = cfg
        self.rule = cfg.kv_split
        self.store = store
        self.tables = tables
        self.pool = store.pools[SPLIT]
        self.home = store.codec_pool  # the pool whose pages move here
        self.offloaded, self.fetched, self.recoded = residency.report_offload, residency.report_fetch, recoded
        self.cuda = cfg.device.type == "cuda"
        self._moved: dict[SeqId, tuple[dict[str, None], int]] = {}  # seq -> (pages read, bytes) this step
        # the kernel path's reads, on the device until the host looks: per batch of rows, the rows
        # and per layer of this step the pages picked [B, k] and how many of each row's were read [B]
        self._reads: dict[tuple[SeqId, ...], tuple[list[Sequence], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._pending: deque[tuple] = deque()  # (event or None, pages [L, B, k], counts [L, B], seqs)
        self.last_read = 1.0  # fraction of the keys of the last reference read whose values were read
        self.names = [page_name(SPLIT, p) for p in range(self.pool.num_pages)]  # made once: a read names many
        # the split pages keep the cache's keys in host memory too (kv_split.host_keys), and the
        # fields of a split page there, as its events name them
        self.exact = getattr(self.pool.codec, "exact", None) is not None
        self.host_fields = ("k", "v") if self.exact else ("v",)
        # the pages read last, kept in device slots on the kernel path (hot.py)
        self.hot = HotValues(self.pool, self.rule.slots, cfg.device, self.view) if self.rule and self.rule.slots \
            and cfg.use_kernels else None

    @property
    def by_mass(self) -> tuple[float, float | None]:
        """The kernels' pick by mass, page_pick's (threshold, coverage): the rule's as it is now
        (a rule set after construction included)."""
        return (0.0, None) if self.rule is None else (self.rule.mass or 0.0, self.rule.coverage)

    def view(self, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The split pages' fields that a read attends over: with exact keys those and the values
        (MixedCodec.exact_view), else as they are."""
        return self.pool.codec.exact_view(fields) if self.exact else fields

    @property
    def page_value_bytes(self) -> int:
        """Bytes a read of one split page moves over the bus in one layer: its values (and exact keys)."""
        return self.pool.value_bytes() // self.cfg.num_layers

    def away(self, seq: Sequence) -> bool:
        """Whether some of the sequence's values live in host memory (from its kept layout)."""
        return bool(self.tables.layout(seq).idx[SPLIT])

    # --- between steps --------------------------------------------------------------------------

    def settle(self, seq: Sequence) -> int:
        """Move the sequence's full pages of the codec's pool older than the window to the
        split's pool (as many as it has room for): pages no other sequence shares. A page the
        prefix index offers is offered as the split page from then on (a later sequence of the
        tenant shares it there). Returns how many moved. Only between steps (every layer holds
        the same tokens)."""
        if self.rule is None or len(set(seq.lengths)) != 1:
            return 0
        s, prefix = self.cfg.page_size, self.store.prefix
        home = self.store.pools[self.home]
        cold = max(0, (seq.lengths[0] - self.rule.window) // s)
        idx = self.tables.layout(seq).idx[self.home]  # the sequence's pages there, ascending
        cand = [i for i in idx[:bisect.bisect_left(idx, cold)] if home.ref[int(seq.pages[i].page)] == 1]
        cand = cand[:self.pool.free_count]
        if not cand:
            return 0
        dst = self.pool.allocate(len(cand), seq.subject)
        src = [PageId(int(seq.pages[i].page)) for i in cand]
        self.pool.copy_pages(home, src, dst)
        for p, q in zip(src, dst):  # the offer moves with the page (before its old page is freed)
            h = prefix.hash_of((self.home, int(p)))
            if h is not None:
                prefix.put(h, (SPLIT, int(q)))
        self.store.release(self.home, src, seq.subject)
        for i, p in zip(cand, dst):
            seq.pages[i] = PageRef(SPLIT, p, SPLIT)
        nbytes, names = len(dst) * self.pool.value_bytes(), [self.names[p] for p in dst]
        self._recoded(seq, dst, SPLIT, self.home)
        self.offloaded(seq, names, nbytes, "cpu", nbytes, self.host_fields)
        return len(dst)

    def join(self, seq: Sequence, pages: list[int] | None = None) -> None:
        """Bring the sequence's split pages (those at these indices of its pages; default all)
        back to the codec's pool (before a read of whole pages); one `fetch` event. Raises
        OutOfPages, having moved nothing, when that pool has too few free pages."""
        idx = [i for i in (range(len(seq.pages)) if pages is None else pages) if seq.pages[i].where == SPLIT]
        if not idx:
            return
        self.drain()
        home = self.store.pools[self.home]
        if home.free_count < len(idx):
            raise OutOfPages(f"no room to bring the K/V split's {len(idx)} pages back to the {self.home} pool "
                             f"({home.free_count} free); free or offload other sequences first")
        src = [PageId(int(seq.pages[i].page)) for i in idx]
        dst = home.allocate(len(idx), seq.subject)
        home.copy_pages(self.pool, src, dst)
        self.store.release(SPLIT, src, seq.subject)
        for i, p in zip(idx, dst):
            seq.pages[i] = PageRef(self.home, p, self.home)
        self.fetched(seq, [page_name(SPLIT, p) for p in src], len(src) * self.pool.value_bytes(), "cpu", self.host_fields)
        self._recoded(seq, dst, self.home, SPLIT)

    def _recoded(self, seq: Sequence, pages: list[PageId], to: str, frm: str) -> None:
        """A `quantize` of the keys of pages moved from pool `frm` to `to`, when the move encoded
        them again (kv_split.keys; not from their exact copy, kv_split.host_keys)."""
        if self.store.pools[to].keys_recoded(self.store.pools[frm]):
            self.recoded(seq, pages, to, frm)

    def flush(self, seq: Sequence) -> None:
        """Emit the `fetch` of the values read for the sequence (and every other) so far."""
        for key in list(self._reads):
            self._close_step(key)
        self.drain()
        moved = self._moved.pop(seq.id, None)
        if moved and moved[0]:
            names, nbytes = moved
            self.fetched(seq, list(names), nbytes, "cpu", self.host_fields)

    # --- the kernel path ------------------------------------------------------------------------

    def attend_step(self, seqs: list[Sequence], layer: int, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Decode attention of q [B, Hq, D] (16-bit, one query per row) over every row's pools,
        the split's pages read as the rule picks them, on the device. [B, Hq, D]."""
        from kvguard.kernels.paged_decode import paged_decode_sets

        rows = self._open_step(seqs, layer)
        sets, used = self.tables.decode_sets(seqs, layer)
        names = [name for name, _ in used]
        tokens = tuple(tuple(t) for _, t in used)
        lens = self.tables.device_ints(("lens", tokens), lambda: tokens, torch.int32)  # [sets, B]
        bounded = [(fields, table, max(t)) for fields, table, t in sets]
        if SPLIT not in names:
            return paged_decode_sets(q, [(f, t, lens[i], n) for i, (f, t, n) in enumerate(bounded)],
                                     sm_scale=scale)[0]
        j = names.index(SPLIT)
        want = [self.rule.pages(t // self.cfg.page_size) for t in used[j][1]]
        k = count = None
        if want[0] is not None:  # a count of pages (with `mass` too, its cap)
            k = max(want)
            count = self.tables.device_ints(("split-k", tuple(want)), lambda: list(want), torch.int32)
        out, chosen, count = self.decode(q, bounded, lens, j, k, count, scale, layer)
        self._note_reads(rows, seqs, layer, chosen, count)
        return out

    def decode(self, q: torch.Tensor, sets: list[tuple], lens: torch.Tensor, j: int, k: int | None,
               want: torch.Tensor | None, scale: float | None,
               layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's decode over sets of pages, set j the split's, all on the device with no
        host wait and no shape that depends on the data (a CUDA graph captures it: StaticStep).
        sets: (page fields, block table [B, n_i] int32, an upper bound of the tokens a row holds
        there) per pool; lens [sets, B] int32: the tokens. The rule picks the split pages whose
        values are read (kernels/page_pick.py): with `want` ([B] int32, pages per
        row), the want[b] of largest mass (with the rule's `mass` or `coverage` too, those of them
        that reach it or cover it), k (>= every want[b]) the width of the picks; without (the
        mass or coverage rule), every page whose mass reaches the rule's, or that cover it.
        Returns out [B, Hq, D] in q's dtype, the split pages whose values were read over the bus [B, k or n_j] int32 (those
        picked in slot order; with `slots`, those no slot held), and how many of each row's [B] int32."""
        from kvguard.kernels.page_pick import page_pick, rescale
        from kvguard.kernels.page_scores import page_lse_sets
        from kvguard.kernels.paged_decode import paged_decode_sets

        b, s = q.shape[0], self.cfg.page_size
        # every page's log-sum-exp, the split's pages first, and the softmax's normalizer [B, Hq]
        # (finite: a row holds tokens)
        order = [j] + [i for i in range(len(sets)) if i != j]
        scores, total = page_lse_sets(q, [(sets[i][0], sets[i][1], lens[i]) for i in order], scale)
        # the pages read: by a page's mass, the largest over query heads of the probability in it
        n = sets[j][1].shape[1]
        k = n if want is None else k
        chosen, count = page_pick(scores[:, :, :n], total, sets[j][1], k, want, *self.by_mass)
        args = [(fields, tb, lens[i], bound) for i, (fields, tb, bound) in enumerate(sets)]
        args[j] = (self.view(sets[j][0]), chosen, count * s, k * s)  # exact keys, if kept, beside the values
        if self.hot is not None and self.hot.fits(b * k):  # every pick read from a device slot
            slots, chosen, moved = self.hot.take(layer, args[j][0], chosen, count)
            args[j], count = (self.hot.fields[layer], slots, count * s, k * s), moved
        # the picks fill a varying part of their table (by coverage, often a few % of it): the
        # decode's splits divide each row's picks, not the table's width
        out, part = paged_decode_sets(q, args, sm_scale=scale, spread=(j,))
        if self.rule.normalize == "all":  # the pages read were normalized among themselves: rescale to
            out = rescale(out, part, total)  # the whole softmax (the pages not read keep their weight)
        return out, chosen, count

    def attend_chunk(self, seq: Sequence, layer: int, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Causal attention of a chunk q [T, Hq, D] (16-bit, the sequence's last T positions, all
        after its split pages: `chunk_ready`) on the kernel path: every query picks its split
        pages as a decode step's row does (page_lse over keys read once for many queries,
        page_pick); the pages picked by any query are gathered into device memory, each read
        once over the bus, and the decode kernels attend each query over its own; the other
        pools take the prefill kernel; the two are merged by their normalizers. Returns [T, Hq, D]."""
        from kvguard.kernels.gather import gather_pages
        from kvguard.kernels.page_pick import page_pick, page_total
        from kvguard.kernels.page_scores import page_lse
        from kvguard.kernels.paged_decode import paged_decode_sets

        from . import paged

        rows = self._open_step([seq], layer)
        sets, used = self.tables.decode_sets([seq], layer)
        names = [name for name, _ in used]
        j = names.index(SPLIT)
        s, n, t = self.cfg.page_size, seq.lengths[layer], q.shape[0]
        # the other pools: each query sees their tokens at or before its position
        at = torch.arange(n - t, n, device=q.device)
        parts = [(fields, table[0], tokens[0], self.tables.positions(seq, name)[: tokens[0]])
                 for i, ((fields, table, tokens), name) in enumerate(zip(sets, names)) if i != j]
        rest, rest_lse = paged.prefill(q, parts, at, scale, with_lse=True)  # [T, Hq, D], [T, Hq]
        # the split: every query sees every page (they precede the chunk); a decode row per query
        fields, table, held = sets[j][0], sets[j][1].expand(t, -1), sets[j][2][0]
        lens = self.tables.device_ints(("chunk-lens", held, t), lambda: [held] * t, torch.int32)
        scores = page_lse(q, fields, table, lens, scale, shared=True)  # [T, Hq, n], each key read once for many queries
        total = torch.logaddexp(page_total(scores), rest_lse)
        k = self.rule.pages(held // s)
        want = None if k is None else torch.full((t,), k, device=q.device, dtype=torch.int32)
        k = table.shape[1] if k is None else k
        chosen, count = page_pick(scores, total, table, k, want, *self.by_mass)
        fields = self.view(fields)  # what the queries attend over: the values (and exact keys)
        # the pages some query picked, each brought over the bus once into device memory (the
        # queries would read each many times in place), unless that would take more than
        # STAGE_BYTES of device memory; a host sync: a chunk's shapes follow the data
        union = torch.unique(chosen[torch.arange(k, device=q.device)[None, :] < count[:, None]])
        staged = 0 < union.numel() * self.pool.page_bytes // self.cfg.num_layers <= STAGE_BYTES
        if staged:
            fields = {name: gather_pages(f, union, q.device) for name, f in fields.items()}
            chosen = torch.searchsorted(union, chosen).clamp_(max=union.numel() - 1).to(torch.int32)
        out, lse = paged_decode_sets(q, [(fields, chosen, count * s, k * s)], sm_scale=scale)
        norm = total if self.rule.normalize == "all" else torch.logaddexp(lse, rest_lse)
        out = (out.float() * (lse - norm).exp()[..., None] + rest.float() * (rest_lse - norm).exp()[..., None])
        # the pages read as one row's; their bytes: each page once when gathered, else every query's picks
        reads = union.new_full((1,), union.numel()) if staged else count.sum().reshape(1)
        self._note_reads(rows, [seq], layer, union[None], reads)
        return out.to(q.dtype)

    def chunk_ready(self, seq: Sequence, layer: int, t: int) -> bool:
        """Whether the sequence's split pages all precede its last t positions, as attend_chunk
        needs (true of a chunk appended after they moved)."""
        idx = self.tables.layout(seq).idx[SPLIT]
        return not idx or (idx[-1] + 1) * self.cfg.page_size <= seq.lengths[layer] - t

    def _open_step(self, seqs: list[Sequence], layer: int) -> tuple[SeqId, ...]:
        """The rows' key in `_reads`; at a first layer, an unfinished step of theirs is reported."""
        rows = tuple(seq.id for seq in seqs)
        if layer == 0:
            if rows in self._reads:
                self._close_step(rows)
            self.drain(wait=False)
        return rows

    def _note_reads(self, rows: tuple, seqs: list[Sequence], layer: int, pages: torch.Tensor, counts: torch.Tensor):
        """A layer's reads (pages [B, k], row b's first counts[b]), reported when the host looks."""
        self._reads.setdefault(rows, (seqs, []))[1].append((pages, counts))
        if layer == self.cfg.num_layers - 1:
            self._close_step(rows)

    def _close_step(self, rows: tuple[SeqId, ...]) -> None:
        """After a step's last layer: the pages each layer read for these rows, reported by `drain`."""
        seqs, reads = self._reads.pop(rows)
        k = max(c.shape[1] for c, _ in reads)
        pages = torch.stack([torch.nn.functional.pad(c, (0, k - c.shape[1]), value=-1) for c, _ in reads])
        self.record(pages, torch.stack([n for _, n in reads]), seqs)

    def record(self, pages: torch.Tensor, counts: torch.Tensor, seqs: list[Sequence]) -> None:
        """A step's reads, pages [layers, B, k] picked and counts [layers, B] of them read, copied
        to the host without a wait (they may be a CUDA graph's buffers, rewritten at its next
        replay: the copy is ordered before it) and reported by `drain`."""
        if self.cuda:
            hp = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
            hc = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            hp.copy_(pages, non_blocking=True)
            hc.copy_(counts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            hp, hc, event = pages.clone(), counts.clone(), None
        self._pending.append((event, hp, hc, list(seqs)))
        if not self.cuda:
            self.drain()

    def drain(self, wait: bool = True) -> None:
        """Emit the `fetch` events of the kernel path's reads whose record has reached the host;
        with `wait`, of all of them (waiting for the device). Without, a step or two may stay
        pending, so the host runs ahead of the device."""
        while self._pending:
            event, pages, counts, seqs = self._pending[0]
            if event is not None and not event.query():
                if not wait and len(self._pending) < 3:
                    return
                event.synchronize()
            self._pending.popleft()
            per_page = self.page_value_bytes
            # [layers, B, k]: the first count[l, b] (a chunk's count its queries' reads: more than its pages)
            read = (torch.arange(pages.shape[-1])[None, :] < counts[..., None]) & (pages >= 0)
            total = counts.sum(dim=0).tolist()  # pages read a row, over the layers
            for b, seq in enumerate(seqs):
                if total[b]:
                    ids = torch.unique(pages[:, b][read[:, b]]).tolist()  # ascending
                    self.fetched(seq, [self.names[p] for p in ids], total[b] * per_page, "cpu", self.host_fields)

    # --- the reference path (split_dense.py) ------------------------------------------------------

    def attend(self, seq: Sequence, layer: int, q: torch.Tensor, causal: bool, scale: float | None,
               mass_queries: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of q [T, Hq, D] (the last T positions) over what the sequence holds, in
        fp32, the split pages' values read as the rule picks them: split_dense.attend."""
        out, mass, self.last_read = split_dense.attend(self.store, self.rule, self.exact, self.read_values, seq, layer,
                                                       q, causal, scale, mass_queries)
        if layer == self.cfg.num_layers - 1:
            self.flush(seq)
        return out, mass

    def read_values(self, seq: Sequence, layer: int, pages: list[PageId]) -> list[tuple]:
        """The (exact keys or None, values) [H, S, D] fp32 of split pages of the sequence at one
        layer, copied from host memory and decoded; counted into the step's `fetch` event."""
        k, v = decode_pages(self.view(self.pool.read(layer, pages)), torch.float32)  # [n, H, S, D]
        names, nbytes = self._moved.setdefault(seq.id, ({}, 0))
        for p in pages:
            names[page_name(SPLIT, p)] = None
        self._moved[seq.id] = (names, nbytes + len(pages) * self.page_value_bytes)
        return list(zip(k if self.exact else [None] * len(pages), v, strict=True))
