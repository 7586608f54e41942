"""The machine's ceilings, measured in the same run as what is held against them: copy
bandwidth (read + write), read-only bandwidth (a kernel's read floor is the bytes it must read
over it) and bf16 matmul throughput. Without CUDA, placeholders (--smoke)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import GPU, time_calls

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GB = 1e9


def ceilings() -> dict:
    if not GPU:
        return {"copy_GBps": 100.0, "read_GBps": 100.0, "bf16_TFLOPs": 1.0}
    n = 2 * 1024**3 // 2  # 2 GiB each way
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_calls([lambda: dst.copy_(src)], min_total_s=0.2)
    copy = 2 * n * 2 / t / GB
    part = torch.empty(n // 8192, device=DEV, dtype=torch.float32)
    t = time_calls([lambda: _read_kernel[(n // 8192,)](src, part, BLOCK=8192, num_warps=8)], min_total_s=0.2)
    read = n * 2 / t / GB
    del src, dst, part
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = time_calls([lambda: a @ b], min_total_s=0.2)
    return {"copy_GBps": copy, "read_GBps": read, "bf16_TFLOPs": 2 * 8192**3 / t / 1e12}


@triton.jit
def _read_kernel(x, out, BLOCK: tl.constexpr):
    # the read-only ceiling: each program sums BLOCK elements, 16-byte loads
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + tl.program_id(0), tl.sum(tl.load(x + i).to(tl.float32), 0))
