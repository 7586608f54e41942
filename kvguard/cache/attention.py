"""Attention of a chunk of queries over one sequence's dequantized K/V.

The CPU path and the reference of the paged kernels: dense, in fp32, grouped-query.
It can return each key's attention mass (for H2O and SnapKV) per KV head, summed
over the head's query group and the last `mass_queries` queries, so no attention
matrix is kept.
"""

from __future__ import annotations

import math

import torch

# Scores of at most this many elements at a time (fp32: 256 MB): a long prompt's chunk of queries
# is taken in blocks, so its [H, group, T, L] score matrix never exists whole (a 16K-token prompt
# of 32 query heads would need 34 GB).
MAX_SCORES = 1 << 26


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    mass_queries: int = 0, scale: float | None = None):
    """q [T, Hq, D]; k, v [H, L, D] with the T queries being the last T of the L positions.

    Returns (out [T, Hq, D] in q's dtype, mass [H, L] fp32 or None)."""
    t, hq, d = q.shape
    h, length, _ = k.shape
    g = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float().reshape(t, h, g, d).permute(1, 2, 0, 3)  # [H, g, T, D]
    kf, vf = k.float(), v.float()
    out = torch.empty(h, g, t, d, device=q.device)
    mass = torch.zeros(h, length, device=q.device) if mass_queries > 0 else None
    block = max(1, MAX_SCORES // max(1, h * g * length))
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        scores = torch.einsum("hgtd,hld->hgtl", qf[:, :, lo:hi], kf) * scale  # [H, g, hi - lo, L]
        if causal and t > 1:
            pos_q = torch.arange(length - t + lo, length - t + hi, device=q.device).unsqueeze(1)
            pos_k = torch.arange(length, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, :, lo:hi] = torch.einsum("hgtl,hld->hgtd", probs, vf)
        first = max(lo, t - mass_queries)  # the block's queries among the last `mass_queries`
        if mass is not None and first < hi:
            mass += probs[:, :, first - lo :].sum(dim=(1, 2))
    return out.permute(2, 0, 1, 3).reshape(t, hq, d).to(q.dtype), mass
