"""paged_prefill against dense causal fp32 attention over the reference-dequantized pages."""

import pytest
import torch

from kernels._checks import KernelArgError
from kernels.paged_prefill import paged_prefill, paged_prefill_ref

from .conftest import DEVICE
from .test_paged_decode import TOL, rel_ok
from .util import CODECS, make_pages, outlier_kv


def _case(codec, dtype, group, dim, t, heads=2, max_pages=10, seed=0):
    pages = make_pages(codec, max_pages + 4, heads, 16, dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    table = torch.randperm(max_pages + 4, generator=gen)[:max_pages].to(torch.int32).to(DEVICE)
    q, _ = outlier_kv((t, heads * group, dim), dtype, gen, outlier=1.0)
    return q, pages, table


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("dim", (64, 128))
def test_matches_reference(codec, group, dim):
    # a whole prompt whose last page is partly filled, then a chunk after 130 cached tokens
    for t, length in ((37, 37), (20, 150)):
        q, pages, table = _case(codec, torch.float16, group, dim, t)
        out, lse = paged_prefill(q, pages, table, length)
        r_out, r_lse = paged_prefill_ref(q, pages, table, length)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert rel_ok(out, r_out, TOL[torch.float16, codec != "16bit"])
        assert torch.allclose(lse, r_lse, rtol=2e-3, atol=1e-2 if codec != "16bit" else 1e-4)


@pytest.mark.parametrize("codec", ("16bit", "int4"))
def test_bf16_single_query(codec):
    q, pages, table = _case(codec, torch.bfloat16, 4, 64, 1, seed=2)
    out, _ = paged_prefill(q, pages, table, 70)
    r_out, _ = paged_prefill_ref(q, pages, table, 70)
    assert rel_ok(out, r_out, TOL[torch.bfloat16, codec != "16bit"])


def test_errors():
    q, pages, table = _case("int8", torch.float16, 2, 64, 8)
    with pytest.raises(KernelArgError, match="seq_len"):
        paged_prefill(q, pages, table, 4)  # fewer tokens than queries
    with pytest.raises(KernelArgError, match="seq_len"):
        paged_prefill(q, pages, table, 10 * 16 + 1)  # more than the block table holds
    with pytest.raises(KernelArgError, match="block_table must have shape"):
        paged_prefill(q, pages, table[None], 20)
    with pytest.raises(KernelArgError, match="q must have shape"):
        paged_prefill(q[..., :32].contiguous(), pages, table, 20)


def test_int4_refuses_one_page_steps():
    # a step of one page is a 16-token P @ V reduction, which Triton 3.6 gets wrong over int4 pages
    q, pages, table = _case("int4", torch.float16, 2, 64, 8)
    with pytest.raises(KernelArgError, match="at least 32 tokens"):
        paged_prefill(q, pages, table, 20, config={"pages": 1})
    out, _ = paged_prefill(q, pages, table, 20, config={"pages": 2})
    r_out, _ = paged_prefill_ref(q, pages, table, 20)
    assert rel_ok(out, r_out, TOL[torch.float16, True])


@pytest.mark.parametrize("codec", CODECS)
def test_limits_per_query(codec):
    # pages that hold part of a sequence: each query sees its own number of their first keys,
    # none for some (zeros and lse -inf), more than the chunk's causal rule would give for others
    q, pages, table = _case(codec, torch.float16, 4, 64, 12, seed=5)
    limits = torch.tensor([0, 0, 1, 5, 16, 17, 40, 40, 90, 100, 130, 150], dtype=torch.int32, device=DEVICE)
    out, lse = paged_prefill(q, pages, table, 150, limits=limits)
    r_out, r_lse = paged_prefill_ref(q, pages, table, 150, limits=limits)
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()
    assert rel_ok(out[2:], r_out[2:], TOL[torch.float16, codec != "16bit"])
    assert torch.allclose(lse[2:], r_lse[2:], rtol=2e-3, atol=1e-2 if codec != "16bit" else 1e-4)
    # more queries than the pages hold tokens is fine with limits
    few = paged_prefill(q, pages, table, 8, limits=limits.clamp(max=8))[0]
    assert rel_ok(few[2:], paged_prefill_ref(q, pages, table, 8, limits=limits.clamp(max=8))[0][2:],
                  TOL[torch.float16, codec != "16bit"])
    with pytest.raises(KernelArgError, match="limits must have shape"):
        paged_prefill(q, pages, table, 150, limits=limits[:5])
