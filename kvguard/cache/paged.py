"""The cache's kernel path: quantize-on-write and paged decode attention in Triton.

Used when the cache lives on CUDA (or when `use_kernels` forces it, as the tests do
under Triton's interpreter). Decode attention runs once per pool over that pool's
pages, through a block table, and the two partial results are merged by their
log-sum-exp; attention is order-free over keys, so each pool's pages may be taken
in any order. Prefill chunks take the dequantize-then-attend path.
"""

from __future__ import annotations

import torch

from ..types import PageId


def quantize_pages(hot_fields: dict[str, torch.Tensor], main_fields: dict[str, torch.Tensor],
                   src: list[PageId], dst: list[PageId]) -> None:
    """Encode 16-bit pages `src` of the hot pool into pages `dst` of the codec's pool, in place."""
    from kernels.quantize_scatter import quantize_scatter

    dev = hot_fields["k"].device
    quantize_scatter(hot_fields["k"], hot_fields["v"], torch.tensor(dst, dtype=torch.int32, device=dev),
                     main_fields, src_pages=torch.tensor(src, dtype=torch.int32, device=dev))


def decode(q: torch.Tensor, parts: list[tuple[dict[str, torch.Tensor], list[int], int]], scale: float | None,
           with_mass: bool):
    """q [1, Hq, D]; parts: (one layer's page fields, page ids, tokens held in them) per pool.

    Returns out [1, Hq, D] and, with_mass, a list of mass [H, n_i * S] per part (per KV head).
    With two parts the mass of a KV head's keys is weighted by the part's share of the
    softmax averaged over that head's query group: exact with one part, and within the
    group's spread of shares otherwise (the kernel sums the group before we can weight it)."""
    from kernels.paged_decode import paged_decode

    outs, lses, masses = [], [], []
    for fields, pages, n_tokens in parts:
        table = torch.tensor([pages], dtype=torch.int32, device=q.device)
        lens = torch.tensor([n_tokens], dtype=torch.int32, device=q.device)
        res = paged_decode(q, fields, table, lens, sm_scale=scale, return_mass=with_mass)
        outs.append(res[0].float())
        lses.append(res[1])
        if with_mass:
            masses.append(res[2][0])  # [H, n_i * S]
    lse = torch.stack(lses)  # [P, 1, Hq]
    w = torch.softmax(lse, dim=0)  # each part's share of the total softmax mass, per query head
    out = (torch.stack(outs) * w.unsqueeze(-1)).sum(0)
    if with_mass:
        h = masses[0].shape[0]
        masses = [m * w[i, 0].reshape(h, -1).mean(1, keepdim=True) for i, m in enumerate(masses)]
    return out.to(q.dtype), masses
