"""Compile kernels for an H200 (sm_90) on a machine without one: run their host code with a
launcher that records each launch instead of making it, then compile each recorded launch
ahead of time with Triton's own compiler and ptxas (both in the triton wheel).

Run as a script without TRITON_INTERPRET (tests/kernels/test_hopper_compile.py does): the
interpreter replaces every @triton.jit function, and the compiler needs the real ones. Prints
one line a compiled kernel and exits 1 when one fails to compile."""

from __future__ import annotations

import dataclasses
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
RECORDED: list[tuple] = []
OPTIONS = {f.name for f in dataclasses.fields(CUDAOptions)}  # what a launch passes beside the kernel's own arguments


def record(kernel, grid, args, constexprs, key) -> None:
    """kernels/_launch.py launch's stand-in."""
    RECORDED.append((kernel, args, dict(constexprs)))


def _run(self, *args, grid, warmup, **kwargs):
    """JITFunction.run's stand-in, for kernels launched as kernel[grid](...)."""
    RECORDED.append((self, args, dict(kwargs)))


JITFunction.run = _run


def signature(kernel, args, constexprs) -> tuple[dict, dict, dict]:
    sig, consts = {}, {}
    for p, a in zip(kernel.params, args):
        name = p.name
        if p.is_constexpr:
            sig[name], consts[name] = "constexpr", a
        elif isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    options = {k: constexprs.pop(k) for k in OPTIONS if k in constexprs}
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


def picks(pp) -> None:
    """The K/V split's normalizer and picks (pp: kernels/page_pick.py), both paths, at a 240K-token
    row and at a short one."""
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
            pp.page_pick(scores, total, table, n, coverage=0.99, config=cfg)  # a threshold a row
        # the k-th largest by bisection, the row in registers and looped over; the coverage
        # threshold looped over a row longer than its block
        for blk in (None, 4096):
            cfg = {"many_from": None, "select": "bisect", **({"block": blk, "num_warps": 8} if blk else {})}
            pp.page_pick(scores, total, table, int(want[0]), want, config=cfg)
        pp.coverage_threshold(torch.rand(1, n), 0.01, block=1024)


def _pages(codec: str, n: int, h: int, d: int, s: int = 16) -> dict[str, torch.Tensor]:
    """n pages of random K/V in `codec` ("int4k": the K/V split's INT4 keys beside INT8 values),
    by the codecs the cache encodes with (tests/kernels/util.py would set the interpreter)."""
    from kvguard.compress.codecs import make_codec
    from kvguard.compress.codecs.mixed import MixedCodec

    k, v = torch.randn(n, h, s, d), torch.randn(n, h, s, d)
    if codec == "fp16":
        return {"k": k.half(), "v": v.half()}
    c = MixedCodec(keys=make_codec("int4"), values=make_codec("int8")) if codec == "int4k" else make_codec(codec)
    return c.encode(k, v)


def everything() -> None:
    """Every kernel of the hot path, as an H200 would launch it: decode (each codec, both head
    dims, mixed key and value codecs, with mass), the key pass, prefill (each codec, with mass),
    the writes, compaction, the gather and scatter, the split's slots, and the picks."""
    import importlib

    names = ("page_pick", "page_scores", "paged_decode", "paged_prefill", "quantize_scatter", "compact", "gather",
             "slots")
    mods = {n: importlib.import_module(f"kvguard.kernels.{n}") for n in names}
    checks = importlib.import_module("kvguard.kernels._checks")

    def any_device(*tensors):  # the host code runs on CPU tensors here, as if they were the device's
        return tensors[0].device

    for m in (*mods.values(), checks):
        m.launch = record
        if hasattr(m, "check_device"):
            m.check_device = any_device
    pd, pp = mods["paged_decode"], mods["paged_prefill"]
    pd._num_sms = lambda device: 132  # an H200's
    pd._sm90 = lambda device: True  # programmatic dependent launch, as on Hopper
    b, hq, n = 2, 32, 64
    for d in (64, 128):
        h = hq // 4
        lens = torch.full((b,), n * 16 - 5, dtype=torch.int32)
        table = torch.arange(b * n, dtype=torch.int32).view(b, n).contiguous()
        q = torch.randn(b, hq, d).half()
        for codec in ("fp16", "int8", "fp8", "int4", "int4k"):
            pages = _pages(codec, b * n, h, d)
            pd.paged_decode_sets(q, [(pages, table, lens)])
            pd.paged_decode_sets(q, [(pages, table, lens), (_pages("fp16", b * n, h, d), table, lens)],
                                 return_mass=True)
            if codec == "int8":  # a K/V split's picks (splits over each row's tokens); the tuning's
                # other decode kernels: a warp its own pages, and not transposed
                pd.paged_decode_sets(q, [(pages, table, lens), (_pages("fp16", b * n, h, d), table, lens)],
                                     spread=(0,))
                pd.paged_decode_sets(q, [(pages, table, lens)], config={"transposed": False, "warp_split": True,
                                                                        "num_warps": 2, "pages": 4})
                pd.paged_decode_sets(q, [(pages, table, lens)], config={"transposed": False, "pages": 4})
            if d != 128:  # the decode path at both head dims; the rest at 128, where its tiles are largest
                continue
            mods["page_scores"].page_lse(q, pages, table, lens)
            mods["page_scores"].page_lse(q[:1].expand(8, hq, d).contiguous(), pages, table[:1].expand(8, n).contiguous(),
                                         lens[:1].expand(8).contiguous(), shared=True)
            if codec == "int4k":
                continue
            qt = torch.randn(1, 64, hq, d).half()
            pp.paged_prefill(qt[0], pages, table[0], n * 16)
            limits = torch.full((1, 64), n * 16, dtype=torch.int32)
            pp.paged_prefill_sets(qt, [(pages, table[:1], lens[:1], n * 16, limits),
                                       (_pages("fp16", b * n, h, d), table[:1], lens[:1], n * 16, limits)])
            lse = torch.zeros(64, hq)
            pp.paged_prefill_mass(qt[0], pages, table[0], n * 16, lse)
            if codec != "fp16":
                fresh = {f: t.clone() for f, t in pages.items()}
                kv = torch.randn(4, h, 16, d).half()
                mods["quantize_scatter"].quantize_scatter(kv, kv, torch.arange(4, dtype=torch.int32), fresh)
                slots = torch.arange(0, 64, dtype=torch.int64)
                dst = torch.arange(4, dtype=torch.int32)
                mods["compact"].compact_pages(fresh, slots + 64, dst)
                mods["compact"].compact_pages(fresh, (slots + 64)[None].repeat(h, 1), dst)  # each head its own
                mods["compact"].compact_pages(fresh, -1 - slots, dst, hot=_pages("fp16", 8, h, d))
                mods["compact"].dequantize_tokens(fresh, slots)
            else:
                tok = torch.randn(8, h, d).half()
                fresh = {f: t.clone() for f, t in pages.items()}
                mods["quantize_scatter"].scatter_tokens(tok, tok, torch.arange(8, dtype=torch.int64), fresh)
                slots = torch.arange(0, 64, dtype=torch.int64)
                mods["compact"].compact_tokens(fresh, slots + 64, slots)
        if d != 128:
            continue
        mods["gather"].gather_pages(pages["k"], torch.arange(4, dtype=torch.int64), torch.device("cpu"))
        mods["gather"].scatter_pages(pages["k"], torch.tensor([2, -1, 0], dtype=torch.int32), pages["k"].clone(),
                                     torch.tensor([0, 1, 2], dtype=torch.int64))
        mods["page_pick"].rescale(q, torch.zeros(b, hq), torch.zeros(b, hq))
        ring = 4 * 2 * 8  # slots for 4 x k, k = 8 pages a row
        mods["slots"].take_slots(torch.zeros(b, 8, dtype=torch.int32), torch.full((b,), 8, dtype=torch.int32),
                                 torch.full((n + 1,), -1, dtype=torch.int32), torch.full((ring + 1,), -1, dtype=torch.int32),
                                 torch.zeros((), dtype=torch.int64), torch.empty(2 * ring + 1, dtype=torch.int32), ring)
    # pages of 8 tokens (the tables' tiles hold one or two of 16): more pages a step, so that P @ V
    # still reduces over 16 tokens (32 for int4)
    lens = torch.full((b,), n * 8 - 5, dtype=torch.int32)
    table = torch.arange(b * n, dtype=torch.int32).view(b, n).contiguous()
    q = torch.randn(b, hq, 64).half()
    for codec in ("fp16", "int4"):
        pages = _pages(codec, b * n, hq // 4, 64, 8)
        pd.paged_decode_sets(q, [(pages, table, lens)])
        pp.paged_prefill(torch.randn(16, hq, 64).half(), pages, table[0], n * 8)
    picks(mods["page_pick"])


if __name__ == "__main__":
    everything()
    sys.exit(1 if compile_recorded() else 0)
