"""The K/V split's score pass: each page's log-sum-exp of a decode query's logits, every codec."""

from __future__ import annotations

import pytest
import torch
from kvguard.kernels import quantize as ref
from kvguard.kernels._checks import KernelArgError
from kvguard.kernels.page_scores import page_lse, page_lse_ref

from .conftest import DEVICE


def pages_of(codec: str, p: int, h: int, s: int, d: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(p, h, s, d, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    v = torch.randn(p, h, s, d, generator=g)
    if codec == "16bit":
        f = {"k": k.half(), "v": v.half()}
    elif codec == "int4":
        f = ref.encode_int4(k, v)
    else:
        f = ref.encode_int8(k, v, dtype=torch.float8_e4m3fn if codec == "fp8" else torch.int8)
    return {n: t.contiguous().to(DEVICE) for n, t in f.items()}


@pytest.mark.parametrize("codec", ["16bit", "int8", "fp8", "int4"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_page_lse_matches_the_dense_reference(codec, group):
    h, s, d = 2, 16, 64
    pages = pages_of(codec, 24, h, s, d)
    q = torch.randn(3, h * group, d, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    # rows of 11 pages, a partial last page, and none at all
    table = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))[:11] for i in range(3)])
    table = table.int().to(DEVICE)
    lens = torch.tensor([11 * s, 5 * s + 3, 0], dtype=torch.int32, device=DEVICE)
    got, want = page_lse(q, pages, table, lens), page_lse_ref(q, pages, table, lens)
    assert got.shape == (3, h * group, 11)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)  # -inf exactly past each row's tokens
    assert finite[:2, :, :6].all() and not finite[1, :, 6:].any() and not finite[2].any()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-3, atol=2e-3)
    # the pages' lse combine to the whole softmax's normalizer
    total = torch.logsumexp(got[0], dim=-1)
    torch.testing.assert_close(total, torch.logsumexp(want[0], dim=-1), rtol=1e-3, atol=2e-3)


def test_page_lse_refuses_bad_input():
    pages = pages_of("int8", 4, 2, 16, 64)
    q = torch.randn(1, 4, 64).half().to(DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelArgError):
        page_lse(q.float(), pages, table, lens)  # queries must be 16-bit
    with pytest.raises(KernelArgError):
        page_lse(torch.randn(1, 3, 64).half().to(DEVICE), pages, table, lens)  # 3 heads over 2 KV heads
    with pytest.raises(KernelArgError):
        page_lse(q, pages, table.float(), lens)


def test_a_tuning_configuration_gives_the_same_scores():
    pages = pages_of("int8", 40, 2, 16, 64)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    table = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(i))[:37] for i in range(2)])
    lens = torch.tensor([37 * 16, 20 * 16 + 1], dtype=torch.int32, device=DEVICE)
    table = table.int().to(DEVICE)
    want = page_lse(q, pages, table, lens)
    got = page_lse(q, pages, table, lens, config={"pages": 16, "num_warps": 2, "num_stages": 2})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isinf(got[1, :, 21:]).all() and torch.isfinite(got[1, :, :21]).all()
