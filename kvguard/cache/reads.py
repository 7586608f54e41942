"""The read path: attention over what a sequence holds, and its K/V dequantized.

On the kernel path a decode step reads the pages in place, every pool of every row of a batch
in one pass of the decode kernels; a causal chunk takes the prefill kernel once per pool, merged
by log-sum-exp. Elsewhere the pages are dequantized and attended densely in fp32 (a decode
step in one SDPA pass over every row's pages, in bfloat16 for a bfloat16 model). Offloaded
pages come back first. A sequence whose cold values live in the K/V split's host memory is read
through the split (split.py), which reads only the values its scores pick: a decode step on
the kernel path batched on the device, a chunk on the kernel path each query picking as a
decode row does, anything else (the CPU, an evictor that needs each key's mass) row by row. When
the evictor scores by attention mass, each read adds its keys' mass into the sequence's totals.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..compress.evictors import Evictor
from ..types import PageId
from . import paged
from .attention import dense_attention
from .block_tables import BlockTables
from .config import CacheConfig
from .pages import PageStore
from .residency import Residency
from .sequence import Sequence


class Reader:
    def __init__(self, cfg: CacheConfig, evictor: Evictor | None, store: PageStore, tables: BlockTables,
                 residency: Residency):
        self.cfg = cfg
        self.evictor = evictor
        self.store = store
        self.tables = tables
        self.residency = residency
        self.needs_mass = evictor is not None and evictor.needs_mass  # reads add their keys' mass
        self.split = residency.split  # the K/V split, when the cache has one

    def _split(self, seqs: list[Sequence]) -> bool:
        """Whether some of these sequences' values live in the K/V split's host memory: their
        reads take the split path. Pages of theirs in a lower tier come back first (split
        pages to the split's pool)."""
        if self.split is None:
            return False
        for seq in seqs:
            self.residency.fetch_all(seq, values=False)
        return any(self.split.away(seq) for seq in seqs)

    def _split_kernels(self, q: torch.Tensor, mass: bool | int) -> bool:
        """Whether the K/V split reads on the kernel path: one 16-bit query per row, and no
        evictor that needs each key's mass (the reference path gives it)."""
        return (self.cfg.use_kernels and q.shape[0] == 1 and not mass
                and q.dtype in (torch.float16, torch.bfloat16))

    def kv(self, seq: Sequence, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V over everything the sequence holds, dequantized: [H, L, D]."""
        self.residency.fetch_all(seq)
        k, v = self.store.gather(seq.pages, layer, dtype)
        n = seq.lengths[layer]
        return k[:, :n], v[:, :n]

    def attend(self, seq: Sequence, layer: int, q: torch.Tensor, causal: bool, scale: float | None) -> torch.Tensor:
        """Attention of q [T, Hq, D], the sequence's last T positions: [T, Hq, D]."""
        c = self.cfg
        mass_q = 0
        if self.needs_mass:
            observe = getattr(self.evictor, "observe", None)  # SnapKV: the last `observe` queries vote
            mass_q = q.shape[0] if observe is None else min(observe, q.shape[0])
        if self._split([seq]):
            if self._split_kernels(q, mass_q):
                return self.split.attend_step([seq], layer, q.contiguous(), scale)
            if self._split_kernels(q[:1], mass_q) and causal and self.split.chunk_ready(seq, layer, q.shape[0]):
                return self.split.attend_chunk(seq, layer, q.contiguous(), scale)
            out, mass = self.split.attend(seq, layer, q, causal, scale, mass_q)
            if mass is not None:
                seq.mass_buf[layer, :, : mass.shape[-1]] += mass
            return out
        if self.split is not None:
            self.split.last_read = 1.0  # nothing of this sequence is away: every value read
        if c.use_kernels and q.shape[0] == 1:
            return self.attend_paged([seq], layer, q.contiguous(), scale, mass_q > 0)
        if c.use_kernels and causal:
            return self._prefill_paged(seq, layer, q.contiguous(), scale, mass_q)
        k, v = self.kv(seq, layer, torch.float32)
        out, mass = dense_attention(q, k, v, causal=causal, mass_queries=mass_q, scale=scale, window=c.window)
        if mass is not None:
            seq.mass_buf[layer, :, : mass.shape[-1]] += mass
        return out

    def attend_step(self, seqs: list[Sequence], layer: int, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Decode attention of a batch, q [B, Hq, D] (16-bit on the kernel path): [B, Hq, D]."""
        split = self._split(seqs)
        if split and self._split_kernels(q[:1], self.needs_mass):
            return self.split.attend_step(seqs, layer, q.contiguous(), scale)
        if not self.cfg.use_kernels and not split and not self.needs_mass and self.cfg.window is None:
            return self._attend_step_dense(seqs, layer, q, scale)
        if not self.cfg.use_kernels or split:
            return torch.cat([self.attend(seq, layer, q[i : i + 1], True, scale) for i, seq in enumerate(seqs)])
        return self.attend_paged(seqs, layer, q.contiguous(), scale, self.needs_mass)

    def attend_chunk(self, seqs: list[Sequence], layer: int, q: torch.Tensor, counts: list[int],
                     scale: float | None) -> torch.Tensor:
        """Causal attention of a batch's chunk q [B, T, Hq, D], row i's last counts[i] queries
        real and the rest padding (zeros out): [B, T, Hq, D]."""
        t = q.shape[1]
        if (not self.cfg.use_kernels or self.needs_mass or self._split(seqs)
                or q.dtype not in (torch.float16, torch.bfloat16)):
            out = q.new_zeros(q.shape)  # each row its own
            for i, (seq, n) in enumerate(zip(seqs, counts)):
                if n:
                    out[i, t - n:] = self.attend(seq, layer, q[i, t - n:], True, scale).to(q.dtype)
            return out
        for seq in seqs:
            self.residency.fetch_all(seq)
        return self._prefill_batch(seqs, layer, q.contiguous(), counts, scale)

    def _attend_step_dense(self, seqs: list[Sequence], layer: int, q: torch.Tensor,
                           scale: float | None) -> torch.Tensor:
        """Decode of q [B, Hq, D] off the kernel path (the CPU): every row's pages, padded to the
        longest row's count, read in one gather and attended in one pass of SDPA, instead of a
        gather and an attention per row (which cost the CPU more than the model's weights);
        padding positions are masked out. In fp32, or in bfloat16 for a bfloat16 q: SDPA's CPU
        kernel then sums in fp32 and rounds the probabilities to bfloat16 for P @ V, as the
        GPU's kernels do, and no page is converted (SmolLM2 on 2 CPUs: ~15 % more tokens/s than
        in fp32). Pages that sit in one pool (as 16-bit pages do) are gathered by (row, head),
        so the attention reads them where the gather put them, through an index kept while the
        rows' pages hold: the same for every layer of a step."""
        if self.split is not None:
            self.split.last_read = 1.0  # nothing of these sequences is away: every value read
        for seq in seqs:
            self.residency.fetch_all(seq)
        c = self.cfg
        b, hq, d = q.shape
        h, ps = c.num_kv_heads, c.page_size
        dt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        most = max(len(seq.pages) for seq in seqs)
        lays = [self.tables.layout(seq) for seq in seqs]
        names = {name for lay in lays for name, ix in lay.idx.items() if ix}
        pool = self.store.pools[next(iter(names))] if len(names) == 1 else None

        def refs():  # each row's pages, padded with its first
            return [r for seq in seqs for r in [*seq.pages, *[seq.pages[0]] * (most - len(seq.pages))]]

        if pool is not None and not pool.host_values:  # [B * H, P * S, D], read once
            idx = self.tables.while_pages_hold(("dense", tuple(seq.id for seq in seqs)), lays,
                                               lambda: pool.head_index([PageId(int(r.page)) for r in refs()], b))
            k, v = pool.decode_by_head(layer, idx, b, dt)
        else:  # [H, B * P * S, D] from every pool -> [B * H, P * S, D]
            k, v = self.store.gather(refs(), layer, dt)
            k, v = (x.view(h, b, most * ps, d).transpose(0, 1).reshape(b * h, most * ps, d) for x in (k, v))
        lengths = self.tables.device_ints(("dense lengths", tuple(seq.lengths[layer] for seq in seqs)),
                                          lambda: [seq.lengths[layer] for seq in seqs])
        keep = torch.arange(most * ps, device=k.device)[None, :] < lengths[:, None]  # [B, P * S]
        out = F.scaled_dot_product_attention(q.to(dt).reshape(b, h, hq // h, d), k.view(b, h, most * ps, d),
                                             v.view(b, h, most * ps, d), attn_mask=keep[:, None, None, :],
                                             scale=scale)
        return out.reshape(b, hq, d).to(q.dtype)

    def attend_paged(self, seqs: list[Sequence], layer: int, q: torch.Tensor, scale: float | None,
                     with_mass: bool) -> torch.Tensor:
        """Decode of q [B, Hq, D] (one token per sequence) through the Triton kernels: every
        pool's pages of every row in one pass (paged_decode_sets), the block tables from each
        sequence's layout, no walk over the pages and no host sync."""
        for seq in seqs:
            self.residency.fetch_all(seq)
        return paged.decode(q, *self.tables.decode_args(seqs, layer, with_mass), scale=scale)

    def _prefill_paged(self, seq: Sequence, layer: int, q: torch.Tensor, scale: float | None,
                       mass_q: int = 0) -> torch.Tensor:
        """Causal attention of a chunk q [T, Hq, D] (the last T positions) through the prefill
        kernel, once per pool, merged by log-sum-exp. A pool's tokens may be older or newer
        than a query (the chunk's own pages may already be quantized), so each query sees, in
        each pool, the tokens at or before its position: a count per query (`limits`). With
        mass_q, the last mass_q queries' attention mass is added into the sequence's totals."""
        self.residency.fetch_all(seq)
        sets, used = self.tables.decode_sets([seq], layer)
        n, t = seq.lengths[layer], q.shape[0]
        at = torch.arange(n - t, n, device=q.device)  # the queries' positions
        parts = [(fields, table[0], tokens[0], self.tables.positions(seq, name)[: tokens[0]])
                 for (fields, table, tokens), (name, _) in zip(sets, used)]
        return paged.prefill(q, parts, at, scale, seq.mass_buf[layer] if mass_q else None, mass_q)

    def _prefill_batch(self, seqs: list[Sequence], layer: int, q: torch.Tensor, counts: list[int],
                       scale: float | None) -> torch.Tensor:
        """attend_chunk on the kernel path: per pool, each query sees the pool's tokens at or
        before its position (`limits`, as _prefill_paged), every row in one launch; the pools'
        partials merged by log-sum-exp in one pass."""
        tables = self.tables
        sets, used = tables.decode_sets(seqs, layer)
        t = q.shape[1]
        lengths = tuple(seq.lengths[layer] for seq in seqs)
        # the queries' positions, -1 for padding (which then sees no key)
        at = tables.device_ints(("queries", lengths, tuple(counts), t), lambda: [
            [n - t + j if j >= t - k else -1 for j in range(t)] for n, k in zip(lengths, counts)])
        parts = []
        lays = [tables.layout(seq) for seq in seqs]
        for (fields, table, tokens), (name, _) in zip(sets, used):
            # the same for every layer of the chunk: kept while the rows' pages hold
            limits = tables.query_limits(seqs, lays, name, at, (lengths, tuple(counts), t))
            lens = tables.device_ints(("lens", tuple(tokens)), lambda tokens=tokens: tokens, torch.int32)
            parts.append((fields, table, lens, max(tokens), limits))
        return paged.prefill_batch(q, parts, scale)
