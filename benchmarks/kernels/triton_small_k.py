"""Does this Triton compute a 16-deep tensor-core product over joined 4-bit codes correctly?

kernels/_checks.py refuses int4 tiles whose P @ V reduces over 16 tokens because Triton 3.6
did not: a tl.join of low and high nibbles makes Triton take the operand for a 4-bit source and
give both dot operands kWidth 8, which one m16n8k16 step cannot hold (triton-lang/triton#11691).
This runs that pattern alone, uint8 codes converted directly as the control, K = 16, 32, 64.
If the joined rows read 'ok' at K = 16 on a newer Triton, the refusal can be lifted.

    PYTHONPATH=. python3 benchmarks/kernels/triton_small_k.py      # a CUDA GPU: the answer

Without one it runs under TRITON_INTERPRET=1 (the test's smoke run), whose NumPy dot says
nothing of the compiler: the code path only.
"""

import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_codes(p_ptr, c_ptr, o_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, JOINED: tl.constexpr):
    m = tl.arange(0, M)
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    p = tl.load(p_ptr + m[:, None] * K + k[None, :])
    if JOINED:  # packed nibbles (channel 2i low), unpacked and joined as the int4 page loader does
        N2: tl.constexpr = N // 2
        c = tl.load(c_ptr + k[:, None] * N2 + tl.arange(0, N2)[None, :])
        v = tl.join((c & 15).to(tl.float16), (c >> 4).to(tl.float16)).reshape(K, N)
    else:  # one uint8 code per element
        v = tl.load(c_ptr + k[:, None] * N + n[None, :]).to(tl.float16)
    tl.store(o_ptr + m[:, None] * N + n[None, :], tl.dot(p, v))


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no CUDA GPU here: run with TRITON_INTERPRET=1 for the code path only")
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name() if dev == 'cuda' else 'interpreter'}")
    g = torch.Generator().manual_seed(0)
    for K in (16, 32, 64):
        for M in (4, 16):
            for joined in (False, True):
                p = torch.rand(M, K, generator=g).half().to(dev)
                codes = torch.randint(0, 16, (K, 64), generator=g, dtype=torch.uint8).to(dev)
                c = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous() if joined else codes
                o = torch.full((M, 64), float("nan"), device=dev)
                _dot_codes[(1,)](p, c, o, M=M, K=K, N=64, JOINED=joined, num_warps=1)
                want = p.float() @ codes.float()
                e = ((o - want).norm() / want.norm()).item()
                what = "joined nibbles" if joined else "uint8 codes"
                print(f"dot fp16[{M}x{K}] x ({what} -> fp16)[{K}x64], 1 warp: rel err {e:.1e} "
                      f"{'WRONG' if not e < 1e-3 else 'ok'}")


if __name__ == "__main__":
    main()
