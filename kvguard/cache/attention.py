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


def score_blocks(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None, window: int | None = None):
    """The softmax of q [T, Hq, D] over keys k [H, L, D] fp32 (the T queries being the last T of
    the L positions), a block of queries at a time so that no [H, g, T, L] matrix exists whole.
    Yields (lo, hi, probs [H, g, hi - lo, L] fp32) for queries lo..hi-1."""
    t, hq, _ = q.shape
    h, length, _ = k.shape
    block = max(1, MAX_SCORES // max(1, hq * length))
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        yield lo, hi, torch.softmax(block_scores(q, k, lo, hi, causal, scale, window), dim=-1)


def block_scores(q: torch.Tensor, k: torch.Tensor, lo: int, hi: int, causal: bool,
                 scale: float | None, window: int | None = None) -> torch.Tensor:
    """The scaled logits [H, g, hi - lo, L] fp32 of queries lo..hi-1 of q [T, Hq, D] (the last T
    of the L positions) over keys k [H, L, D], -inf after a query's position when `causal`, and
    with a `window`, at or before its position - window (a sliding-window layer)."""
    t, hq, d = q.shape
    h, length, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q[lo:hi].float().reshape(hi - lo, h, hq // h, d).permute(1, 2, 0, 3)  # [H, g, hi - lo, D]
    scores = torch.einsum("hgtd,hld->hgtl", qf, k.float()) * scale
    if (causal and t > 1) or window is not None:
        pos_q = torch.arange(length - t + lo, length - t + hi, device=q.device).unsqueeze(1)
        pos_k = torch.arange(length, device=q.device).unsqueeze(0)
        if causal and t > 1:
            scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        if window is not None:
            scores = scores.masked_fill(pos_k <= pos_q - window, float("-inf"))
    return scores


def add_mass(mass: torch.Tensor | None, probs: torch.Tensor, lo: int, hi: int, t: int, mass_queries: int) -> None:
    """Add into mass [H, L] the probabilities of the block's queries among the last `mass_queries`."""
    first = max(lo, t - mass_queries)
    if mass is not None and first < hi:
        mass += probs[:, :, first - lo:].sum(dim=(1, 2))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    mass_queries: int = 0, scale: float | None = None, window: int | None = None):
    """q [T, Hq, D]; k, v [H, L, D] with the T queries being the last T of the L positions; with
    a `window`, each query sees only the keys of its last `window` positions.

    Returns (out [T, Hq, D] in q's dtype, mass [H, L] fp32 or None)."""
    t, hq, d = q.shape
    h, length, _ = k.shape
    vf = v.float()
    out = torch.empty(h, hq // h, t, d, device=q.device)
    mass = torch.zeros(h, length, device=q.device) if mass_queries > 0 else None
    for lo, hi, probs in score_blocks(q, k.float(), causal, scale, window):
        out[:, :, lo:hi] = torch.einsum("hgtl,hld->hgtd", probs, vf)
        add_mass(mass, probs, lo, hi, t, mass_queries)
    return out.permute(2, 0, 1, 3).reshape(t, hq, d).to(q.dtype), mass


def page_bounds(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [H, L, D] -> per-page channel min, max [H, P, D] (P = ceil(L / page_size))."""
    h, length, d = k.shape
    pages = math.ceil(length / page_size)
    pad = pages * page_size - length
    kf = k.float()
    lo = torch.cat([kf, kf.new_full((h, pad, d), math.inf)], 1).reshape(h, pages, page_size, d).amin(2)
    hi = torch.cat([kf, kf.new_full((h, pad, d), -math.inf)], 1).reshape(h, pages, page_size, d).amax(2)
    return lo, hi


def bound_shares(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, first: torch.Tensor, pos: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
    """Quest's estimate of each page's share of each query head's attention: q [T, Hq, D] at
    positions pos [T]; pages whose channel min and max are lo, hi [H, P, D] and whose first
    tokens are at first [P]. A page's bound is the largest q . k any key within its per-channel
    box can give, sum_d max(q_d lo_d, q_d hi_d) (times the softmax scale), an upper bound of
    its keys' logits; the shares are the bounds' softmax over the pages a query can see.
    Returns [H, g, T, P] fp32 (zeros for a query that sees none)."""
    t, hq, d = q.shape
    h = lo.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float().reshape(t, h, hq // h, d).permute(1, 2, 0, 3)  # [H, g, T, D]
    bound = (torch.einsum("hgtd,hpd->hgtp", qf.clamp(min=0), hi.float())
             + torch.einsum("hgtd,hpd->hgtp", qf.clamp(max=0), lo.float())) * scale
    bound = bound.masked_fill(first[None, :] > pos[:, None], float("-inf"))  # pages after the query
    return torch.softmax(bound, dim=-1).nan_to_num(0.0)
