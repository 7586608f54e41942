"""The K/V split's reference path: a chunk of queries over one sequence in dense fp32.

Where no kernel runs (the CPU, an evictor that needs each key's mass): every key is decoded and
scored, each query picks its split pages from its exact softmax (kvguard/cache/picks.py), and
the values of the pages picked are copied in from host memory and decoded (with
`kv_split.host_keys`, the cache's keys of those pages too, over which the query then attends).
The kernel path's equal within rounding (tests/cache/test_kv_split.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..types import PageId
from . import picks
from .attention import add_mass, block_scores, bound_shares, page_bounds, score_blocks
from .config import KVSplit
from .pages import SPLIT, PageStore
from .sequence import Sequence

# the (exact keys or None, values) [H, S, D] fp32 of split pages at one layer, read from host
# memory: ValueSplit.read_values, which counts them into the step's `fetch` event
ReadValues = Callable[[Sequence, int, list[PageId]], list[tuple]]


def attend(store: PageStore, rule: KVSplit, exact: bool, read_values: ReadValues, seq: Sequence, layer: int,
           q: torch.Tensor, causal: bool, scale: float | None,
           mass_queries: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """Attention of q [T, Hq, D] (the last T positions) over what the sequence holds, in
    fp32, the split pages' values read as the rule picks them (with `exact`, the cache's keys
    read with them). Returns (out [T, Hq, D] in q's dtype, each key's mass [H, L] summed over
    the last `mass_queries` queries, or None, the fraction of the keys whose values were read);
    the mass is the exact softmax's, whatever was read."""
    s = store.cfg.page_size
    refs = list(seq.pages)
    n = seq.lengths[layer]
    k, v = store.gather(refs, layer, torch.float32, values=False)  # split pages' values: zeros
    k, v = k[:, :n], v[:, :n]
    t, hq, d = q.shape
    h = k.shape[0]
    cold = [i for i, r in enumerate(refs) if r.where == SPLIT and (i + 1) * s <= n]
    out = torch.empty(h, hq // h, t, d, device=q.device)
    mass = torch.zeros(h, n, device=q.device) if mass_queries > 0 else None
    fetched: dict[int, tuple] = {}  # page index -> its (exact keys or None, values) [H, S, D], read once
    read = 0
    tok = (torch.tensor(cold, device=q.device)[:, None] * s + torch.arange(s, device=q.device)).flatten()
    bounds = page_bounds(k[:, tok], s) if cold and rule.score == "bound" else None  # Quest's, per page
    for lo, hi, probs in score_blocks(q, k, causal, scale):
        add_mass(mass, probs, lo, hi, t, mass_queries)
        vb = v
        if cold:  # each cold page's share of each query head's attention (kvguard/cache/picks.py)
            bound = None if bounds is None else bound_shares(
                q[lo:hi], *bounds, tok[::s], torch.arange(n - t + lo, n - t + hi, device=q.device), scale)
            picked = picks.pick(rule, picks.shares(rule, probs[..., tok].unflatten(-1, (len(cold), s))
                                                  .sum(-1), bound))  # [hi - lo, cold]
            union = [cold[j] for j in picked.any(dim=0).nonzero().flatten().tolist()]
            need = [i for i in union if i not in fetched]
            if need:
                pages = [PageId(int(refs[i].page)) for i in need]
                fetched.update(zip(need, read_values(seq, layer, pages), strict=True))
            kb = k.clone() if union and exact else k
            if union:
                vb = v.clone()
                for i in union:
                    ek, ev = fetched[i]
                    vb[:, i * s:(i + 1) * s] = ev
                    if ek is not None:
                        kb[:, i * s:(i + 1) * s] = ek
            keep = torch.ones(hi - lo, n, device=q.device)  # [query, key]: the values each query read
            keep[:, tok] = picked.to(keep.dtype).repeat_interleave(s, dim=1)
            if kb is not k:  # the softmax of what was read, over the cache's keys fetched with the values
                probs = torch.softmax(block_scores(q, kb, lo, hi, causal, scale).masked_fill(keep == 0, -math.inf),
                                      dim=-1)
            else:
                probs = probs * keep  # a page not read adds no value
                if rule.normalize == "read" and not picked.all():  # ... nor weight: the softmax
                    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)  # of what was read
            read += int(keep.sum())
        else:
            read += (hi - lo) * n
        out[:, :, lo:hi] = torch.einsum("hgtl,hld->hgtd", probs, vb)
    return out.permute(2, 0, 1, 3).reshape(t, hq, d).to(q.dtype), mass, read / (t * n) if n else 1.0
