"""Compile kernels for an H200 (sm_90) on a machine without one: run their host code with a
launcher that records each launch instead of making it, then compile each recorded launch
ahead of time with Triton's own compiler and ptxas (both in the triton wheel).

Run as a script without TRITON_INTERPRET (tests/kernels/test_hopper_compile.py does): the
interpreter replaces every @triton.jit function, and the compiler needs the real ones. Prints
one line a compiled kernel and exits 1 when one fails to compile."""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
RECORDED: list[tuple] = []


def record(kernel, grid, args, constexprs, key) -> None:
    RECORDED.append((kernel, args, dict(constexprs)))


def signature(kernel, args, constexprs) -> tuple[dict, dict, dict]:
    names = [p.name for p in kernel.params]
    sig, consts = {}, {}
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    for p in kernel.params[len(args):]:
        sig[p.name] = "constexpr"
        consts[p.name] = constexprs.get(p.name, p.default)
    return sig, consts, options


def compile_recorded() -> int:
    failed = 0
    seen = set()
    for kernel, args, constexprs in RECORDED:
        sig, consts, options = signature(kernel, args, constexprs)
        key = (kernel.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=HOPPER,
                                      options=options)
            ok = bool(compiled.asm.get("cubin"))
        except Exception as e:  # the compiler's error, reported with the kernel's name
            print(f"FAILED {kernel.fn.__name__} {consts} {options}: {type(e).__name__}: {str(e)[:2000]}")
            failed += 1
            continue
        print(f"{'ok' if ok else 'NO CUBIN'} {kernel.fn.__name__} {consts} {options}")
        failed += not ok
    return failed


def picks() -> None:
    """The K/V split's normalizer and picks, both paths, at a 240K-token row and at a short one."""
    from kvguard.kernels import page_pick as pp

    pp.launch = record
    for n in (15000, 40):
        scores = torch.randn(1, 32, n)
        total = torch.logsumexp(scores, -1)
        table = torch.arange(n, dtype=torch.int32)[None].contiguous()
        want = torch.tensor([max(1, n // 100)], dtype=torch.int32)
        for many in (None, 1):
            cfg = {"many_from": many}
            pp.page_total(scores, config=cfg)
            pp.page_pick(scores, total, table, int(want[0]), want, config=cfg)
            pp.page_pick(scores, total, table, n, threshold=1e-3, config=cfg)


if __name__ == "__main__":
    picks()
    sys.exit(1 if compile_recorded() else 0)
