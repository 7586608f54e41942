"""The Quest-style selector: its key bound really bounds q·k, it reads only the
chosen pages, and with every page chosen it is exact attention."""

from __future__ import annotations

import math

import pytest
import torch

from kvguard.cache.attention import dense_attention
from kvguard.eval.sparse import page_bounds, quest_attention


def qkv(t=6, length=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 9, 64, generator=g)
    k = torch.randn(3, length, 64, generator=g)
    k[:, :, 5] *= 15  # an outlier channel, as real keys have
    return q, k, torch.randn(3, length, 64, generator=g)


def test_all_pages_is_dense_attention():
    q, k, v = qkv()
    out, read = quest_attention(q, k, v, page_size=16, top_k=5)
    want, _ = dense_attention(q, k, v)
    torch.testing.assert_close(out, want)
    assert read == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_bound_is_an_upper_bound_of_every_key_in_the_page(seed):
    q, k, _ = qkv(seed=seed)
    lo, hi = page_bounds(k, 16)  # [H, P, D]
    qh = q.reshape(6, 3, 3, 64).permute(1, 2, 0, 3)  # [H, g, T, D]
    bound = torch.maximum(qh.unsqueeze(3) * lo[:, None, None], qh.unsqueeze(3) * hi[:, None, None]).sum(-1)
    dots = torch.einsum("hgtd,hld->hgtl", qh, k)  # [H, g, T, L]
    for p in range(lo.shape[1]):
        page_max = dots[..., p * 16 : (p + 1) * 16].amax(-1)
        assert (page_max <= bound[..., p] + 1e-4).all()


def test_one_page_reads_only_the_current_page():
    q, k, v = qkv(t=1, length=70)
    out, read = quest_attention(q, k, v, page_size=16, top_k=1)
    own = slice(64, 70)  # position 69 lives in page 4: tokens 64..69
    want, _ = dense_attention(q, k[:, own], v[:, own])
    torch.testing.assert_close(out, want)
    assert read == pytest.approx(6 / 70)


def test_chooses_the_page_with_the_largest_bound():
    q, k, v = qkv(t=1, length=64)
    k[:, :48] *= 0.01  # pages 0-2 hold small keys...
    k[:, 20] = 3 * q[0].reshape(3, 3, 64).mean(1)  # ...but for one in page 1 that every query head aligns with
    out, _ = quest_attention(q, k, v, page_size=16, top_k=2)
    keep = torch.cat([torch.arange(16, 32), torch.arange(48, 64)])
    want, _ = dense_attention(q, k[:, keep], v[:, keep], causal=False)
    torch.testing.assert_close(out, want)
    assert not math.isnan(out.sum().item())
