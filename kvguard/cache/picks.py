"""Which cold pages each query of the K/V split reads, on the reference path (split.py `attend`;
on the device kernels/page_pick.py makes the same picks from exact scores).

A page is ranked by its share of a query head's attention, the largest over the query's heads:
the exact share (the softmax's mass in the page), or Quest's estimate from each page's per-
channel key bounds (kvguard/cache/attention.py `bound_shares`), or both: the pages of largest
bound first, then the exact shares among them (`rerank`), which needs exact scores for those
pages only.
"""

from __future__ import annotations

import torch

from .config import KVSplit


def shares(rule: KVSplit, exact: torch.Tensor, bound: torch.Tensor | None) -> torch.Tensor:
    """The shares the rule ranks pages by, [H, g, T, cold]: `exact` (each page's share of the
    softmax) when it scores exactly; the bounds' softmax `bound` when it scores by bound; with
    `rerank` R, the exact shares of the R x k pages of largest bound, renormalized over them
    (as a pass of exact scores over those pages alone would give), zero elsewhere."""
    if rule.score == "exact":
        return exact
    if not rule.rerank:
        return bound
    cold = exact.shape[-1]
    candidates = top(bound.amax(dim=(0, 1)), min(cold, rule.rerank * rule.pages(cold)))  # [T, cold]
    ex = exact * candidates
    return ex / ex.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def pick(rule: KVSplit, share: torch.Tensor) -> torch.Tensor:
    """The cold pages each query reads, from share [H, g, T, cold]: by the largest share over
    its heads, the rule's k of largest, every page whose share reaches its mass, the fewest that
    cover its coverage, or (both) of the k of largest those that reach it or cover it. [T, cold]
    bool."""
    best = share.amax(dim=(0, 1))  # [T, cold]
    k = rule.pages(best.shape[1])
    if rule.mass is not None:
        by_mass = best >= rule.mass
    elif rule.coverage is not None:
        by_mass = covering(best, 1.0 - rule.coverage)
    else:
        return top(best, k)
    return by_mass if k is None else top(best, k) & by_mass


def covering(best: torch.Tensor, miss: float) -> torch.Tensor:
    """[T, n] bool: each row of best [T, n] but its smallest entries while their sum stays within
    `miss` (entries of one value skipped or kept together). Each query head's share of a page is
    at most `best`'s, so the pages skipped hold at most `miss` of every head's attention."""
    low = best.sort(dim=1).values
    upto = low.cumsum(dim=1).gather(1, torch.searchsorted(low, best, right=True) - 1)  # sum of those <= each
    return upto > miss


def top(x: torch.Tensor, k: int) -> torch.Tensor:
    """[T, n] bool: each row's k largest of x [T, n]."""
    if k >= x.shape[1]:
        return torch.ones_like(x, dtype=torch.bool)
    return torch.zeros_like(x, dtype=torch.bool).scatter_(1, x.topk(k, dim=1).indices, True)
