"""GPU benchmark of kvguard's kernels: correctness on the GPU (fp8 included), the machine's
ceilings, and decode-step times against their memory floors and PyTorch SDPA.

    PYTHONPATH=. python3 benchmarks/kernels/gpu_bench.py [--sweep [--adopt]] [--grid full|quick|long|none] [--out DIR]
    PYTHONPATH=. python3 benchmarks/kernels/gpu_bench.py --smoke      # CPU, Triton interpreter, tiny shapes
    PYTHONPATH=. python3 benchmarks/kernels/gpu_bench.py --variants '{"name": {"int8": {...}}}' [--shapes ...] [--codecs ...]
        # check named config overrides against the reference, then time them (with SDPA) per shape
    PYTHONPATH=. python3 benchmarks/kernels/gpu_bench.py --kernel prefill --variants '{"name": {"all": {"block_m": 128}}}' \
        --shapes llama3-8b:16384:2048     # the same for paged_prefill's configs, shapes model:L:T
    ncu ... python3 benchmarks/kernels/gpu_bench.py --once llama3-8b:131072:8 --codecs int8   # one call, for a profiler

Every time is one layer's decode step (or, in the prefill table, one layer's attention of a prompt
chunk: its T queries over the sequence's L tokens, causal), measured by replaying a CUDA graph of R calls over R
disjoint copies of the data (R chosen so that R copies are several times the L2), median of
the replays divided by R. Floors are the bytes a variant must read over the copy bandwidth
measured in the same run ("read floors": over the read-only bandwidth). Imports the kernels and
the codecs' rotation only (torch + triton).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; kernels/ fixes the interpreter for NumPy >= 2.4
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

import kvguard.kernels.paged_decode as paged_decode_module  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from kvguard.kernels import quantize as ref  # noqa: E402
from kvguard.kernels._checks import KernelArgError  # noqa: E402
from kvguard.kernels.compact import compact_pages, compact_pages_ref  # noqa: E402
from kvguard.kernels.paged_decode import paged_decode, paged_decode_ref  # noqa: E402
from kvguard.kernels.paged_prefill import paged_prefill, paged_prefill_ref  # noqa: E402
from kvguard.kernels.quantize_scatter import quantize_scatter, quantize_scatter_ref  # noqa: E402

from benchmarks._lib.floors import ceilings  # noqa: E402
from benchmarks._lib.report import write_json  # noqa: E402
from benchmarks._lib.timing import time_calls  # noqa: E402
from kvguard.compress.codecs.rotation import Rotation  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"
MODELS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (Hq, H, D)
S = 16
CODECS = ("int8", "fp8", "int4")
GB = 1e9


# --- timing -----------------------------------------------------------------------------------


def time_unless_refused(row: dict, name: str, calls, what: str = "") -> bool:
    """row[name] = time_calls(calls), or inf when the kernel refuses the tile (int4 with one page
    per warp, say): the first call tells. Returns whether it was timed."""
    try:
        calls[0]()
    except KernelArgError as e:
        print(f"   {what}{name}: refused ({e})", flush=True)
        row[name] = math.inf
        return False
    row[name] = time_calls(calls)
    return True


def kernel_times(calls) -> dict:
    """{kernel name: device seconds per call}, from torch.profiler over the calls run once
    (eagerly: the kernels' own times; launch gaps show only in time_calls' graph)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in calls:
            c()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            out[e.key] = e.self_device_time_total / 1e6 / len(calls)
    return out


# --- data ----------------------------------------------------------------------------------------


def pool_bytes(codec: str, tokens: int, h: int, d: int) -> int:
    """Bytes of K/V pages holding `tokens` tokens of h heads: what decode must read."""
    pages = tokens // S
    if codec in ("bf16", "16bit"):
        return 2 * tokens * h * d * 2
    if codec in ("int8", "fp8"):
        return 2 * tokens * h * d + pages * h * d * 2 + tokens * h * 2
    return tokens * h * d + 2 * pages * h * d * 2 + 2 * tokens * h * (d // ref.INT4_GROUP) * 2


def quantized_pool(pool16: dict, codec: str) -> dict:
    p, h, s, d = pool16["k"].shape
    z = torch.zeros(1, h, s, d, device=DEV, dtype=torch.float16)
    fields = ref.encode_int4(z, z) if codec == "int4" else ref.encode_int8(
        z, z, dtype=torch.float8_e4m3fn if codec == "fp8" else torch.int8)
    out = {n: torch.empty((p, *t.shape[1:]), dtype=t.dtype, device=DEV) for n, t in fields.items()}
    quantize_scatter(pool16["k"], pool16["v"], torch.arange(p, device=DEV, dtype=torch.int32), out)
    return out


def outlier(shape, dtype=torch.bfloat16):
    x = torch.randn(shape, device=DEV, dtype=dtype)
    x[..., 3] *= 20
    return x


# --- correctness on the device --------------------------------------------------------------------


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_all() -> list[str]:
    """Each kernel against its reference at model shapes; fp8 codes included (real GPU stores)."""
    lines, ok = [], True
    g = torch.Generator(device="cpu").manual_seed(0)
    for model, (hq, h, d) in MODELS.items():
        b, maxp = 3, (40 if SMOKE else 300)
        k, v = outlier((b * maxp, h, S, d)), outlier((b * maxp, h, S, d))
        pool = {"k": k, "v": v}
        lens = torch.tensor([maxp * S - 5, 1, maxp * S // 3], dtype=torch.int32, device=DEV)
        table = torch.randperm(b * maxp, generator=g).reshape(b, maxp).to(torch.int32).to(DEV)
        q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
        for codec in ("16bit",) + CODECS:
            pages = pool if codec == "16bit" else quantized_pool(pool, codec)
            if codec != "16bit":  # quantize_scatter vs the reference encoder, all fields
                want = {n: torch.zeros_like(t) for n, t in pages.items()}
                quantize_scatter_ref(k, v, torch.arange(b * maxp, device=DEV), want)
                bad = [n for n in pages if not _fields_close(pages[n], want[n])]
                ok &= not bad
                lines.append(f"check quantize_scatter {model} {codec}: {'ok' if not bad else 'MISMATCH ' + str(bad)}")
            out, lse, mass = paged_decode(q, pages, table, lens, return_mass=True)
            r_out, r_lse, r_mass = paged_decode_ref(q, pages, table, lens, return_mass=True)
            e = (rel(out, r_out), (lse - r_lse).abs().max().item(), (mass - r_mass).abs().max().item())
            good = e[0] < 5e-3 and e[1] < 5e-2 and e[2] < 5e-3
            ok &= good
            lines.append(f"check decode  {model} {codec:5s}: out rel {e[0]:.1e} lse {e[1]:.1e} mass {e[2]:.1e}"
                         f" {'ok' if good else 'FAIL'}")
            t_len = 200 if SMOKE else 700
            qp = torch.randn(t_len, hq, d, device=DEV, dtype=torch.bfloat16)
            o, l = paged_prefill(qp, pages, table[0], int(lens[0]))
            ro, rl = paged_prefill_ref(qp, pages, table[0], int(lens[0]))
            good = rel(o, ro) < 5e-3
            ok &= good
            lines.append(f"check prefill {model} {codec:5s}: out rel {rel(o, ro):.1e} {'ok' if good else 'FAIL'}")
            if codec != "16bit":
                a = {n: t.clone() for n, t in pages.items()}
                w = {n: t.clone() for n, t in pages.items()}
                src = torch.randperm(40 * S, generator=g)[: 16 * S].to(torch.int32).to(DEV)
                dst = torch.arange(60, 76, device=DEV, dtype=torch.int32)
                compact_pages(a, src, dst)
                compact_pages_ref(w, src, dst)
                bad = [n for n in a if not _fields_close(a[n], w[n])]
                ok &= not bad
                lines.append(f"check compact {model} {codec}: {'ok' if not bad else 'MISMATCH ' + str(bad)}")
    for codec in CODECS:  # a rotating codec through the whole cache: kernel path against reference path
        e = check_rotating_cache(codec)
        good = e < 1e-2  # bf16 K/V and outputs (eps 2^-8), through compactions
        ok &= good
        lines.append(f"check cache {codec}+rot kernels vs reference: out rel {e:.1e} {'ok' if good else 'FAIL'}")
    lines.append("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return lines


def check_rotating_cache(codec: str) -> float:
    """A prompt, decode steps (attend_step) and a chunk through CacheManager with `codec`
    rotating and H2O compacting per head, once on the kernels and once on the reference path, on
    this device (bf16 K/V): the outputs' relative difference."""
    from kvguard.cache import CacheConfig, CacheManager
    from kvguard.types import Subject

    g = torch.Generator(device="cpu").manual_seed(7)
    k, v = (torch.randn(300, 2, 64, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    q = torch.randn(300, 8, 64, generator=g).to(DEV, torch.bfloat16)

    def run(use_kernels: bool) -> torch.Tensor:
        m = CacheManager(CacheConfig(num_layers=2, num_kv_heads=2, num_query_heads=8, head_dim=64, num_pages=64,
                                     dtype=torch.bfloat16, device=DEV, codec=codec, fp_sink=4, fp_window=32,
                                     codec_options={"rotate": True}, use_kernels=use_kernels, evictor="h2o",
                                     evictor_options={"budget": 160, "sink": 4, "window": 32}))
        seq, outs = m.open(Subject("t", "u", "s")), []
        for lo, hi in [(0, 120)] + [(i, i + 1) for i in range(120, 200)] + [(200, 260)]:
            for layer in range(2):
                m.append(seq, layer, k[lo:hi], v[lo:hi])
                if hi - lo == 1:
                    outs.append(m.attend_step([seq], layer, q[lo:hi]).float())
                else:
                    outs.append(m.attend(seq, layer, q[lo:hi]).float())
        return torch.cat([o.flatten() for o in outs])

    return rel(run(True), run(False))


def _fields_close(a, b) -> bool:
    """Scales equal, codes equal but for a rare ±1 (ties); prints what differs otherwise."""
    if a.dtype in (torch.float16, torch.float32):
        diff = (a.float() - b.float()).abs()
        ok = torch.equal(a, b)
    elif a.dtype == torch.float8_e4m3fn and not GPU:
        return True  # the interpreter converts float8 itself
    else:
        def ints(t):
            return ref.unpack4(t).int() if t.dtype == torch.uint8 else t.view(torch.uint8).int() \
                if t.dtype != torch.int8 else t.int()
        diff = (ints(a) - ints(b)).abs()
        ok = diff.max().item() <= 1 and (diff > 0).float().mean().item() < 1e-3
    if not ok:
        bad = (diff > 0).nonzero()
        print(f"   {a.dtype}: {len(bad)} of {diff.numel()} differ, max {diff.max().item()}, first at "
              f"{bad[:3].tolist()}: {a[tuple(bad[0])].float().item()} vs {b[tuple(bad[0])].float().item()}")
    return ok


# --- decode benchmark ------------------------------------------------------------------------------


# PyTorch SDPA on contiguous bf16 K/V, every backend this machine has: the query group folded
# into the query length (q [B, H, group, D]: one kernel call per KV head's group) and, where the
# backend takes it, native GQA (q [B, Hq, 1, D] with enable_gqa). "sdpa" is the fastest of them.
SDPA_VARIANTS = (("flash", "FLASH_ATTENTION", False), ("efficient", "EFFICIENT_ATTENTION", False),
                 ("cudnn", "CUDNN_ATTENTION", False), ("flash_gqa", "FLASH_ATTENTION", True),
                 ("efficient_gqa", "EFFICIENT_ATTENTION", True), ("cudnn_gqa", "CUDNN_ATTENTION", True))


def sdpa_baselines(row, q, reps, batch, hq, h, d, length) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kc = torch.randn(reps * batch, h, length, d, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    folded = q.reshape(reps, batch, h, hq // h, d)
    native = q.reshape(reps, batch, hq, 1, d)
    for name, backend, gqa in SDPA_VARIANTS:
        qs, kind = (native if gqa else folded), getattr(SDPBackend, backend)

        def call(i, qs=qs, kind=kind, gqa=gqa):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(qs[i], kc[i * batch:(i + 1) * batch],
                                                      vc[i * batch:(i + 1) * batch], enable_gqa=gqa)

        try:
            call(0)
            torch.cuda.synchronize()
        except RuntimeError:  # this backend refuses the shape or the GQA form
            continue
        time_unless_refused(row, "sdpa_" + name, [lambda i=i: call(i) for i in range(reps)])
    timed = {n: row["sdpa_" + n] for n, _, _ in SDPA_VARIANTS if "sdpa_" + n in row}
    if timed:
        best = min(timed, key=timed.get)
        row["sdpa"], row["sdpa_best"] = timed[best], best
    del kc, vc


def bench_decode(model, length, batch, copy_bw, configs=None, with_baselines=True, read_bw=None,
                 codecs=("16bit",) + CODECS, profile=False) -> dict:
    hq, h, d = MODELS[model]
    kv16 = pool_bytes("bf16", length * batch, h, d)
    reps = max(1, min(64, math.ceil((512e6 if GPU else 1) / kv16)))
    pages_per_seq = length // S
    p = reps * batch * pages_per_seq
    row = {"model": model, "L": length, "B": batch, "kv16_GB": kv16 / GB, "reps": reps}
    q = torch.randn(reps, batch, hq, d, device=DEV, dtype=torch.bfloat16)

    if with_baselines and GPU:
        sdpa_baselines(row, q, reps, batch, hq, h, d, length)

    pool = {"k": outlier((p, h, S, d)), "v": outlier((p, h, S, d))}
    perm = torch.randperm(p, device=DEV).to(torch.int32).reshape(reps, batch, pages_per_seq)
    lens = torch.full((batch,), length, dtype=torch.int32, device=DEV)

    def run(pages, name, **kw):
        calls = [lambda i=i: paged_decode(q[i], pages, perm[i], lens, **kw) for i in range(reps)]
        if time_unless_refused(row, name, calls) and profile:
            row[name + " kernels"] = kernel_times(calls)

    rot = Rotation(d, DEV, torch.bfloat16)

    if "16bit" in codecs:
        for cfg_name, cfg in (configs or {"": None}).items():
            run(pool, "16bit" + cfg_name, config=cfg and cfg.get("16bit"))
    for codec in CODECS:
        if codec not in codecs:
            continue
        pages = quantized_pool(pool, codec)
        for cfg_name, cfg in (configs or {"": None}).items():
            run(pages, codec + cfg_name, config=cfg and cfg.get(codec))
        if codec == "int4" and not configs:  # a rotating codec: q rotated in, the output back
            time_unless_refused(row, "int4+rot", [lambda i=i: rot.inverse(paged_decode(rot(q[i]), pages, perm[i], lens)[0])
                                                  for i in range(reps)])
        if codec == "int8" and not configs:
            run(pages, "int8+mass", return_mass=True)
            if with_baselines and GPU and kv16 * reps <= 4e9:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def deq_sdpa(i):  # PyTorch: gather the pages, dequantize, SDPA
                    ids = perm[i].reshape(-1).long()
                    kk, vv = ref.decode_int8({n: t[ids] for n, t in pages.items()}, out_dtype=torch.bfloat16)
                    kk = kk.reshape(batch, pages_per_seq, h, S, d).transpose(1, 2).reshape(batch, h, length, d)
                    vv = vv.reshape(batch, pages_per_seq, h, S, d).transpose(1, 2).reshape(batch, h, length, d)
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(q[i].reshape(batch, h, hq // h, d), kk, vv)

                row["deq_sdpa"] = time_calls([lambda i=i: deq_sdpa(i) for i in range(reps)])
        del pages
    for name in ("16bit",) + CODECS:
        row[f"floor_{name}"] = pool_bytes(name, length * batch, h, d) / (copy_bw * GB)
        if read_bw:
            row[f"read_floor_{name}"] = pool_bytes(name, length * batch, h, d) / (read_bw * GB)
    del pool
    if GPU:
        torch.cuda.empty_cache()
    return row


# --- prefill benchmark -----------------------------------------------------------------------------


def causal_pairs(length: int, chunk: int) -> int:
    """(query, key) pairs a chunk of the last `chunk` of `length` tokens attends, causally."""
    return chunk * (length - chunk) + chunk * (chunk + 1) // 2


def _sdpa_prefill(q, k, v):
    """PyTorch SDPA, flash backend, the chunk's queries bottom-right aligned on the keys. GQA by
    enable_gqa where the flash backend takes it; else the caller repeats K/V's heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]),
                                              enable_gqa=k.shape[-3] != q.shape[-3])


def bench_prefill(model, length, chunk, configs=None, with_baselines=True, codecs=("16bit",) + CODECS) -> dict:
    """One layer's attention of a prompt chunk: the last `chunk` queries of one sequence of `length`
    tokens over its pages, causal (paged_prefill), against SDPA on contiguous bf16 K/V and, for int8,
    the pages gathered and dequantized first, then SDPA. Times in seconds per call, as bench_decode's
    (a graph of R calls over R copies of the data)."""
    hq, h, d = MODELS[model]
    kv16 = pool_bytes("bf16", length, h, d)
    reps = max(1, min(16, math.ceil((256e6 if GPU else 1) / kv16)))
    pps = length // S
    row = {"model": model, "L": length, "T": chunk, "reps": reps,
           "tflop": 4 * hq * d * causal_pairs(length, chunk) / 1e12}
    q = torch.randn(reps, chunk, hq, d, device=DEV, dtype=torch.bfloat16)
    qs = q.transpose(1, 2)  # [R, Hq, T, D] views for SDPA
    if with_baselines and GPU:
        kc = torch.randn(reps, h, length, d, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        try:
            _sdpa_prefill(qs[:1], kc[:1], vc[:1])
            row["sdpa_gqa"] = "enable_gqa"
        except RuntimeError:  # the flash backend without enable_gqa: K/V repeated per query head (outside the timing)
            kc, vc = kc.repeat_interleave(hq // h, 1), vc.repeat_interleave(hq // h, 1)
            row["sdpa_gqa"] = "repeated K/V"
        row["sdpa"] = time_calls([lambda i=i: _sdpa_prefill(qs[i:i + 1], kc[i:i + 1], vc[i:i + 1])
                                  for i in range(reps)])
        del kc, vc
    pool = {"k": outlier((reps * pps, h, S, d)), "v": outlier((reps * pps, h, S, d))}
    perm = torch.randperm(reps * pps, device=DEV).to(torch.int32).reshape(reps, pps)

    def run(pages, name, cfg):
        calls = [lambda i=i: paged_prefill(q[i], pages, perm[i], length, config=cfg) for i in range(reps)]
        time_unless_refused(row, name, calls, "prefill ")

    for codec in codecs:
        pages = pool if codec == "16bit" else quantized_pool(pool, codec)
        for cfg_name, cfg in (configs or {"": None}).items():
            run(pages, codec + cfg_name, cfg and cfg.get(codec))
        if codec == "int8" and not configs and with_baselines and GPU:
            def deq_sdpa(i):  # gather the sequence's pages, dequantize, SDPA
                ids = perm[i].long()
                kk, vv = ref.decode_int8({n: t[ids] for n, t in pages.items()}, out_dtype=torch.bfloat16)
                kk = kk.transpose(0, 1).reshape(1, h, length, d)
                vv = vv.transpose(0, 1).reshape(1, h, length, d)
                if row["sdpa_gqa"] != "enable_gqa":
                    kk, vv = kk.repeat_interleave(hq // h, 1), vv.repeat_interleave(hq // h, 1)
                return _sdpa_prefill(qs[i:i + 1], kk, vv)

            row["deq_sdpa"] = time_calls([lambda i=i: deq_sdpa(i) for i in range(reps)])
        del pages
    del pool
    if GPU:
        torch.cuda.empty_cache()
    return row


PREFILL_COLS = ("sdpa", "deq_sdpa", "16bit", "int8", "fp8", "int4")


def prefill_table(rows) -> list[str]:
    head = (f"{'model':13s} {'L':>6s} {'T':>5s} {'TFLOP':>6s} | " + " ".join(f"{c:>9s}" for c in PREFILL_COLS)
            + " | TFLOP/s: sdpa  16bit  int8  int4 | sdpa/: 16bit  int8   fp8  int4")
    out = [head, "-" * len(head)]
    for r in rows:
        us = " ".join(f"{r[c] * 1e6:9.1f}" if c in r else f"{'-':>9s}" for c in PREFILL_COLS)
        rate = " ".join(f"{r['tflop'] / r[c]:5.0f}" if c in r else f"{'-':>5s}"
                        for c in ("sdpa", "16bit", "int8", "int4"))
        sp = " ".join(f"{r['sdpa'] / r[c]:5.2f}" if "sdpa" in r and c in r else f"{'-':>5s}"
                      for c in ("16bit", "int8", "fp8", "int4"))
        out.append(f"{r['model']:13s} {r['L']:6d} {r['T']:5d} {r['tflop']:6.3f} | {us} |        {rate} |       {sp}")
    return out


# Tile configs the sweep times: (pages, warps, stages, programs per SM, codes loaded as int32 words,
# register cap or 0).
SWEEP_TILES = [(4, 2, 3, 8, False, 0), (4, 2, 3, 10, False, 0), (2, 2, 3, 12, True, 0), (2, 2, 3, 16, True, 128),
               (1, 2, 3, 16, True, 0), (1, 1, 3, 11, True, 0), (1, 1, 3, 22, True, 0), (1, 1, 3, 11, False, 0)]
OLD_DEFAULT = {"16bit": (4, 4, 3, 8), "quantized": (4, 2, 3, 8)}  # the defaults before the per-codec sweep


def _old_splits(batch, heads, length, block_tokens, pps, min_split=256):
    """The split count of the rule before it rounded down (ceil of programs_per_sm * SMs / (B * H))."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if GPU else 4
    want = max(1, -(-pps * sms // (batch * heads)))
    want = min(want, max(1, length // min_split))
    step = -(-(-(-length // want)) // block_tokens) * block_tokens
    return -(-length // step)


def sweep(copy_bw, adopt=False) -> list[str]:
    """Time each codec under each tile config of SWEEP_TILES and under the old defaults with the old
    split rule ('old'); with adopt, make each codec's best config (geometric mean of the times over
    the shapes of one head_dim) the default for that head_dim for the rest of the run."""
    import kvguard.kernels.paged_decode as pd

    def cfg(pg, w, st, pps, words=True, maxnreg=0):
        # every key set: what a config leaves out comes from the defaults (a register cap too)
        return {"pages": pg, "num_warps": w, "num_stages": st, "programs_per_sm": pps, "words": words,
                "maxnreg": maxnreg, "fill": "down", "warp_split": False, "transposed": False, "pairs": False}

    names = [f"p{pg}w{w}s{st}x{pps}{'' if words else 'b'}{f'r{r}' if r else ''}"
             for pg, w, st, pps, words, r in SWEEP_TILES]
    shapes = ([("llama3-8b", 131072, 1), ("llama3-8b", 32768, 8), ("llama3-8b", 131072, 8), ("llama3-8b", 16384, 64),
               ("smollm2-135m", 131072, 8), ("smollm2-135m", 32768, 64)] if GPU else
              [("llama3-8b", 256, 1), ("smollm2-135m", 256, 1)])
    lines, logs, count = [], {}, {}
    for model, length, batch in shapes:
        h, d = MODELS[model][1:]
        grid = {" " + n: {c: cfg(*t) for c in ("16bit",) + CODECS} for n, t in zip(names, SWEEP_TILES)}
        grid[" old"] = {}
        for c in ("16bit",) + CODECS:
            pg, w, st, pps = OLD_DEFAULT["16bit" if c == "16bit" else "quantized"]
            grid[" old"][c] = {**cfg(pg, w, st, pps, False), "splits": _old_splits(batch, h, length, pg * S, pps)}
        row = bench_decode(model, length, batch, copy_bw, configs=grid, with_baselines=False)
        count[d] = count.get(d, 0) + 1
        for codec in ("16bit",) + CODECS:
            floor = row[f"floor_{codec}"]
            for n in names + ["old"]:
                logs.setdefault((d, codec), {}).setdefault(n, 0.0)
                logs[d, codec][n] += math.log(row[f"{codec} {n}"])
            best = sorted((row[f"{codec} {n}"], n) for n in names + ["old"])
            lines.append(f"sweep {model} L={length} B={batch} {codec:5s} old={row[f'{codec} old'] * 1e6:.1f}us "
                         + " ".join(f"{n}={t / floor:.2f}" for t, n in best))
            print(lines[-1], flush=True)
    for (d, codec), lg in logs.items():
        gm = {n: math.exp((lg[n] - lg["old"]) / count[d]) for n in names}
        win = min(gm, key=gm.get)
        lines.append(f"sweep D={d} {codec:5s} time / old, geometric mean over the shapes: "
                     + " ".join(f"{n}={gm[n]:.3f}" for n in sorted(gm, key=gm.get)))
        if adopt:
            table = pd.SMALL_HEAD_CONFIG if d <= 64 else pd.DEFAULT_CONFIG
            table[codec] = cfg(*SWEEP_TILES[names.index(win)])
            pd._TILES.clear()  # tiles chosen under the old table
            lines.append(f"adopted for {codec}, head_dim {d}: {table[codec]}")
    return lines


# --- named tile-config variants (--variants) -------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """'llama3-8b:131072:8,smollm2-135m:16384:1' -> [(model, L, B), ...]."""
    out = []
    for item in text.split(","):
        m, length, b = item.split(":")
        out.append((m, int(length), int(b)))
    return out


def variant_configs(spec: dict, d: int = 128) -> dict:
    """{name: {codec or 'all', optionally + '@64' for head_dim <= 64 only: cfg}} -> {' ' + name:
    {codec: cfg}} for bench_decode at head_dim d; a codec a variant leaves out runs with its
    default config."""
    sfx = ["", "@64"] if d <= 64 else [""]
    grid = {}
    for name, per in spec.items():
        grid[" " + name] = {c: {k: v for x in sfx for key in ("all", c) for k, v in per.get(key + x, {}).items()}
                            for c in ("16bit",) + CODECS}
    return grid


def check_variants(spec: dict, codecs) -> list[str]:
    """Each variant against the reference at both models' head shapes, all codecs, odd lengths."""
    lines, g = [], torch.Generator(device="cpu").manual_seed(1)
    for model, (hq, h, d) in MODELS.items():
        grid = variant_configs(spec, d)
        b, maxp = 3, 40
        k, v = outlier((b * maxp, h, S, d)), outlier((b * maxp, h, S, d))
        lens = torch.tensor([maxp * S - 5, 1, maxp * S // 3], dtype=torch.int32, device=DEV)
        table = torch.randperm(b * maxp, generator=g).reshape(b, maxp).to(torch.int32).to(DEV)
        q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
        for codec in codecs:
            pages = {"k": k, "v": v} if codec == "16bit" else quantized_pool({"k": k, "v": v}, codec)
            r_out, r_lse = paged_decode_ref(q, pages, table, lens)
            for name, cfgs in grid.items():  # the split the shape gives (more than one here)
                out, lse = paged_decode(q, pages, table, lens, config=cfgs[codec])
                e = (rel(out, r_out), (lse - r_lse).abs().max().item())
                # the next variant's outputs likely reuse these blocks: one that leaves out or lse
                # unwritten must not pass on this one's results
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                if not (e[0] < 5e-3 and e[1] < 5e-2):
                    lines.append(f"variant{name} {model} {codec}: FAIL out {e[0]:.1e} lse {e[1]:.1e}")
    lines.append(f"variants checked: {'ALL OK' if not lines else 'FAILURES'}")
    return lines


def compiled_decode_kernels() -> list[str]:
    """Registers and spills of every decode kernel compiled in this process (Triton's cache)."""
    out = []
    for fn in (paged_decode_module._decode_kernel, paged_decode_module._decode_kernel_warps,
               paged_decode_module._decode_kernel_t):
        for cache in getattr(fn, "device_caches", {}).values():
            for key, k in cache[0].items():
                md = k.metadata
                out.append(f"{fn.__name__} warps={md.num_warps} stages={md.num_stages} "
                           f"maxnreg={getattr(md, 'maxnreg', None)} regs={k.n_regs} spills={k.n_spills} "
                           f"shared={md.shared} key={str(key)[-160:]}")
    return out


def run_variants(spec: dict, shapes, copy_bw, read_bw, codecs, profile=False) -> list[str]:
    lines = check_variants(spec, codecs)
    print("\n".join(lines), flush=True)
    rows = []
    for model, length, batch in shapes:
        grid = variant_configs(spec, MODELS[model][2])
        names = list(grid)
        row = bench_decode(model, length, batch, copy_bw, configs=grid, read_bw=read_bw, codecs=codecs,
                           profile=profile)
        rows.append(row)
        for codec in codecs:
            fl = row[f"floor_{codec}"]
            cells = " ".join(f"{n.strip()}={row[codec + n] * 1e6:.1f}us/{row[codec + n] / fl:.2f}" for n in names)
            sd = f" sdpa={row['sdpa'] * 1e6:.1f}us" if "sdpa" in row else ""
            lines.append(f"{model} L={length} B={batch} {codec:5s}{sd} {cells}")
            for n in names if profile else ():  # kernel by kernel; the rest of the step is between kernels
                ks = row.get(codec + n + " kernels", {})
                rest = row[codec + n] - sum(ks.values())
                lines.append(f"    {n.strip()}: " + ", ".join(f"{k[:40]} {v * 1e6:.1f}" for k, v in ks.items())
                             + f", between kernels {rest * 1e6:.1f} us")
            print("\n".join(lines[-1 - len(names) * profile:]), flush=True)
    return lines + compiled_decode_kernels()


def run_prefill_variants(spec: dict, shapes, codecs) -> list[str]:
    """--variants --kernel prefill: each named config (paged_prefill's) checked against the reference,
    then timed beside SDPA on shapes model:L:T."""
    lines, g = [], torch.Generator(device="cpu").manual_seed(2)
    for model, (hq, h, d) in MODELS.items():
        grid = variant_configs(spec, d)
        maxp = 40
        pool = {"k": outlier((maxp, h, S, d)), "v": outlier((maxp, h, S, d))}
        table = torch.randperm(maxp, generator=g).to(torch.int32).to(DEV)
        q = torch.randn(100, hq, d, device=DEV, dtype=torch.bfloat16)
        for codec in codecs:
            pages = pool if codec == "16bit" else quantized_pool(pool, codec)
            r_out, _ = paged_prefill_ref(q, pages, table, maxp * S - 5)
            for name, cfgs in grid.items():
                try:
                    out, _ = paged_prefill(q, pages, table, maxp * S - 5, config=cfgs[codec])
                except KernelArgError as e:
                    lines.append(f"prefill variant{name} {model} {codec}: refused ({e})")
                    continue
                if not rel(out, r_out) < 5e-3:
                    lines.append(f"prefill variant{name} {model} {codec}: FAIL out {rel(out, r_out):.1e}")
    lines.append(f"prefill variants checked: {'ALL OK' if not any('FAIL' in x for x in lines) else 'FAILURES'}")
    print("\n".join(lines), flush=True)
    for model, length, chunk in shapes:
        grid = variant_configs(spec, MODELS[model][2])
        row = bench_prefill(model, length, chunk, configs=grid, codecs=codecs)
        for codec in codecs:
            cells = " ".join(f"{n.strip()}={row[codec + n] * 1e6:.1f}us/{row['tflop'] / row[codec + n]:.0f}TF"
                             for n in grid)
            sd = f" sdpa={row['sdpa'] * 1e6:.1f}us/{row['tflop'] / row['sdpa']:.0f}TF" if "sdpa" in row else ""
            lines.append(f"prefill {model} L={length} T={chunk} {codec:5s}{sd} {cells}")
            print(lines[-1], flush=True)
    return lines


def bench_quantize(copy_bw, warps=(None,)) -> list[str]:
    h, d, n = 8, 128, (16384 if GPU else 8)
    k, v = outlier((n, h, S, d)), outlier((n, h, S, d))
    lines = []
    for codec in CODECS:
        pages = quantized_pool({"k": k[:1], "v": v[:1]}, codec)
        pages = {f: torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=DEV) for f, t in pages.items()}
        dst = torch.randperm(n, device=DEV).to(torch.int32)
        for w in warps:
            kw = {} if w is None else {"num_warps": w}
            t = time_calls([lambda: quantize_scatter(k, v, dst, pages, **kw)], min_total_s=0.1)
            nbytes = pool_bytes("bf16", n * S, h, d) + pool_bytes(codec, n * S, h, d)
            lines.append(f"quantize_scatter {codec:5s}{'' if w is None else f' w{w}'} {n} pages x 8 heads x 16 x 128: "
                         f"{t * 1e6:8.1f} us {nbytes / t / GB:7.0f} GB/s = {nbytes / t / GB / copy_bw:.0%} of copy")
    return lines


def table(rows) -> list[str]:
    """Times in µs; x/rfl = time over the read floor (bytes / read-only bandwidth); :sdpa = the
    fastest SDPA backend's time over the variant's (speed-up); cudnn_gqa = cuDNN with native GQA."""
    cols = ["sdpa", "cudnn_gqa", "deq_sdpa", "16bit", "int8", "fp8", "int4", "int4+rot", "int8+mass"]
    codecs = ("16bit", "int8", "fp8", "int4")
    head = (f"{'model':13s} {'L':>6s} {'B':>3s} {'KV16GB':>6s} {'best sdpa':>13s} | "
            + " ".join(f"{c:>9s}" for c in cols)
            + " | 16b/rfl i8/rfl f8/rfl i4/rfl | 16b:sdpa i8:sdpa f8:sdpa i4:sdpa")
    out = [head, "-" * len(head)]
    for r in rows:
        r = {**r, "cudnn_gqa": r.get("sdpa_cudnn_gqa")} if r.get("sdpa_cudnn_gqa") else r
        us = " ".join(f"{r[c] * 1e6:9.1f}" if r.get(c) else f"{'-':>9s}" for c in cols)
        fl = " ".join(f"{r[c] / r.get('read_floor_' + c, r['floor_' + c]):7.2f}" if c in r else f"{'-':>7s}"
                      for c in codecs)
        sp = " ".join(f"{r['sdpa'] / r[c]:8.2f}" if "sdpa" in r and c in r else f"{'-':>8s}" for c in codecs)
        out.append(f"{r['model']:13s} {r['L']:6d} {r['B']:3d} {r['kv16_GB']:6.2f} {r.get('sdpa_best', '-'):>13s} | "
                   f"{us} | {fl} | {sp}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time tile configs first")
    ap.add_argument("--adopt", action="store_true", help="with --sweep: use each codec's best config afterwards")
    ap.add_argument("--grid", default="full", choices=("full", "quick", "long", "ctx", "none"),
                    help="decode shapes to time (ctx: 16K, 32K and 128K tokens, both models)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks the script runs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", help="JSON {name: {codec or 'all': config}}: check and time these configs "
                    "on --shapes, then stop")
    ap.add_argument("--profile", action="store_true", help="with --variants: each kernel's time per call too")
    ap.add_argument("--codecs", default=",".join(("16bit",) + CODECS), help="codecs for --variants")
    ap.add_argument("--once", help="model:L:B: one decode call per codec of --codecs (config from --variants' "
                    "first entry), for a profiler; no timing")
    ap.add_argument("--shapes", default="llama3-8b:131072:1,llama3-8b:131072:8,llama3-8b:16384:64,"
                    "smollm2-135m:131072:8,smollm2-135m:16384:1", help="model:L:B,... for --variants (with "
                    "--kernel prefill: model:L:T, T the chunk's queries)")
    ap.add_argument("--kernel", default="decode", choices=("decode", "prefill"), help="the kernel --variants times")
    ap.add_argument("--prefill-grid", default="full", choices=("full", "none"),
                    help="prompt-chunk shapes to time after the decode table")
    args = ap.parse_args()
    info = {"device": torch.cuda.get_device_name() if GPU else "cpu", "torch": torch.__version__,
            "triton": triton.__version__}
    print(json.dumps(info), flush=True)
    codecs = tuple(args.codecs.split(","))
    if args.once:
        (model, length, batch), = parse_shapes(args.once)
        spec = json.loads(args.variants) if args.variants else {"default": {}}
        hq, h, d = MODELS[model]
        cfgs = next(iter(variant_configs(spec, d).values()))
        pool = {"k": outlier((batch * length // S, h, S, d)), "v": outlier((batch * length // S, h, S, d))}
        block_table = torch.randperm(batch * length // S, device=DEV).to(torch.int32).reshape(batch, -1)
        lens = torch.full((batch,), length, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, hq, d, device=DEV, dtype=torch.bfloat16)
        for codec in codecs:
            pages = pool if codec == "16bit" else quantized_pool(pool, codec)
            paged_decode(q, pages, block_table, lens, config=cfgs[codec])
            torch.cuda.synchronize()
        return
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read+write), read-only {ceil['read_GBps']:.0f} GB/s, "
          f"bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    if args.variants and args.kernel == "prefill":
        lines = run_prefill_variants(json.loads(args.variants), parse_shapes(args.shapes), codecs)
        with open(os.path.join(args.out, "prefill_variants.txt"), "w") as f:
            f.write("\n".join([json.dumps(info), f"ceilings {ceil}", args.variants] + lines) + "\n")
        return
    if args.variants:
        lines = run_variants(json.loads(args.variants), parse_shapes(args.shapes), ceil["copy_GBps"],
                             ceil["read_GBps"], codecs, profile=args.profile)
        with open(os.path.join(args.out, "variants.txt"), "w") as f:
            f.write("\n".join([json.dumps(info), f"ceilings {ceil}", args.variants] + lines) + "\n")
        return
    extra = []
    if args.sweep:  # first, so that the checks below run the configs adopted here
        extra += sweep(ceil["copy_GBps"], args.adopt)
        print("\n".join(extra), flush=True)
    checks = check_all()
    for line in checks:
        print(line, flush=True)
    quant = bench_quantize(ceil["copy_GBps"])
    print("\n".join(quant), flush=True)
    if args.smoke:
        grid = [("smollm2-135m", 256, 1), ("llama3-8b", 256, 2)]
    else:
        lengths = {"full": (1024, 4096, 16384, 32768, 131072), "quick": (1024, 16384, 131072),
                   "long": (16384, 131072), "ctx": (16384, 32768, 131072), "none": ()}[args.grid]
        models = ("llama3-8b",) if args.grid == "long" else MODELS
        grid = [(m, length, b) for m in models for length in lengths for b in (1, 8, 64)
                if pool_bytes("bf16", length * b, MODELS[m][1], MODELS[m][2]) <= 40e9]
    rows = []
    for m, length, b in grid:
        rows.append(bench_decode(m, length, b, ceil["copy_GBps"], read_bw=ceil["read_GBps"]))
        print(table(rows[-1:])[-1], flush=True)
    lines = table(rows) if rows else []
    print("\n" + "\n".join(lines))
    if args.smoke:
        pgrid = [("smollm2-135m", 256, 64)]
    else:
        pgrid = [] if args.prefill_grid == "none" else \
            [(m, length, t) for m in MODELS for length, t in ((4096, 512), (16384, 512), (16384, 2048), (65536, 2048))]
    prows = []
    for m, length, t in pgrid:
        prows.append(bench_prefill(m, length, t))
        print(prefill_table(prows[-1:])[-1], flush=True)
    plines = prefill_table(prows) if prows else []
    print("\n" + "\n".join(plines))
    write_json(args.out, "gpu_bench.json", {"info": info, "ceilings": ceil, "rows": rows, "prefill_rows": prows,
                                            "quantize": quant, "sweep": extra, "checks": checks,
                                            "decode_config": paged_decode_module.DEFAULT_CONFIG,
                                            "decode_config_small_head": paged_decode_module.SMALL_HEAD_CONFIG})
    with open(os.path.join(args.out, "gpu_bench_table.txt"), "w") as f:
        f.write("\n".join([json.dumps(info), f"ceilings {ceil}"] + checks[-1:] + quant + extra + lines + [""]
                          + plines) + "\n")


if __name__ == "__main__":
    main()
