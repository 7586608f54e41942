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


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_bfloat16_step_attends_in_bfloat16_close_to_each_rows_fp32_attention(codec):
    """bfloat16 pages and q: one SDPA pass in bfloat16 (fp32 sums, probabilities rounded for
    P @ V), within bfloat16's rounding of the rows' own attention in fp32, every layer of
    several steps (the gather index is kept between layers and rebuilt when a page is added)."""
    torch.manual_seed(2)
    m = CacheManager(CacheConfig(num_layers=2, num_kv_heads=2, num_query_heads=6, head_dim=16, page_size=8,
                                 num_pages=64, codec=codec, dtype=torch.bfloat16, prefix_sharing=False))
    seqs = [m.open(Subject("t", "u", f"s{i}")) for i in range(3)]
    for seq, n in zip(seqs, (5, 8, 21)):
        for layer in range(2):
            assert m.append(seq, layer, torch.randn(n, 2, 16).bfloat16(), torch.randn(n, 2, 16).bfloat16())
    for _ in range(4):  # the first step adds a page to the row of 8
        k = torch.randn(3, 2, 16).bfloat16()
        q = torch.randn(3, 6, 16).bfloat16()
        for layer in range(2):
            assert m.append_step(seqs, layer, k, k)
            batched = m.attend_step(seqs, layer, q)
            assert batched.dtype == torch.bfloat16
            rows = torch.cat([m.attend(seq, layer, q[i : i + 1].float()) for i, seq in enumerate(seqs)])
            torch.testing.assert_close(batched.float(), rows.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "fp8"])
def test_a_gather_by_head_reads_what_decoding_the_pages_reads(codec):
    """PagePool.decode_by_head lays each (row, head)'s positions out in one run: the pages'
    own decode, regrouped."""
    from kvguard.cache.pool import PagePool
    from kvguard.compress.codecs import make_codec
    from kvguard.types import PageId

    torch.manual_seed(1)
    pool = PagePool(make_codec(codec), num_pages=12, num_layers=2, num_kv_heads=3, head_dim=32, page_size=8,
                    dtype=torch.float32, device=torch.device("cpu"))
    pages = [PageId(p) for p in range(12)]
    k, v = torch.randn(12, 3, 8, 32), torch.randn(12, 3, 8, 32)
    pool.write(1, pages, pool.codec.encode(k, v))
    order = [PageId(p) for p in (5, 2, 9, 9, 0, 11)]  # 2 rows of 3 pages, one page twice
    gk, gv = pool.decode_by_head(1, order, 2, torch.float32)
    dk, dv = pool.decode(1, order, torch.float32)  # [6, H, S, D]
    for got, want in ((gk, dk), (gv, dv)):
        regrouped = want.view(2, 3, 3, 8, 32).transpose(1, 2).reshape(2 * 3, 3 * 8, 32)
        assert got.shape == (6, 24, 32)
        torch.testing.assert_close(got, regrouped, rtol=0, atol=0)
