"""The cache's kernel path: quantize-on-write and paged decode attention in Triton.

Used when the cache lives on CUDA (or when `use_kernels` forces it, as the tests do
under Triton's interpreter). Decode attention reads each pool's pages through its own
block table, in one pass whose merge combines every pool's splits by their log-sum-exp;
attention is order-free over keys, so each pool's pages may be taken in any order. Prefill
chunks take the same road: the prefill kernel once per pool, each query limited to the pool's
tokens at or before its position, writing partials that one merge pass combines; an evictor's
attention mass comes from a second kernel per pool under the merged log-sum-exp.

Compaction's survivors that land in codec pages move there with their codes and scales
(kernels/compact.py, each head its own slots, from either pool).
"""

from __future__ import annotations

import torch

from ..types import PageId
from .pool import device_index


def page_ids(pages: list[PageId], device: torch.device) -> torch.Tensor:
    """Page ids as the kernels take them (int32 on the pools' device); one copy serves every layer."""
    return device_index(pages, device, torch.int32)


def quantize_pages(hot_fields: dict[str, torch.Tensor], main_fields: dict[str, torch.Tensor],
                   src: torch.Tensor, dst: torch.Tensor) -> None:
    """Encode 16-bit pages `src` of the hot pool into pages `dst` of the codec's pool, in place
    (both page_ids)."""
    from kvguard.kernels.quantize_scatter import quantize_scatter

    quantize_scatter(hot_fields["k"], hot_fields["v"], dst, main_fields, src_pages=src)


def compact_pages(main_fields: dict[str, torch.Tensor], src: torch.Tensor, dst: torch.Tensor,
                  hot_fields: dict[str, torch.Tensor]) -> None:
    """Regroup survivors into pages `dst` of the codec's pool (one layer): src [H, len(dst) * S]
    int32, each head's sources, page * S + offset in the codec's pool or -1 - that in the 16-bit one."""
    from kvguard.kernels.compact import compact_pages

    compact_pages(main_fields, src, dst, hot_fields)


def decode(q: torch.Tensor, sets: list[tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]],
           lens: torch.Tensor, mass_into: list[tuple] | None = None, *, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, D]; sets: (one layer's page fields, block table [B, n_i] int32 on q's device,
    tokens of each row held in those pages, or an upper bound of them) per pool; lens [sets, B]
    int32 on q's device: the tokens. The bound sizes the kernels' split of the context, so a
    fixed one keeps a CUDA graph's launches valid as the rows grow.

    One pass over every pool's pages: each pool's splits go to one merge, so the result is
    attention over the union of the pools' keys. Returns out [B, Hq, D]. With mass_into, per
    set (the rows' mass buffers [H, capacity], positions [B, n_i * S] of the set's tokens):
    each key's probability under that softmax, summed over its KV head's query group, is added
    into its row's buffer at its position (paged_decode_sets' mass_into)."""
    from kvguard.kernels.paged_decode import paged_decode_sets

    args = [(fields, table, lens[i], tokens if isinstance(tokens, int) else max(tokens))
            for i, (fields, table, tokens) in enumerate(sets)]
    return paged_decode_sets(q, args, sm_scale=scale, mass_into=mass_into)[0]


def prefill(q: torch.Tensor, parts: list[tuple[dict[str, torch.Tensor], torch.Tensor, int, torch.Tensor]],
            at: torch.Tensor, scale: float | None, mass_into: torch.Tensor | None = None,
            mass_queries: int = 0, with_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [T, Hq, D], the queries at positions `at` [T], over a sequence's
    pools: parts are (page fields, block table [n] int32, tokens, their positions [tokens]
    ascending) per pool. Each query sees the tokens at or before its position; the pools'
    partial results are merged by their log-sum-exp in the kernels' merge pass. Returns [T, Hq, D].

    With mass_into ([H, capacity] fp32, a layer's running totals by position), each key's
    probability under that merged softmax, summed over its query group and the last
    `mass_queries` queries, is added at its position (paged_prefill_mass, per pool). With
    `with_lse`, returns (out, lse [T, Hq] fp32, each query's log-normalizer over these pools)."""
    from kvguard.kernels.paged_prefill import paged_prefill_mass, paged_prefill_sets

    sets, limits = [], []
    for fields, table, tokens, pos in parts:
        limits.append(torch.searchsorted(pos, at, right=True).to(torch.int32))
        sets.append((fields, table[None], None, tokens, limits[-1][None]))
    out, lse = paged_prefill_sets(q[None], sets, sm_scale=scale)
    out, lse = out[0], lse[0]
    if mass_into is not None and mass_queries > 0:
        first = q.shape[0] - min(mass_queries, q.shape[0])
        for (fields, table, tokens, pos), lim in zip(parts, limits):
            mass = paged_prefill_mass(q, fields, table, tokens, lse, first, sm_scale=scale, limits=lim)
            mass_into.index_add_(1, pos, mass)
    return (out, lse) if with_lse else out


def prefill_batch(q: torch.Tensor, sets: list[tuple], scale: float | None) -> torch.Tensor:
    """A batch's chunk q [B, T, Hq, D] over the pools, every row in one launch per pool and one
    merge: sets are (fields, block table [B, n] int32, tokens of each row in the pool [B] int32,
    their maximum, limits [B, T] int32 of them each query sees). Returns [B, T, Hq, D]."""
    from kvguard.kernels.paged_prefill import paged_prefill_sets

    return paged_prefill_sets(q, sets, sm_scale=scale)[0]
