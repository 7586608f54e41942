"""Quest-style query-aware page selection (Tang et al., 2024), at read time.

Each page keeps, per KV head and channel, the min and max of its keys. For a
query q, max over the page of q·k is at most sum_d max(q_d min_d, q_d max_d):
the pages with the largest bounds are the only ones attended. The current page
(holding the query's own position) is always read. Nothing is freed: this
saves reads, not memory.
"""

from __future__ import annotations

import math

import torch

from ..cache.attention import page_bounds

__all__ = ["page_bounds", "quest_attention"]


def quest_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, page_size: int, top_k: int,
                    scale: float | None = None) -> tuple[torch.Tensor, float]:
    """q [T, Hq, D] (the last T of L positions); k, v [H, L, D].

    Returns (out [T, Hq, D] in q's dtype, fraction of causally visible keys read)."""
    t, hq, d = q.shape
    h, length, _ = k.shape
    g = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float().reshape(t, h, g, d).permute(1, 2, 0, 3)  # [H, g, T, D]
    lo, hi = page_bounds(k, page_size)  # [H, P, D]
    bound = torch.maximum(qf.unsqueeze(3) * lo[:, None, None], qf.unsqueeze(3) * hi[:, None, None]).sum(-1)
    pos_q = torch.arange(length - t, length)  # [T]
    own = pos_q // page_size  # the page of each query
    pages = lo.shape[1]
    future = torch.arange(pages)[None, :] > own[:, None]  # [T, P]
    bound = bound.masked_fill(future, -math.inf)  # [H, g, T, P]
    bound[..., torch.arange(t), own] = math.inf  # the current page is always read
    kk = min(top_k, pages)
    chosen = torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, bound.topk(kk, dim=-1).indices, True)
    chosen &= ~future  # topk may pick masked pages when fewer than kk are visible
    keep = chosen.repeat_interleave(page_size, dim=-1)[..., :length]  # [H, g, T, L]
    causal = torch.arange(length)[None, :] <= pos_q[:, None]  # [T, L]
    keep &= causal
    scores = torch.einsum("hgtd,hld->hgtl", qf, k.float()) * scale
    probs = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
    out = torch.einsum("hgtl,hld->hgtd", probs, v.float()).permute(2, 0, 1, 3).reshape(t, hq, d)
    read = keep.sum().item() / (causal.sum().item() * h * g)
    return out.to(q.dtype), read
