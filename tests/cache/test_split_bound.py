"""The K/V split ranking its cold pages by Quest's bound of their logits, alone or as a first cut
before exact scores (`kv_split.score: bound`, `rerank`): the reference path picks as said."""

from __future__ import annotations

import math

import pytest
import torch

from kvguard.cache import picks
from kvguard.cache.attention import bound_shares, page_bounds
from kvguard.cache.config import KVSplit
from kvguard.errors import ConfigError
from kvguard.policy.schema import config_key

from .test_kv_split import HQ, D, H, N, S, filled, hand, make, query

COLD = list(range((N - 8) // S))  # the split pages of a window of 8 tokens


def test_a_page_bound_is_at_least_every_logit_of_its_keys():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(H, 64, D, generator=g)
    q = torch.randn(5, HQ, D, generator=g)
    lo, hi = page_bounds(k, S)
    shares = bound_shares(q, lo, hi, torch.arange(0, 64, S), torch.full((5,), 63), None)  # [H, g, T, P]
    assert torch.allclose(shares.sum(-1), torch.ones(H, HQ // H, 5))
    # the bound itself: log-shares differ from it by one constant a query head
    qf = q.reshape(5, H, HQ // H, D).permute(1, 2, 0, 3)
    bound = (torch.maximum(qf[..., None, :] * lo[:, None, None], qf[..., None, :] * hi[:, None, None]).sum(-1)
             / math.sqrt(D))
    logits = torch.einsum("hgtd,hld->hgtl", qf, k) / math.sqrt(D)
    assert (bound >= logits.unflatten(-1, (64 // S, S)).amax(-1) - 1e-5).all()
    torch.testing.assert_close(shares.log() - bound, (shares.log() - bound)[..., :1].expand_as(bound))
    # pages after a query's position get nothing
    later = bound_shares(q, lo, hi, torch.arange(0, 64, S), torch.full((5,), 20), None)
    assert (later[..., 20 // S + 1:] == 0).all() and torch.allclose(later.sum(-1), torch.ones(H, HQ // H, 5))


def by_hand(q, k, rule: KVSplit):
    """The pages the rule picks, computed from the keys directly."""
    g = HQ // H
    kp = k[: len(COLD) * S].unflatten(0, (len(COLD), S))  # [cold, S, H, D]
    lo, hi = kp.amin(1), kp.amax(1)  # [cold, H, D]
    bound = torch.stack([torch.maximum(q[0, hq] * lo[:, hq // g], q[0, hq] * hi[:, hq // g]).sum(-1)
                         for hq in range(HQ)]) / math.sqrt(D)  # [HQ, cold]
    bshare = torch.softmax(bound, dim=-1)
    probs = torch.stack([torch.softmax(k[:, hq // g] @ q[0, hq] / math.sqrt(D), 0) for hq in range(HQ)])
    exact = probs[:, : len(COLD) * S].unflatten(1, (len(COLD), S)).sum(-1)  # [HQ, cold]
    k_ = rule.pages(len(COLD))
    if not rule.rerank:
        return bshare.amax(0).topk(k_).indices.tolist()
    cand = bshare.amax(0).topk(min(len(COLD), rule.rerank * k_)).indices
    ex = torch.zeros_like(exact)
    ex[:, cand] = exact[:, cand] / exact[:, cand].sum(-1, keepdim=True)
    return ex.amax(0).topk(k_).indices.tolist()


@pytest.mark.parametrize("rule", [{"top_k": 2}, {"fraction": 0.25}, {"top_k": 1, "rerank": 3},
                                  {"top_k": 2, "rerank": 2}])
def test_bound_picks_and_bound_then_exact_picks_are_as_said(rule):
    split = {"window": 8, "score": "bound", **rule}
    m = make(split)
    seq, k, v = filled(m)
    m.split_cold(seq)
    for layer in range(2):
        q = query(3 + layer)
        chosen = by_hand(q, k[layer], m.cfg.kv_split)
        want, skipped = hand(q, k[layer], v[layer], COLD, lambda mass, chosen=chosen: chosen)
        torch.testing.assert_close(m.attend(seq, layer, q), want, rtol=1e-5, atol=1e-6)
        assert len(skipped) == len(COLD) - m.cfg.kv_split.pages(len(COLD))


def test_rerank_over_every_page_is_exact_scoring():
    exact, bounded = make({"window": 8, "top_k": 2}), make({"window": 8, "top_k": 2, "score": "bound", "rerank": 4})
    a, _, _ = filled(exact)
    b, _, _ = filled(bounded)
    exact.split_cold(a), bounded.split_cold(b)
    for seed in range(4):  # 4 x 2 candidates of 8 cold pages: all of them
        q = query(seed, t=2)
        assert torch.equal(bounded.attend(b, 0, q), exact.attend(a, 0, q))


def test_rerank_reads_what_exact_scores_rank_first_among_the_bounds_first():
    rule = KVSplit(top_k=1, score="bound", rerank=2)
    exact = torch.tensor([0.1, 0.5, 0.3, 0.1])[None, None, None]  # [H, g, T, cold]
    bound = torch.tensor([0.4, 0.1, 0.3, 0.2])[None, None, None]
    assert picks.pick(rule, picks.shares(rule, exact, bound)).tolist() == [[False, False, True, False]]
    alone = KVSplit(top_k=1, score="bound")
    assert picks.pick(alone, picks.shares(alone, exact, bound)).tolist() == [[True, False, False, False]]
    plain = KVSplit(top_k=1)
    assert picks.pick(plain, picks.shares(plain, exact, bound)).tolist() == [[False, True, False, False]]


def test_config_refuses_what_has_no_meaning_or_no_kernel():
    for bad in ({"mass": 0.01, "score": "bound"}, {"top_k": 1, "rerank": 4}, {"top_k": 1, "score": "bound", "rerank": 1},
                {"top_k": 1, "score": "quest"}, {"top_k": 1, "score": "bound", "rerank": 2.5}):
        with pytest.raises(ConfigError):
            make({"window": 8, **bad})
    with pytest.raises(ConfigError, match="no kernel"):
        make({"window": 8, "top_k": 1, "score": "bound"}, dtype=torch.float16, use_kernels=True)
    key = config_key({"codec": "fp16", "kv_split": {"window": 128, "fraction": 0.05, "score": "bound", "rerank": 4}})
    assert key.endswith("kvsplit@5%/w128/bound-r4")
