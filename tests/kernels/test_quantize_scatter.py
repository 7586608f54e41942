"""quantize_scatter and scatter_tokens against kernels/quantize.py."""

import pytest
import torch
from kvguard.kernels._checks import KernelArgError
from kvguard.kernels.quantize_scatter import (
    quantize_scatter,
    quantize_scatter_ref,
    scatter_tokens,
    scatter_tokens_ref,
)

from .conftest import DEVICE
from .util import assert_fields_match, empty_fields, outlier_kv

QUANTIZED = ("int8", "fp8", "int4")


@pytest.mark.parametrize("codec", QUANTIZED)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("dim", (64, 128))
def test_matches_reference(codec, dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    k, v = outlier_kv((5, 2, 16, dim), dtype, gen)  # [N, H, S, D]
    k[1, 0] = 0.0  # an all-zero page-head takes the smallest scale
    dst = torch.tensor([6, 0, 3, 7, 2], dtype=torch.int32, device=DEVICE)
    out, want = empty_fields(codec, 8, 2, 16, dim), empty_fields(codec, 8, 2, 16, dim)
    quantize_scatter(k, v, dst, out)
    quantize_scatter_ref(k, v, dst, want)
    assert_fields_match(out, want, codec)


@pytest.mark.parametrize("codec", QUANTIZED)
def test_from_staging_pool(codec):
    k, v = outlier_kv((6, 3, 16, 64), torch.bfloat16, torch.Generator().manual_seed(1))
    src = torch.tensor([4, 1], dtype=torch.int64, device=DEVICE)
    dst = torch.tensor([0, 5], dtype=torch.int64, device=DEVICE)
    out, want = empty_fields(codec, 6, 3, 16, 64), empty_fields(codec, 6, 3, 16, 64)
    quantize_scatter(k, v, dst, out, src_pages=src)
    quantize_scatter_ref(k, v, dst, want, src_pages=src)
    assert_fields_match(out, want, codec)
    assert torch.equal(out["k_scale"][1], want["k_scale"][1])  # untouched pages stay zero


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_scatter_tokens(dtype):
    k, v = outlier_kv((7, 3, 64), dtype, torch.Generator().manual_seed(2))  # [T, H, D]
    slots = torch.tensor([5, 17, -1, 100, 101, 191, 0], device=DEVICE)  # -1: padding, skipped
    out, want = empty_fields("16bit", 12, 3, 16, 64, dtype), empty_fields("16bit", 12, 3, 16, 64, dtype)
    scatter_tokens(k, v, slots, out)
    scatter_tokens_ref(k, v, slots, want)
    assert torch.equal(out["k"], want["k"]) and torch.equal(out["v"], want["v"])


def test_errors():
    k, v = outlier_kv((2, 2, 16, 64), torch.float16, torch.Generator().manual_seed(3))
    dst = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    pages = empty_fields("int8", 4, 2, 16, 64)
    with pytest.raises(KernelArgError, match="k must be"):
        quantize_scatter(k.float(), v.float(), dst, pages)
    with pytest.raises(KernelArgError, match="shape"):
        quantize_scatter(k[:, :1].contiguous(), v[:, :1].contiguous(), dst, pages)
    with pytest.raises(KernelArgError, match="contiguous"):
        quantize_scatter(k.transpose(2, 3).contiguous().transpose(2, 3), v, dst, pages)
    with pytest.raises(KernelArgError, match="entries"):
        quantize_scatter(k, v, dst[:1], pages)
    with pytest.raises(KernelArgError, match="dst_pages must be"):
        quantize_scatter(k, v, dst.float(), pages)
    with pytest.raises(KernelArgError, match="missing"):
        quantize_scatter(k, v, dst, {n: t for n, t in pages.items() if n != "v_scale"})
    with pytest.raises(KernelArgError, match="quantized pages"):
        quantize_scatter(k, v, dst, empty_fields("16bit", 4, 2, 16, 64))
    with pytest.raises(KernelArgError, match="16-bit pages"):
        scatter_tokens(k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous(), dst, pages)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k, v = outlier_kv((1, 2, 16, 64), torch.float16, torch.Generator().manual_seed(4))
    pages = empty_fields("int8", 2, 2, 16, 64)
    with pytest.raises(KernelArgError, match="interpreter|device"):
        quantize_scatter(k.cpu(), v.cpu(), torch.zeros(1, dtype=torch.int32), {n: t.cpu() for n, t in pages.items()})
