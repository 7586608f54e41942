"""Paged decode attention: one query token per sequence over its K/V pages, any codec,
dequantized in registers, flash-decoding split over the context.

Pass 1 (grid B x H x splits): a program takes one sequence, one KV head with all of
its query heads (GQA: the group's heads are the rows of one tensor-core tile, as many
rows as the group rounded up to a power of two; Triton pads the MMA), and one slice of
the context; it writes a partial (out, lse) per split, or the final result when there
is one split. With warp_split, each warp of the program runs its own online softmax
over its own pages of every step (_decode_kernel_warps: no reductions across warps in
the loop), merged once at the end. With transposed (_decode_kernel_t, the tile of the
quantized codecs) the same, with the products turned around so that a warp's tokens, not
the padded group, fill the rows of the tensor-core tile. Pass 2 merges the splits by their
lse. The number of splits comes from shapes only (no host sync, so the call can be
captured in a CUDA graph): enough programs to fill the GPU.

H2O's per-key attention mass needs each key's probability under the final lse. Pass 1
then also stores the base-2 logits [B, Hq, L] (4 bytes per query head and key, about
1/8 of an int8 K page's bytes at group 4, D 128) and pass 3 reads them back with the
lse: one extra write and read of the logits, no second read of K.

Precision: q (times sm_scale), dequantized K/V and the probabilities enter the tensor
cores as fp16 (codes are exact in fp16, dequantized values round once), accumulation is
fp32. Values must lie within fp16's range, as the quantized codecs already require.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import quantize as ref
from ._checks import (
    INDEX_DTYPES,
    KIND,
    KernelArgError,
    check,
    check_decode,
    check_int4_tile,
    field_args,
    interpreting,
    pv_pages,
    softmax_scale,
    value_codec_of,
)
from ._launch import launch
from ._pages import attend_block, load_keys_f16, load_pages_f16, load_values_f16

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _decode_kernel(q, kp, ksp, kzp, vp, vsp, vzp, block_table, seq_lens, out, lse, logits, fin_out, fin_lse,
                   counters, qk_scale, bt_stride, split_tokens, max_len, ns, sp0,
                   H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                   KIND: tl.constexpr, GROUP: tl.constexpr, PAGES: tl.constexpr, SPLIT: tl.constexpr,
                   MASS: tl.constexpr, ON_GPU: tl.constexpr, FUSED: tl.constexpr, CH: tl.constexpr,
                   VKIND: tl.constexpr, VON_GPU: tl.constexpr):
    # q [B, Hq, D]; block_table [B, *]; out [B, Hq, D] (or [B, Hq, ns, D] fp32 if SPLIT);
    # lse [B, Hq] natural log (or [B, Hq, ns] base 2 if SPLIT); logits [B, Hq, max_len] if MASS;
    # split sp of this grid covers tokens [sp * split_tokens, ...) and writes partial sp0 + sp of
    # ns (more than this grid's when several page sets merge in one pass: paged_decode_sets);
    # with FUSED (and SPLIT) the last program of each (b, h) merges the splits into fin_out,
    # fin_lse [B, Hq, (D)], counting finished programs in counters [B * H] (see _finish);
    # KIND, ON_GPU the keys' codec and loads, VKIND, VON_GPU the values' (load_pages_f16)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    BN: tl.constexpr = PAGES * S
    seq_len = tl.load(seq_lens + b)
    lo = sp * split_tokens
    hi = tl.minimum(seq_len, lo + split_tokens)

    r = tl.arange(0, GP)  # rows: query heads h*G .. h*G+G-1, padded to GP (a power of two)
    hq = h * G + r
    row_ok = r < G
    d = tl.arange(0, D)
    qrow = b * (H * G) + hq
    qv = tl.load(q + qrow[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    qh = qv.to(tl.float16)  # [GP, D]

    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    bt = block_table + b.to(tl.int64) * bt_stride
    for start in range(lo, hi, BN):
        pi = start // S + tl.arange(0, PAGES)  # [PAGES] logical page index
        n = start + tl.arange(0, BN)  # [BN] token positions
        tok_ok = n < hi
        page = tl.load(bt + pi, mask=pi * S < hi, other=0).to(tl.int64)
        k, v, vs = load_pages_f16(kp, ksp, kzp, vp, vsp, vzp, page, tok_ok.reshape(PAGES, S), h,
                              H, S, D, PAGES, KIND, GROUP, ON_GPU, VKIND, VON_GPU)
        acc, m, l, s = attend_block(acc, m, l, qh, k, v, vs, tok_ok[None, :], qk_scale, VKIND == 1)
        if MASS:
            tl.store(logits + qrow[:, None].to(tl.int64) * max_len + n[None, :], s,
                     mask=row_ok[:, None] & tok_ok[None, :])

    _finish(acc, m, l, qrow, row_ok, d, out, lse, sp0 + sp, ns, fin_out, fin_lse, counters, b * H + h, D, SPLIT,
            FUSED, CH)


@triton.jit
def _decode_kernel_warps(q, kp, ksp, kzp, vp, vsp, vzp, block_table, seq_lens, out, lse, logits, fin_out,
                         fin_lse, counters, qk_scale, bt_stride, split_tokens, max_len, ns, sp0,
                         H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                         KIND: tl.constexpr, GROUP: tl.constexpr, PAGES: tl.constexpr, SPLIT: tl.constexpr,
                         MASS: tl.constexpr, ON_GPU: tl.constexpr, W: tl.constexpr, FUSED: tl.constexpr,
                         CH: tl.constexpr, VKIND: tl.constexpr, VON_GPU: tl.constexpr):
    # As _decode_kernel, but each of the W warps runs its own online softmax over its own
    # PAGES // W pages of every step (tensors [W, ...], the leading axis one warp each): no
    # reduction across warps inside the loop; the W partial results merge once at the end.
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    BW: tl.constexpr = (PAGES // W) * S  # tokens per warp and step
    BN: tl.constexpr = PAGES * S
    seq_len = tl.load(seq_lens + b)
    lo = sp * split_tokens
    hi = tl.minimum(seq_len, lo + split_tokens)

    r = tl.arange(0, GP)
    hq = h * G + r
    row_ok = r < G
    d = tl.arange(0, D)
    qrow = b * (H * G) + hq
    qv = tl.load(q + qrow[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q3 = tl.broadcast_to(qv.to(tl.float16)[None, :, :], (W, GP, D))

    m = tl.full([W, GP], float("-inf"), tl.float32)
    l = tl.zeros([W, GP], tl.float32)
    acc = tl.zeros([W, GP, D], tl.float32)
    bt = block_table + b.to(tl.int64) * bt_stride
    for start in range(lo, hi, BN):
        pi = start // S + tl.arange(0, PAGES)
        n = start + tl.arange(0, BN)
        tok_ok = n < hi
        page = tl.load(bt + pi, mask=pi * S < hi, other=0).to(tl.int64)
        k, v, vs = load_pages_f16(kp, ksp, kzp, vp, vsp, vzp, page, tok_ok.reshape(PAGES, S), h,
                                  H, S, D, PAGES, KIND, GROUP, ON_GPU, VKIND, VON_GPU)
        vis = tok_ok.reshape(W, 1, BW)
        s = tl.dot(q3, tl.trans(k.reshape(W, BW, D), (0, 2, 1))) * qk_scale  # [W, GP, BW]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a warp may not have seen a key yet
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, :, None])
        l = l * alpha + tl.sum(p, 2)
        if VKIND == 1:
            pv = (p * vs.reshape(W, 1, BW)).to(tl.float16)
        else:
            pv = p.to(tl.float16)
        acc = acc * alpha[:, :, None] + tl.dot(pv, v.reshape(W, BW, D))
        m = m_new
        if MASS:
            tl.store(logits + qrow[None, :, None].to(tl.int64) * max_len + n.reshape(W, 1, BW), s,
                     mask=row_ok[None, :, None] & vis)

    mt = tl.max(m, 0)
    mt = tl.where(mt == float("-inf"), 0.0, mt)
    wgt = tl.exp2(m - mt[None, :])  # [W, GP]; 0 for a warp that saw no key
    l = tl.sum(l * wgt, 0)
    acc = tl.sum(acc * wgt[:, :, None], 0)
    _finish(acc, mt, l, qrow, row_ok, d, out, lse, sp0 + sp, ns, fin_out, fin_lse, counters, b * H + h, D, SPLIT,
            FUSED, CH)


@triton.jit
def _decode_kernel_t(q, kp, ksp, kzp, vp, vsp, vzp, block_table, seq_lens, out, lse, logits, fin_out,
                     fin_lse, counters, qk_scale, bt_stride, split_tokens, max_len, ns, sp0,
                     H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                     KIND: tl.constexpr, GROUP: tl.constexpr, PAGES: tl.constexpr, SPLIT: tl.constexpr,
                     MASS: tl.constexpr, ON_GPU: tl.constexpr, W: tl.constexpr, FUSED: tl.constexpr,
                     CH: tl.constexpr, VKIND: tl.constexpr, VON_GPU: tl.constexpr, PEEL: tl.constexpr = False,
                     PDL: tl.constexpr = False, SPREAD: tl.constexpr = False):
    # As _decode_kernel_warps (each of the W warps its own pages and softmax), with the
    # products transposed: logits^T = K q^T ([BW, GP] per warp) and out^T += V^T p^T ([D, GP]).
    # The tokens fill the MMA's 16 rows and the group's query heads its 8 columns: no padded
    # rows (whose duplicated registers cost a register move per MMA operand), half the MMAs of
    # a group of 4 padded to 16 rows, and the softmax and rescale work on [BW, GP] and [D, GP].
    # PEEL: the loop runs the split's full steps without token masks, and one masked step after
    # it takes the rest (the masks' ISETP/SEL/PLOP3 were 7 % of the int8 loop's instructions).
    # SPREAD: the splits divide the row's own tokens, not split_tokens apiece of the table's
    # width (a table whose rows fill a varying, often small, part of it keeps every split busy)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    BN: tl.constexpr = PAGES * S
    seq_len = tl.load(seq_lens + b)
    if SPREAD:
        split_tokens = tl.cdiv(seq_len, tl.num_programs(2) * BN) * BN
    lo = sp * split_tokens
    hi = tl.minimum(seq_len, lo + split_tokens)

    r = tl.arange(0, GP)
    hq = h * G + r
    row_ok = r < G
    d = tl.arange(0, D)
    qrow = b * (H * G) + hq
    qv = tl.load(q + qrow[None, :] * D + d[:, None], mask=row_ok[None, :], other=0.0).to(tl.float32)  # [D, GP]
    qt = tl.broadcast_to(qv.to(tl.float16)[None, :, :], (W, D, GP))

    m = tl.full([W, GP], float("-inf"), tl.float32)
    l = tl.zeros([W, GP], tl.float32)
    acc = tl.zeros([W, D, GP], tl.float32)
    bt = block_table + b.to(tl.int64) * bt_stride
    if PEEL:
        full = lo + tl.maximum(hi - lo, 0) // BN * BN
        for start in range(lo, full, BN):
            acc, m, l = _t_step(acc, m, l, qt, start, hi, bt, kp, ksp, kzp, vp, vsp, vzp, logits, qrow, row_ok, h,
                                qk_scale, max_len, H, S, D, PAGES, W, KIND, GROUP, ON_GPU, MASS, False, VKIND,
                                VON_GPU)
        if full < hi:
            acc, m, l = _t_step(acc, m, l, qt, full, hi, bt, kp, ksp, kzp, vp, vsp, vzp, logits, qrow, row_ok, h,
                                qk_scale, max_len, H, S, D, PAGES, W, KIND, GROUP, ON_GPU, MASS, True, VKIND,
                                VON_GPU)
    else:
        for start in range(lo, hi, BN):
            acc, m, l = _t_step(acc, m, l, qt, start, hi, bt, kp, ksp, kzp, vp, vsp, vzp, logits, qrow, row_ok, h,
                                qk_scale, max_len, H, S, D, PAGES, W, KIND, GROUP, ON_GPU, MASS, True, VKIND,
                                VON_GPU)

    if PDL:  # the merge pass may be scheduled now; it waits for this grid before reading
        tl.extra.cuda.gdc_launch_dependents()
    mt = tl.max(m, 0)
    mt = tl.where(mt == float("-inf"), 0.0, mt)
    wgt = tl.exp2(m - mt[None, :])  # [W, GP]
    l = tl.sum(l * wgt, 0)
    acc = tl.trans(tl.sum(acc * wgt[:, None, :], 0))  # [GP, D]
    _finish(acc, mt, l, qrow, row_ok, d, out, lse, sp0 + sp, ns, fin_out, fin_lse, counters, b * H + h, D, SPLIT,
            FUSED, CH)


@triton.jit
def _t_step(acc, m, l, qt, start, hi, bt, kp, ksp, kzp, vp, vsp, vzp, logits, qrow, row_ok, h, qk_scale, max_len,
            H: tl.constexpr, S: tl.constexpr, D: tl.constexpr, PAGES: tl.constexpr, W: tl.constexpr,
            KIND: tl.constexpr, GROUP: tl.constexpr, ON_GPU: tl.constexpr, MASS: tl.constexpr,
            MASKED: tl.constexpr, VKIND: tl.constexpr, VON_GPU: tl.constexpr):
    # one step of _decode_kernel_t over the PAGES pages from token `start`: logits, online
    # softmax, out^T += V^T p^T. MASKED: tokens at or past hi are left out; without it every
    # token of the step must exist (no masks at all)
    BW: tl.constexpr = (PAGES // W) * S
    pi = start // S + tl.arange(0, PAGES)
    if MASKED:
        page = tl.load(bt + pi, mask=pi * S < hi, other=0).to(tl.int64)
        ok = (start + tl.arange(0, PAGES * S) < hi).reshape(PAGES, S)
    else:
        page = tl.load(bt + pi).to(tl.int64)
        ok = None
    k = load_keys_f16(kp, ksp, kzp, page, ok, h, H, S, D, PAGES, KIND, ON_GPU)
    s = tl.dot(k.reshape(W, BW, D), qt) * qk_scale  # [W, BW, GP]
    if MASKED:
        s = tl.where(ok.reshape(W, BW, 1), s, float("-inf"))
    # quantized values come as stored, V^T per page ([PAGES, D, S]); 16-bit ones [PAGES*S, D]
    v, vs = load_values_f16(vp, vsp, vzp, page, ok, h, H, S, D, PAGES, VKIND, GROUP, VON_GPU, VKIND != 0)
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None, :])
    l = l * alpha + tl.sum(p, 1)
    if VKIND == 1:
        pv = (p * vs.reshape(W, BW, 1)).to(tl.float16)
    else:
        pv = p.to(tl.float16)
    if VKIND != 0:
        vt = tl.permute(v.reshape(W, PAGES // W, D, S), (0, 2, 1, 3)).reshape(W, D, BW)
    else:
        vt = tl.trans(v.reshape(W, BW, D), (0, 2, 1))
    acc = acc * alpha[:, None, :] + tl.dot(vt, pv)
    if MASS:
        n = (start + tl.arange(0, PAGES * S)).reshape(W, BW, 1)
        at = logits + qrow[None, None, :].to(tl.int64) * max_len + n
        if MASKED:
            tl.store(at, s, mask=row_ok[None, None, :] & ok.reshape(W, BW, 1))
        else:
            tl.store(at, s, mask=row_ok[None, None, :])
    return acc, m_new, l


@triton.jit
def _finish(acc, m, l, qrow, row_ok, d, out, lse, sp, ns, fin_out, fin_lse, counters, cidx,
            D: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, CH: tl.constexpr):
    empty = l == 0.0  # split past the end of this sequence
    o = acc / tl.where(empty, 1.0, l)[:, None]
    lse2 = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
    if SPLIT:
        prow = qrow.to(tl.int64) * ns + sp
        tl.store(out + prow[:, None] * D + d[None, :], o, mask=row_ok[:, None])
        tl.store(lse + prow, lse2, mask=row_ok)
        if FUSED:
            # every thread's partial is stored before one thread's release at GPU scope (the
            # barrier, then the atomic's acq_rel); the program that finishes last for this (b, h)
            # acquires all of them, merges, and sets the counter back to 0 for the next call
            tl.debug_barrier()
            done = tl.atomic_add(counters + cidx, 1, sem="acq_rel", scope="gpu")
            if done == ns - 1:
                _merge_splits(out, lse, fin_out, fin_lse, qrow, row_ok, row_ok, d, ns, D, CH)
                tl.atomic_xchg(counters + cidx, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out + qrow[:, None] * D + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse + qrow, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def _merge_splits(part_out, part_lse, out, lse, qrow, row_ok, lse_ok, d, NS, D: tl.constexpr, CH: tl.constexpr):
    # rows qrow [R] of part_out [rows, NS, D] fp32 and part_lse [rows, NS] base 2 -> channels d [DB]
    # of out [rows, D] in out's dtype, and lse natural where lse_ok; CH splits at a time with a
    # running max. Partials other programs wrote are read through L2 (.cg), never an older copy
    # in this SM's L1.
    base = qrow.to(tl.int64) * NS
    m = tl.full([qrow.shape[0]], float("-inf"), tl.float32)
    tot = tl.zeros([qrow.shape[0]], tl.float32)
    acc = tl.zeros([qrow.shape[0], d.shape[0]], tl.float32)
    for c0 in range(0, NS, CH):
        i = c0 + tl.arange(0, CH)
        ok = row_ok[:, None] & (i < NS)[None, :]
        idx = base[:, None] + i[None, :]  # [R, CH]
        ls = tl.load(part_lse + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(ls, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(ls - m_use[:, None])  # 0 for empty splits
        o = tl.load(part_out + idx[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0,
                    cache_modifier=".cg")
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        tot = tot * alpha + tl.sum(w, 1)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    o = acc / tl.where(tot == 0.0, 1.0, tot)[:, None]
    tl.store(out + qrow[:, None].to(tl.int64) * D + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
    lse2 = m + tl.log2(tl.where(tot == 0.0, 1.0, tot))
    tl.store(lse + qrow, tl.where(tot == 0.0, float("-inf"), lse2 * 0.6931471805599453), mask=lse_ok)


@triton.jit
def _combine_kernel(part_out, part_lse, out, lse, NS, ROWS, D: tl.constexpr, R: tl.constexpr, DB: tl.constexpr,
                    CH: tl.constexpr, PDL: tl.constexpr = False):
    # grid (cdiv(ROWS, R), D // DB), ROWS = B * Hq: part_out [ROWS, NS, D] fp32, part_lse [ROWS, NS]
    # base 2 -> out [ROWS, D], lse natural; a program merges DB channels of R rows, CH splits at a
    # time (a tile of all splits at once would not fit in registers when a short batch is split
    # hundreds of times). At B = 1 this pass is on the critical path and bound by latency: a row's
    # channels are spread over programs so that up to 512 splits are one load per program, not a
    # chain of dependent chunks (llama3 32K x 1, 171 splits: 3.9 -> 2.3 us); with few splits and
    # many rows a program takes several (one 4-warp program a row of 4 splits: 7.5 us at B = 64).
    if PDL:
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * R + tl.arange(0, R)
    ok = rows < ROWS
    d = tl.program_id(1) * DB + tl.arange(0, DB)
    _merge_splits(part_out, part_lse, out, lse, rows, ok, ok & (tl.program_id(1) == 0), d, NS, D, CH)


@triton.jit
def _mass_kernel(logits, lse, seq_lens, mass, rows, positions, pos_stride, max_len, G: tl.constexpr,
                 GP: tl.constexpr, BLOCK: tl.constexpr, INTO: tl.constexpr):
    # grid (B, H, cdiv(max_len, BLOCK)): m[b, h, n] = sum_g 2^(logit[b, h*G+g, n] - lse2[b, h*G+g]);
    # stored to mass [B, H, max_len], or with INTO added into row b's buffer: rows [B, 3] int64 =
    # (address of an fp32 [H, cols] buffer, its stride between heads, cols), at column
    # positions[b, n] (skipped outside [0, cols))
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    n = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    r = tl.arange(0, GP)
    qrow = (b * H + h) * G + r
    live = n < tl.load(seq_lens + b)
    ok = live[None, :] & (r < G)[:, None]
    lse2 = tl.load(lse + qrow, mask=r < G, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # empty sequence: every key is masked anyway
    s = tl.load(logits + qrow[:, None].to(tl.int64) * max_len + n[None, :], mask=ok, other=float("-inf"))
    m = tl.sum(tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0), 0)
    if INTO:
        row = rows + b * 3
        cols = tl.load(row + 2)
        pos = tl.load(positions + b.to(tl.int64) * pos_stride + n, mask=live, other=-1).to(tl.int64)
        live = live & (pos >= 0) & (pos < cols)
        dst = tl.load(row).to(tl.pointer_type(tl.float32)) + h * tl.load(row + 1) + pos
        tl.store(dst, tl.load(dst, mask=live, other=0.0) + m, mask=live)
    else:
        tl.store(mass + (b * H + h).to(tl.int64) * max_len + n, m, mask=n < max_len)


# Tile shapes per codec: pages per loop step, warps per program, software-pipeline depth, how
# many programs per SM the context split aims for ('fill': 'down' rounds the split count down
# to at most that many; 'waves' takes programs_per_sm as the programs an SM holds at once and
# picks the split count that leaves the fewest slots idle), a register cap (with 'waves', one
# that keeps the return_mass variant, a few registers larger, at the same programs per SM),
# whether int8/fp8 codes are loaded as int32 words, 'rows' ('group': the group's query heads
# rounded up to a power of two; else 16), 'warp_split' (each warp its own pages and softmax),
# 'transposed' (as warp_split, with K q^T and V^T p^T: _decode_kernel_t), 'pairs' (int4: keys
# converted straight to channel pairs, see kernels/_pages.py), 'asm' (False: the portable
# int4 conversion instead of inline PTX), 'min_steps' (loop steps a split has at least, 4 unless
# given) and 'fused_merge' (the last program of each sequence and KV head merges the splits
# instead of _combine_kernel, 'fused_chunk' splits at a time; off: slower, see
# docs/benchmarks.md), 'peel' (transposed: full steps without token masks), 'pdl' (transposed:
# the merge pass is launched as a programmatic dependent of pass 1, scheduled once pass 1's
# programs leave their loops; sm_90+) and 'one_sequence' (keys that replace the others when the
# batch is one sequence: its splits' chains of steps are the whole latency; int8 at head_dim 128
# keeps 12 programs per SM, no register cap and no pdl there; int8, fp8 and int4 splits of two
# steps). Chosen by
# benchmarks/kernels/gpu_bench.py --variants on an H200; SMALL_HEAD_CONFIG is for head_dim <= 64. The
# kernels are latency-bound: what helped was fewer instructions per token (padded rows, masks and
# shared-memory transposes removed: quantized values are stored channel-major so that V^T comes
# straight from the page), no cross-warp reductions or barriers in the loop (one warp per program
# where registers allow), every load prefetched by the pipeline and more warps per SM (int8 and
# fp8: 16 one-warp programs at 128 registers, a little spill outside the loop, beat 12 without
# the cap at B >= 8); deeper pipelines were not faster. int4 tiles whose P @ V product reduces
# over fewer than MIN_INT4_PV_TOKENS tokens are refused (see kernels/_checks.py).
DEFAULT_CONFIG = {
    "16bit": {"pages": 4, "num_warps": 4, "num_stages": 3, "programs_per_sm": 8, "rows": "group"},
    "int8": {"pages": 2, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16, "fill": "waves", "rows": "group",
             "transposed": True, "peel": True, "words": True, "maxnreg": 128, "pdl": True,
             "one_sequence": {"programs_per_sm": 12, "maxnreg": 0, "pdl": False, "min_steps": 2}},
    "fp8": {"pages": 2, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16, "fill": "waves", "rows": "group",
            "transposed": True, "peel": True, "words": True, "maxnreg": 128, "pdl": True,
            "one_sequence": {"min_steps": 2}},
    "int4": {"pages": 2, "num_warps": 1, "num_stages": 3, "programs_per_sm": 12, "fill": "waves", "rows": "group",
             "transposed": True, "peel": True, "pairs": True, "maxnreg": 168, "one_sequence": {"min_steps": 2}},
}
SMALL_HEAD_CONFIG = {
    "16bit": {"pages": 1, "num_warps": 1, "num_stages": 3, "programs_per_sm": 11, "rows": "group"},
    "int8": {"pages": 2, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16, "fill": "waves", "rows": "group",
             "transposed": True, "peel": True, "words": True, "maxnreg": 128, "min_steps": 2},
    "fp8": {"pages": 2, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16, "fill": "waves", "rows": "group",
            "transposed": True, "peel": True, "words": True, "maxnreg": 128, "min_steps": 2},
    "int4": {"pages": 2, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16, "fill": "waves", "rows": "group",
             "transposed": True, "peel": True, "pairs": True, "maxnreg": 128, "min_steps": 2},
}


@functools.cache
def _cuda_props(index: int) -> tuple[int, int]:
    """(SMs, compute capability major) of a CUDA device, asked once."""
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, p.major


def _device_props(device: torch.device) -> tuple[int, int]:
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())


def _num_sms(device: torch.device) -> int:
    return _device_props(device)[0] if device.type == "cuda" else 4


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _sm90(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists: compiled for a Hopper or later GPU."""
    return device.type == "cuda" and not interpreting() and _device_props(device)[1] >= 9


def num_splits(batch: int, heads: int, max_len: int, device: torch.device, block_tokens: int,
               programs_per_sm: int = 4, min_split: int = 256, fill: str = "down") -> tuple[int, int]:
    """(splits, tokens per split), splits no shorter than min_split tokens, each a multiple of
    block_tokens. fill 'down': at most programs_per_sm programs per SM (rounded down: one split
    more than fits would add a wave of few programs). fill 'waves': programs_per_sm is how many
    programs an SM holds at once; the split count that wastes the fewest of those slots over
    all waves (B x H programs per split), the fewest splits among equals."""
    cap = max(1, max_len // min_split)
    if fill == "waves":
        want = _fewest_waves(batch * heads, programs_per_sm * _num_sms(device), cap)
    else:
        want = min(max(1, programs_per_sm * _num_sms(device) // (batch * heads)), cap)
    step = -(-max_len // want)
    step = -(-step // block_tokens) * block_tokens
    return -(-max_len // step), step


@functools.lru_cache(maxsize=4096)
def _fewest_waves(per_split: int, slots: int, cap: int) -> int:
    # time ~ waves / splits (a split's share of the work shrinks as splits grow); a split count
    # must save 5 % to win over fewer splits (each split adds a program prologue and a row of
    # the merge); past a few waves more splits gain nothing
    best, best_cost = 1, 1.0
    for n in range(1, min(cap, max(1, slots // per_split) * 4) + 1):
        cost = -(-n * per_split // slots) / n
        if cost < best_cost * 0.95:
            best, best_cost = n, cost
    return best


def _on_gpu(codec: str, cfg: dict, words: bool) -> int:
    """load_pages_f16's ON_GPU (see kernels/_pages.py); int8/fp8 words need the inline PTX, so
    the interpreter reads bytes."""
    asm = not interpreting() and cfg.get("asm", True)
    if codec == "int4" and cfg.get("pairs"):
        return 3 if asm else -3
    return 0 if not asm else 2 if words else 1


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for the fused merge, at least n, one buffer per device and stream:
    each call leaves them at 0 again, so calls queued on one stream can share them. Calls that
    may run at the same time must come from different streams (a CUDA graph keeps the buffer of
    the stream it was captured on)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = _COUNTERS[key] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return c


def paged_decode(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                 sm_scale: float | None = None, return_mass: bool = False, max_seq_len: int | None = None,
                 config: dict | None = None):
    """Decode attention of one new token per sequence over paged K/V.

    q            [B, Hq, D] fp16/bf16, Hq = group * H
    pages        one layer's page fields (layout of kernels/__init__.py): 16-bit, int8, fp8 or int4
    block_table  [B, max_pages] int32: page ids of each sequence's logical pages
    seq_lens     [B] int32: tokens of each sequence (may be 0), at most max_pages * S
    sm_scale     default 1/sqrt(D)
    max_seq_len  an upper bound of seq_lens known on the host; sizes the splits (default max_pages * S)
    config       override of DEFAULT_CONFIG[codec] (SMALL_HEAD_CONFIG for head_dim <= 64) and of
                 the split choice ('splits'), for tuning
    Returns out [B, Hq, D] in q's dtype, lse [B, Hq] fp32 (natural log of the sum of exp of the
    scaled logits; -inf for an empty sequence), and with return_mass, mass [B, H, max_pages * S]
    fp32: each key's probability summed over the group's query heads, 0 past seq_len.
    """
    res = paged_decode_sets(q, [(pages, block_table, seq_lens, max_seq_len)], sm_scale, return_mass, config)
    return res if not return_mass else (res[0], res[1], res[2][0])


def paged_decode_sets(q: torch.Tensor, sets: list[tuple], sm_scale: float | None = None, return_mass: bool = False,
                      config: dict | None = None, mass_into: list[tuple] | None = None, spread: tuple[int, ...] = ()):
    """Decode attention of one new token per sequence over several sets of pages at once, as if
    each sequence's keys were the union of its keys in every set: (pages, block_table, seq_lens,
    max_seq_len) per set, each as paged_decode takes them. The sets may differ in codec (a cache's
    16-bit tail pages and its quantized pages); they share q's batch and heads, and one merge
    pass combines every set's splits.

    Returns out [B, Hq, D], lse [B, Hq] over all the sets, and with return_mass a list of mass
    [B, H, max_pages_i * S] per set: each key's probability under the softmax over all sets.

    mass_into, instead of return_mass, adds the mass into buffers the caller keeps (an evictor's
    running totals), with no [B, H, L] result and no scatter after: per set, (buffers, positions):
    buffers a list of B fp32 tensors [H, columns] (rows contiguous, on q's device), positions
    [B, >= max_pages_i * S] int32/int64 on q's device. Key j of row b's set adds its mass into
    buffers[b][:, positions[b, j]]; positions outside [0, columns) are skipped. Rows' buffers
    must not overlap, nor a row's positions repeat. buffers may also be the row table itself,
    [B, 3] int64 on q's device, (address, head stride, columns) of each row's buffer: a caller
    whose buffers may move between replays of a CUDA graph keeps it and rewrites it in place;
    its addresses are taken as given.

    spread: indices of sets whose rows fill a varying, often small, part of their table's width
    (a K/V split's picks by coverage): their splits divide each row's own tokens, on the device,
    rather than the width, so that every split has work (with the quantized codecs' tile; the
    others split the width, as for any set)."""
    if not sets:
        raise KernelArgError("paged_decode_sets needs at least one set of pages")
    if mass_into is not None and (return_mass or not isinstance(mass_into, (list, tuple))
                                  or len(mass_into) != len(sets)):
        raise KernelArgError("mass_into takes (buffers, positions) for every set, and not with return_mass")
    plans = []
    for entry in sets:
        if not isinstance(entry, (tuple, list)) or len(entry) not in (3, 4):
            raise KernelArgError("each set is (pages, block_table, seq_lens) or (pages, block_table, seq_lens, "
                                 "max_seq_len)")
        plans.append(_plan(q, *entry[:3], entry[3] if len(entry) == 4 else None, config))
    b, hq, d = q.shape
    tiles = [p.tile for p in plans]
    dev = tiles[0].dev
    for t in tiles[1:]:
        if t.dev != dev or t.h != tiles[0].h:
            raise KernelArgError("every set of pages must be on q's device with the same KV heads")
    scale = softmax_scale(sm_scale, d)
    ns = sum(p.ns for p in plans)
    split = ns > 1
    fused = split and len(plans) == 1 and bool(tiles[0].cfg.get("fused_merge"))
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, device=dev, dtype=torch.float32)
    p_out = torch.empty(b, hq, ns, d, device=dev, dtype=torch.float32) if split else out
    p_lse = torch.empty(b, hq, ns, device=dev, dtype=torch.float32) if split else lse
    # the merge waits for pass 1 as a programmatic dependent of the last pass-1 grid (which
    # itself started after the others finished)
    pdl = tiles[-1].pdl_merge and split and not fused
    into = [_mass_rows(entry, b, p.tile, dev) for entry, p in zip(mass_into, plans)] if mass_into else None
    with_mass = return_mass or into is not None
    logits = []
    sp0 = 0
    for i, p in enumerate(plans):
        t = p.tile
        lg = torch.empty(b, hq, t.max_len, device=dev, dtype=torch.float32) if with_mass else lse
        logits.append(lg)
        counters = _merge_counters(dev, b * t.h) if fused else lse
        flags = dict(SPLIT=split, MASS=with_mass, FUSED=fused)
        if t.pdl:
            flags["PDL"] = pdl and p is plans[-1]
        if t.kernel is _decode_kernel_t:
            flags["SPREAD"] = i in spread
        launch(t.kernel, (b, t.h, p.ns),
               (q, *field_args(p.pages), p.block_table, p.seq_lens, p_out, p_lse, lg, out, lse, counters,
                scale * LOG2E, p.block_table.stride(0), p.step, t.max_len, ns, sp0),
               {**flags, **t.consts}, (t.key, *flags.items()))
        sp0 += p.ns
    if split and not fused:
        merge_splits(p_out, p_lse, out, lse, ns, b * hq, d, dev, tiles[-1].cfg, pdl)
    if not with_mass:
        return out, lse
    masses = []
    blk = 256
    for i, (p, lg) in enumerate(zip(plans, logits)):
        t = p.tile
        if into is None:
            mass = torch.empty(b, t.h, t.max_len, device=dev, dtype=torch.float32)
            rows, positions = lse, lse  # not read
            masses.append(mass)
        else:
            mass = lse  # not written
            rows, positions = into[i]
        launch(_mass_kernel, (b, t.h, triton.cdiv(t.max_len, blk)),
               (lg, lse, p.seq_lens, mass, rows, positions, positions.stride(0), t.max_len),
               dict(G=t.g, GP=t.gp, BLOCK=blk, INTO=into is not None, num_warps=4), (t.g, t.gp, blk, into is not None))
    return (out, lse, masses) if return_mass else (out, lse)


def merge_splits(p_out, p_lse, out, lse, ns: int, rows: int, d: int, dev: torch.device, cfg: dict,
                 pdl: bool = False) -> None:
    """Pass 2: the ns partials of each of `rows` rows, p_out [rows, ns, d] fp32 and p_lse [rows, ns]
    base 2 (-inf: an empty split), merged by their lse into out [rows, d] (its dtype) and lse [rows]
    natural log. cfg may set 'combine_chunk', 'combine_block', 'combine_rows'; pdl: launched as a
    programmatic dependent of the kernel before it."""
    # an [R, CH, DB] fp32 tile of partials per program, at most 64 registers a thread at 4 warps
    ch = min(cfg.get("combine_chunk", 512), max(2, triton.next_power_of_2(ns)))
    db = min(d, cfg.get("combine_block", max(16, 8192 // ch)))
    # several rows a program only when there are rows enough to keep every SM busy: a small
    # merge is bound by latency, and fewer programs each reading more made it slower
    r = cfg.get("combine_rows", _pow2_floor(max(1, min(4096 // (ch * db), rows // _num_sms(dev)))))
    launch(_combine_kernel, (triton.cdiv(rows, r), d // db), (p_out, p_lse, out, lse, ns, rows),
           dict(D=d, R=r, DB=db, CH=ch, num_warps=4, **({"PDL": True, "launch_pdl": True} if pdl else {})),
           (d, r, db, ch, pdl))


# (address, head stride, columns) tables of mass_into's buffers, by those numbers: the same
# buffers are handed over at every layer of a step and every step until one grows
_ROWS: dict[tuple, torch.Tensor] = {}


def _mass_rows(entry, b: int, tile: _Tile, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One set's mass_into entry checked: ([B, 3] int64 row table on dev, positions)."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise KernelArgError("each mass_into entry is (buffers, positions)")
    buffers, positions = entry
    check(positions, "mass_into positions", dtype=INDEX_DTYPES, shape=(b, None), contiguous=False)
    if positions.stride(1) != 1 or positions.device != dev or positions.shape[1] < tile.max_len:
        raise KernelArgError(f"mass_into positions must be [{b}, >= {tile.max_len}] with contiguous rows, on {dev}")
    if isinstance(buffers, torch.Tensor):  # the caller's own row table (a CUDA graph's, kept in place)
        check(buffers, "a mass_into row table", dtype=torch.int64, shape=(b, 3))
        if buffers.device != dev:
            raise KernelArgError(f"a mass_into row table must be on {dev}")
        return buffers, positions
    if not isinstance(buffers, (list, tuple)) or len(buffers) != b:
        raise KernelArgError(f"mass_into needs one buffer per row ({b})")
    for x in buffers:
        check(x, "a mass_into buffer", dtype=torch.float32, shape=(tile.h, None), contiguous=False)
        if x.stride(1) != 1 or x.device != dev:
            raise KernelArgError(f"a mass_into buffer must have contiguous rows and be on {dev}")
    key = (dev, tuple((x.data_ptr(), x.stride(0), x.shape[1]) for x in buffers))
    rows = _ROWS.get(key)
    if rows is None:
        if len(_ROWS) >= 64:
            _ROWS.clear()
        rows = _ROWS[key] = torch.tensor(key[1], dtype=torch.int64).to(dev, non_blocking=True)
    return rows, positions


@dataclass
class _Tile:
    """What one set of pages' checks find and the tile chosen for it: the same for every call
    whose tensors agree in what the checks read (see _signature)."""

    dev: torch.device
    codec: str
    h: int
    s: int
    g: int
    gp: int
    cfg: dict
    max_len: int
    bn: int
    words: bool
    kernel: object
    consts: dict  # the pass-1 kernel's compile-time arguments that do not depend on the call
    pdl: bool  # the kernel takes PDL
    key: tuple  # consts as a key of _launch.launch
    pdl_merge: bool  # a merge after this set may be launched as a programmatic dependent


@dataclass
class _Plan:
    """One set of pages checked, and its tile and splits chosen."""

    pages: dict
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    tile: _Tile
    ns: int
    step: int


# Decode runs once per layer and step with tensors that differ only in their data: checking
# them and choosing the tile once per kind of call, not per call, takes most of the host's
# work off a decode step. A call is of a kind already seen when every tensor agrees in what the
# checks read (dtype, shape, strides, device) and in the 4-byte alignment the int32 loads need.
_TILES: dict[tuple, _Tile] = {}
_MAX_TILES = 256


def _tensor_sig(t) -> tuple:
    return (t.dtype, t.shape, t.stride(), t.device)


def _signature(q, pages, block_table, seq_lens) -> tuple | None:
    """The key of _TILES for these arguments, or None for arguments the checks must see."""
    tensors = (q, block_table, seq_lens, *pages.values()) if isinstance(pages, dict) else None
    if tensors is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    try:
        aligned = pages["k"].data_ptr() % 4 == 0 and pages["v"].data_ptr() % 4 == 0
    except KeyError:
        return None
    fields = tuple((f, _tensor_sig(t)) for f, t in pages.items())
    return (q.device.type == "cpu" and interpreting(), _tensor_sig(q), fields, aligned, _tensor_sig(block_table),
            _tensor_sig(seq_lens))


def _plan(q, pages, block_table, seq_lens, max_seq_len, config) -> _Plan:
    key = _signature(q, pages, block_table, seq_lens) if config is None else None
    tile = _TILES.get(key) if key is not None else None
    if tile is None:
        tile = _choose_tile(q, pages, block_table, seq_lens, config)
        if key is not None:
            if len(_TILES) >= _MAX_TILES:
                _TILES.clear()
            _TILES[key] = tile
    cfg = tile.cfg
    span = tile.max_len if max_seq_len is None else max(1, min(max_seq_len, tile.max_len))
    # splits of at least 4 loop steps: short contexts are bound by each program's chain of steps
    ns, step = num_splits(q.shape[0], tile.h, span, tile.dev, tile.bn, cfg["programs_per_sm"],
                          min_split=cfg.get("min_steps", 4) * tile.bn, fill=cfg.get("fill", "down"))
    if "splits" in cfg:
        ns = cfg["splits"]
        step = -(-(-(-span // ns)) // tile.bn) * tile.bn
        ns = -(-span // step)
    return _Plan(pages, block_table, seq_lens, tile, ns, step)


def _choose_tile(q, pages, block_table, seq_lens, config) -> _Tile:
    codec, h, s, d, b, dev = check_decode(q, pages, block_table, seq_lens)
    vcodec = value_codec_of(pages)
    hq = q.shape[1]
    given = config or {}
    table = SMALL_HEAD_CONFIG if d <= 64 else DEFAULT_CONFIG
    # keys and values in different codecs (a K/V split's pages): the values' tile with the keys'
    # loads (int4's 'pairs', its register cap)
    cfg = {**table[vcodec], **table[codec], **given} if vcodec != codec else {**table[codec], **given}
    if b == 1:  # one sequence: 'one_sequence' replaces the keys that config does not give
        cfg = {**cfg, **cfg.get("one_sequence", {}), **given}
    g = hq // h
    gp = triton.next_power_of_2(g) if cfg.get("rows") == "group" else max(16, triton.next_power_of_2(g))
    warps = cfg.get("warp_split", False) and cfg["num_warps"] > 1
    per_warp = cfg["num_warps"] if warps or cfg.get("transposed") else 1
    cfg["pages"] = pv_pages(cfg["pages"], s, (codec, vcodec), per_warp, "pages" in given)
    bn = cfg["pages"] * s
    # codes as int32 words need 4-byte aligned rows (true of whole page tensors): V's rows are a
    # channel's s codes
    words = cfg.get("words", False) and s % 4 == 0 and all(pages[f].data_ptr() % 4 == 0 for f in ("k", "v"))
    if warps and cfg["pages"] % cfg["num_warps"]:
        raise KernelArgError(f"warp_split needs pages ({cfg['pages']}) divisible by num_warps ({cfg['num_warps']})")
    if cfg.get("transposed"):
        if cfg["pages"] % cfg["num_warps"]:
            raise KernelArgError(f"transposed needs pages ({cfg['pages']}) divisible by num_warps ({cfg['num_warps']})")
        kernel, extra = _decode_kernel_t, {"W": cfg["num_warps"], "PEEL": bool(cfg.get("peel")), "PDL": False}
    else:
        kernel, extra = (_decode_kernel_warps, {"W": cfg["num_warps"]}) if warps else (_decode_kernel, {})
    for c in {codec, vcodec}:
        check_int4_tile(c, bn // cfg["num_warps"] if warps or cfg.get("transposed") else bn)
    consts = dict(H=h, G=g, GP=gp, S=s, D=d, KIND=KIND[codec], GROUP=ref.INT4_GROUP, PAGES=cfg["pages"],
                  ON_GPU=_on_gpu(codec, cfg, words), VKIND=KIND[vcodec], VON_GPU=_on_gpu(vcodec, cfg, words),
                  CH=cfg.get("fused_chunk", 8), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], **extra, **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    pdl = consts.pop("PDL", None) is not None
    return _Tile(dev, codec, h, s, g, gp, cfg, block_table.shape[1] * s, bn, words, kernel, consts, pdl,
                 tuple(sorted(consts.items())), bool(cfg.get("pdl")) and _sm90(dev))


def paged_decode_ref(q, pages, block_table, seq_lens, sm_scale=None, return_mass=False):
    """Dense fp32 reference: dequantize each sequence's pages with kernels/quantize.py, softmax
    attention in fp32. Returns out [B, Hq, D] fp32 (not rounded to q's dtype), lse, and mass."""
    res = paged_decode_sets_ref(q, [(pages, block_table, seq_lens)], sm_scale, return_mass)
    return (res[0], res[1], res[2][0]) if return_mass else res


def paged_decode_sets_ref(q, sets, sm_scale=None, return_mass=False, mass_into=None):
    """Reference of paged_decode_sets: each sequence's keys of every set dequantized and
    joined, dense fp32 attention over them. Returns out [B, Hq, D] fp32, lse and with
    return_mass a list of mass [B, H, max_pages_i * S] per set; with mass_into, adds the mass
    into the buffers instead."""
    b, hq, d = q.shape
    h = sets[0][0]["k"].shape[1]
    g = hq // h
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq), float("-inf"), device=q.device)
    masses = [torch.zeros(b, h, e[1].shape[1] * e[0]["k"].shape[2], device=q.device) for e in sets]
    for i in range(b):
        kv = [ref.sequence_kv(e[0], e[1][i], int(e[2][i])) for e in sets]
        lens = [k.shape[1] for k, _ in kv]
        if sum(lens) == 0:
            continue
        k = torch.cat([k for k, _ in kv], 1)
        v = torch.cat([v for _, v in kv], 1)
        qi = q[i].float().reshape(h, g, d)
        sc = torch.einsum("hgd,hnd->hgn", qi, k) * scale
        lse[i] = torch.logsumexp(sc, -1).reshape(hq)
        p = torch.softmax(sc, -1)
        out[i] = torch.einsum("hgn,hnd->hgd", p, v).reshape(hq, d)
        for mass, part in zip(masses, p.sum(1).split(lens, -1)):
            mass[i, :, : part.shape[-1]] = part
    for (buffers, positions), mass, e in zip(mass_into or [], masses, sets):
        for i, buf in enumerate(buffers):
            pos = positions[i, : int(e[2][i])].long()
            keep = (pos >= 0) & (pos < buf.shape[1])
            buf.index_add_(1, pos[keep], mass[i, :, : pos.shape[0]][:, keep].to(buf.device))
    return (out, lse, masses) if return_mass else (out, lse)
