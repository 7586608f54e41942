"""A decode step off the kernel path reads every row's pages in one gather and attends them in one
padded pass: the same output as each row's own attention, for 16-bit and int8 pages."""

from __future__ import annotations

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.types import Subject


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_the_batched_step_matches_each_rows_own_attention(codec):
    torch.manual_seed(0)
    m = CacheManager(CacheConfig(num_layers=2, num_kv_heads=2, num_query_heads=6, head_dim=16, page_size=8,
                                 num_pages=64, codec=codec, dtype=torch.float32, prefix_sharing=False))
    seqs = [m.open(Subject("t", "u", f"s{i}")) for i in range(4)]
    for seq, n in zip(seqs, (1, 7, 8, 37)):
        for layer in range(2):
            assert m.append(seq, layer, torch.randn(n, 2, 16), torch.randn(n, 2, 16))
    q = torch.randn(4, 6, 16)
    for layer in range(2):
        batched = m.attend_step(seqs, layer, q)
        rows = torch.cat([m.attend(seq, layer, q[i : i + 1]) for i, seq in enumerate(seqs)])
        torch.testing.assert_close(batched, rows, rtol=1e-5, atol=1e-5)
