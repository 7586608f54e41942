"""Causal prefill attention of one chunk of queries over its sequence's pages, any
codec, dequantized in registers (the same block loader and softmax step as decode).

The chunk's T queries are the last T of the sequence's L tokens (their own K/V already
written to the pages). GQA is packed into the rows of a tile: a program takes BLOCK_M
consecutive (token, query head) pairs of one KV head, so each K/V block read serves the
whole group. Query row (t, g) sees keys 0 .. L - T + t. A short chunk over a long context has
few such blocks: its key range is then split over programs as well (flash-decoding's split),
each writing a partial (out, lse) that decode's merge pass combines.

H2O and SnapKV need each key's attention mass: its probability under each query's final
softmax, summed over the group's query heads and the chunk's last queries. That needs the
query's final lse, which the attention pass only has at its end, so a second kernel
(paged_prefill_mass) takes one block of keys per program, recomputes the logits of every
counted query against it and sums exp(logit - lse): the QK work once more, no [T, L] matrix.
"""

from __future__ import annotations

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
    check_device,
    check_int4_tile,
    check_pages,
    check_queries,
    field_args,
    interpreting,
    pv_pages,
    softmax_scale,
)
from ._launch import launch
from ._pages import attend_block, load_keys_f16, load_pages_f16
from .paged_decode import LOG2E, _finish, _num_sms, merge_splits


# Token counts and the table's stride are not specialized on (Triton would build a variant for
# each of them being a multiple of 16 or not): a server's start-up warm-up then builds every
# variant its prompt steps launch. They are used in index arithmetic, never as a pointer's
# alignment, so the code is the same speed either way.
@triton.jit(do_not_specialize=["T", "L", "bt_stride", "split_tokens"])
def _prefill_kernel(q, kp, ksp, kzp, vp, vsp, vzp, block_table, out, lse, qk_scale, T, L, limits, lens, bt_stride,
                    split_tokens, ns, sp0, nst,
                    H: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PAGES: tl.constexpr, ON_GPU: tl.constexpr,
                    LIMITS: tl.constexpr = False, LENS: tl.constexpr = False, SPLIT: tl.constexpr = False,
                    PEEL: tl.constexpr = False):
    # grid (cdiv(T * G, BLOCK_M) * ns, H, B); q, out [B, T, Hq, D]; lse [B, T, Hq]; block_table [B, *]
    # (row stride bt_stride); limits [B, T]; each sequence's L from lens [B] with LENS, else L.
    # SPLIT: program (block, split) of this grid's ns splits attends keys [split * split_tokens, ...)
    # and writes partial sp0 + split of nst to out [B * T * Hq, nst, D] fp32, lse [B * T * Hq, nst]
    # base 2 (merge_splits combines them; several sets of pages take turns at offsets sp0).
    # PEEL: the steps whose keys every row of the block sees run without token masks, the rest
    # (the causal diagonal, a split's partly seen end) masked after them
    h = tl.program_id(1)
    b = tl.program_id(2)
    if LENS:
        L = tl.load(lens + b)
    if SPLIT:
        blk = tl.program_id(0) // ns
        sp = tl.program_id(0) % ns
    else:
        blk = tl.program_id(0)
        sp = 0
    f = blk * BLOCK_M + tl.arange(0, BLOCK_M)  # flat (token, group head) index
    row_ok = f < T * G
    t = tl.where(row_ok, f // G, 0)
    bt = b.to(tl.int64) * T + t  # the query's row of the batch's [B * T] tokens
    qrow = bt * (H * G) + h * G + f % G
    block_table += b.to(tl.int64) * bt_stride
    d = tl.arange(0, D)
    qh = tl.load(q + qrow[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32).to(tl.float16)
    if LIMITS:  # keys visible to each query given (some of the keys may be newer than all of them)
        seen = tl.minimum(tl.load(limits + bt, mask=row_ok, other=0), L)
    else:
        seen = L - T + t + 1  # [BLOCK_M] keys visible to each row
    if SPLIT:  # a row may see none of a split's keys (attend_block's GUARD)
        lim = seen
        lo = sp * split_tokens
        hi = tl.minimum(tl.max(lim, 0), lo + split_tokens)
    else:
        lim = tl.maximum(seen, 1)  # key 0 keeps m finite; a row that sees none is written empty below
        lo = 0
        hi = tl.max(lim, 0)

    BN: tl.constexpr = PAGES * S
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if PEEL:
        low = tl.min(tl.where(row_ok, lim, hi), 0)  # keys every row sees (padding rows see all)
        first = lo + tl.maximum(tl.minimum(low, hi) - lo, 0) // BN * BN
        for start in range(lo, first, BN):
            page = tl.load(block_table + start // S + tl.arange(0, PAGES)).to(tl.int64)
            k, v, vs = load_pages_f16(kp, ksp, kzp, vp, vsp, vzp, page, None, h, H, S, D, PAGES, KIND, GROUP,
                                      ON_GPU, KIND, ON_GPU)
            acc, m, l, s = attend_block(acc, m, l, qh, k, v, vs, None, qk_scale, KIND == 1, SPLIT)
    else:
        first = lo
    for start in range(first, hi, BN):
        pi = start // S + tl.arange(0, PAGES)
        n = start + tl.arange(0, BN)
        tok_ok = n < hi
        page = tl.load(block_table + pi, mask=pi * S < hi, other=0).to(tl.int64)
        k, v, vs = load_pages_f16(kp, ksp, kzp, vp, vsp, vzp, page, tok_ok.reshape(PAGES, S), h,
                              H, S, D, PAGES, KIND, GROUP, ON_GPU, KIND, ON_GPU)
        acc, m, l, s = attend_block(acc, m, l, qh, k, v, vs, n[None, :] < lim[:, None], qk_scale, KIND == 1, SPLIT)

    if SPLIT:  # a row that saw no key of this split leaves an empty partial (lse -inf)
        _finish(acc, m, l, qrow, row_ok, d, out, lse, sp0 + sp, nst, out, lse, lse, 0, D, True, False, 1)
    else:
        none = seen < 1
        o = tl.where(none[:, None], 0.0, acc / l[:, None])
        tl.store(out + qrow[:, None] * D + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse + qrow, tl.where(none, float("-inf"), (m + tl.log2(l)) * 0.6931471805599453), mask=row_ok)


@triton.jit
def _prefill_mass_kernel(q, kp, ksp, kzp, block_table, lse, mass, qk_scale, T, L, limits, first,
                         H: tl.constexpr, G: tl.constexpr, S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr,
                         BLOCK_M: tl.constexpr, PAGES: tl.constexpr, ON_GPU: tl.constexpr,
                         LIMITS: tl.constexpr = False):
    # grid (cdiv(L, PAGES * S), H); q [T, Hq, D]; lse [T, Hq] natural log; mass [H, L] fp32:
    # the program's block of keys, summed over the query rows (t, g) with t >= first
    h = tl.program_id(1)
    BN: tl.constexpr = PAGES * S
    start = tl.program_id(0) * BN
    pi = start // S + tl.arange(0, PAGES)
    n = start + tl.arange(0, BN)
    tok_ok = n < L
    page = tl.load(block_table + pi, mask=pi * S < L, other=0).to(tl.int64)
    k = load_keys_f16(kp, ksp, kzp, page, tok_ok.reshape(PAGES, S), h, H, S, D, PAGES, KIND, ON_GPU)
    d = tl.arange(0, D)
    total = tl.zeros([BN], tl.float32)
    for r0 in range(first * G, T * G, BLOCK_M):
        f = r0 + tl.arange(0, BLOCK_M)
        row_ok = f < T * G
        t = tl.where(row_ok, f // G, 0)
        qrow = t.to(tl.int64) * (H * G) + h * G + f % G
        qh = tl.load(q + qrow[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        qh = qh.to(tl.float32).to(tl.float16)
        if LIMITS:
            seen = tl.minimum(tl.load(limits + t, mask=row_ok, other=0), L)
        else:
            seen = L - T + t + 1
        l2 = tl.load(lse + qrow, mask=row_ok, other=0.0) * 1.4426950408889634  # base 2
        s = tl.dot(qh, tl.trans(k)) * qk_scale
        p = tl.exp2(s - l2[:, None])
        p = tl.where(row_ok[:, None] & (n[None, :] < seen[:, None]) & tok_ok[None, :], p, 0.0)
        total += tl.sum(p, 0)
    tl.store(mass + h * L + n, total, mask=tok_ok)


# Tiles: block_m query rows ((token, group head) pairs) a program, pages of keys a loop step; when
# the blocks of rows x KV heads x sequences are too few to fill the GPU (a short chunk, few KV
# heads) the key range is split too, to about programs_per_sm programs per SM in splits of at
# least min_split keys, and the partials merged by their lse (merge_splits, decode's pass 2).
# Chosen by benchmarks/kernels/gpu_bench.py --kernel prefill --variants on an H200 (docs/benchmarks.md):
# 128 rows beat 64 once the split keeps the grid full (smollm2 16K x 512: 431 -> 95 us;
# llama3 16K x 2048: 2138 -> 1861 us), and head_dim 64's lighter programs want more per SM.
# 'peel': the steps whose keys every row of a block sees run first without token masks (int8
# llama3 16K x 512: 615 -> 485 us; Triton then feeds 16-bit K and V to HGMMA from shared memory).
DEFAULT_CONFIG = {"block_m": 128, "pages": 4, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2, "peel": True,
                  "min_split": 1024}
SMALL_HEAD_CONFIG = {**DEFAULT_CONFIG, "programs_per_sm": 4, "min_split": 256}
MASS_CONFIG = {"block_m": 64, "pages": 4, "num_warps": 4, "num_stages": 2}


def prefill_config(d: int, config: dict | None, codec: str, s: int) -> dict:
    """The tile for head_dim d and pages of s tokens, with the caller's overrides. P @ V reduces
    over a step's tokens: at least 16 (tl.dot's K), 32 for int4 (check_int4_tile); pages of fewer
    tokens than the table's were tuned for take more of them a step."""
    cfg = {**(SMALL_HEAD_CONFIG if d <= 64 else DEFAULT_CONFIG), **(config or {})}
    cfg["pages"] = pv_pages(cfg["pages"], s, (codec,), given="pages" in (config or {}))
    return cfg


def _check_chunk(q, pages, block_table, seq_len, limits):
    """paged_prefill's (and paged_prefill_mass's) arguments checked: (codec, H, S, D, seq_len, device)."""
    codec, _, h, s, d = check_pages(pages)
    t, _, _ = check_queries(q, 1, h, d)
    check(block_table, "block_table", dtype=INDEX_DTYPES, shape=(None,))
    seq_len = int(seq_len)
    if limits is None and not t <= seq_len <= block_table.shape[0] * s:
        raise KernelArgError(f"need T={t} <= seq_len={seq_len} <= max_pages*S={block_table.shape[0] * s}")
    if limits is not None:
        check(limits, "limits", dtype=torch.int32, shape=(t,))
        if not 0 <= seq_len <= block_table.shape[0] * s:
            raise KernelArgError(f"need 0 <= seq_len={seq_len} <= max_pages*S={block_table.shape[0] * s}")
    dev = check_device(q, block_table, pages["k"], *([] if limits is None else [limits]))
    return codec, h, s, d, seq_len, dev


def paged_prefill_mass(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor, seq_len: int,
                       lse: torch.Tensor, first: int = 0, sm_scale: float | None = None,
                       limits: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Each key's attention mass from a chunk's queries, for H2O and SnapKV.

    q, pages, block_table, seq_len, sm_scale, limits: as paged_prefill takes them.
    lse          [T, Hq] fp32: each query's log-sum-exp (natural log) over every key it attends
                 to, which may be more than these pages hold (a cache's other pool): the
                 probabilities are those of that softmax
    first        the mass counts queries first .. T - 1 (SnapKV's observation window)
    Returns mass [H, seq_len] fp32: per KV head, each key's probability summed over the group's
    query heads and the counted queries.
    """
    codec, h, s, d, seq_len, dev = _check_chunk(q, pages, block_table, seq_len, limits)
    t, hq, _ = q.shape
    check(lse, "lse", dtype=torch.float32, shape=(t, hq))
    check_device(q, lse)
    first = int(first)
    if not 0 <= first <= t:
        raise KernelArgError(f"need 0 <= first={first} <= T={t}")
    cfg = {**MASS_CONFIG, **(config or {})}
    mass = torch.zeros(h, seq_len, device=dev, dtype=torch.float32)
    if seq_len == 0 or first == t:
        return mass
    scale = softmax_scale(sm_scale, d)
    grid = (triton.cdiv(seq_len, cfg["pages"] * s), h)
    _prefill_mass_kernel[grid](q, *field_args(pages)[:3], block_table, lse, mass, scale * LOG2E, t, seq_len,
                               lse if limits is None else limits, first,
                               H=h, G=hq // h, S=s, D=d, KIND=KIND[codec], BLOCK_M=cfg["block_m"],
                               PAGES=cfg["pages"], ON_GPU=not interpreting(), num_warps=cfg["num_warps"],
                               num_stages=cfg["num_stages"], LIMITS=limits is not None)
    return mass


def paged_prefill_mass_ref(q, pages, block_table, seq_len, lse, first=0, sm_scale=None, limits=None):
    """Dense fp32 reference of paged_prefill_mass (keys dequantized with kernels/quantize.py)."""
    t, hq, _ = q.shape
    h = pages["k"].shape[1]
    sc, _ = _ref_scores(q, pages, block_table, seq_len, sm_scale, limits)  # [H, g, T, L]
    p = torch.exp(sc - lse.reshape(t, h, hq // h).permute(1, 2, 0).unsqueeze(-1))
    return p[:, :, first:].sum(dim=(1, 2))


def _ref_scores(q, pages, block_table, seq_len, sm_scale, limits):
    """The references' scaled logits [H, g, T, L] in fp32, -inf where a query does not see the
    key (causal, or past its limit), and the dequantized V [H, L, D]."""
    t, hq, d = q.shape
    h = pages["k"].shape[1]
    k, v = ref.sequence_kv(pages, block_table, seq_len)  # [H, L, D]
    qf = q.float().reshape(t, h, hq // h, d).permute(1, 2, 0, 3)  # [H, g, T, D]
    sc = torch.einsum("hgtd,hld->hgtl", qf, k) * (1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
    seen = (torch.arange(seq_len - t, seq_len, device=q.device) + 1 if limits is None else limits.long())[:, None]
    return sc.masked_fill(torch.arange(seq_len, device=q.device)[None, :] >= seen, float("-inf")), v


def paged_prefill(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor, seq_len: int,
                  sm_scale: float | None = None, config: dict | None = None, limits: torch.Tensor | None = None):
    """Causal attention of a chunk's queries over one sequence's pages.

    q            [T, Hq, D] fp16/bf16: the last T of the sequence's seq_len tokens
    pages        one layer's page fields (layout of kernels/__init__.py): 16-bit, int8, fp8 or int4
    block_table  [max_pages] int32: the sequence's page ids, max_pages * S >= seq_len
    seq_len      L, tokens in the pages including the chunk's own
    limits       [T] int32, optional: how many of the pages' first tokens each query sees, instead
                 of the causal rule (query t sees L - T + t + 1); for pages that hold part of a
                 sequence (one pool of a cache), whose tokens may be older or newer than a query.
                 A query that sees none gets zeros and lse -inf.
    Returns out [T, Hq, D] in q's dtype and lse [T, Hq] fp32 (natural log).
    """
    codec, h, s, d, seq_len, dev = _check_chunk(q, pages, block_table, seq_len, limits)
    cfg = prefill_config(d, config, codec, s)
    check_int4_tile(codec, cfg["pages"] * s)
    return _prefill(q, [_Set(pages, codec, block_table, 0, None, seq_len, limits, cfg)], sm_scale, 1, dev)


def prefill_splits(programs: int, seq_len: int, block_tokens: int, dev: torch.device, cfg: dict) -> tuple[int, int]:
    """(splits, keys per split) of a chunk's key range: one split when `programs` (blocks of query
    rows x KV heads x sequences) fill the GPU; else about programs_per_sm per SM, splits of at
    least min_split keys, each a multiple of block_tokens. cfg 'splits' fixes the count."""
    if "splits" in cfg:
        want = int(cfg["splits"])
    else:
        want = max(1, round(cfg["programs_per_sm"] * _num_sms(dev) / max(1, programs)))
        want = min(want, max(1, seq_len // cfg["min_split"]))
    if want <= 1 or seq_len <= block_tokens:
        return 1, seq_len
    step = -(-(-(-seq_len // want)) // block_tokens) * block_tokens
    return -(-seq_len // step), step


@dataclass
class _Set:
    """One set of pages of a chunk's launch, checked: its fields and codec, block table (and the
    stride between its rows), each row's tokens (lens [B] int32, or None: seq_len), an upper
    bound of them known on the host, the queries' limits (None: the causal rule) and the tile."""

    pages: dict
    codec: str
    table: torch.Tensor
    bt_stride: int
    lens: torch.Tensor | None
    seq_len: int
    limits: torch.Tensor | None
    cfg: dict


def _prefill(q, sets: list[_Set], sm_scale, batch: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk q ([T, Hq, D] or [B, T, Hq, D]) over every set: out like q, lse q's shape but D.
    One set that needs no split writes out and lse directly; otherwise every set's grid writes its
    splits' partials at its offset of one buffer and one merge pass combines them all."""
    t, hq, d = q.shape[-3:]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=dev, dtype=torch.float32)
    if t == 0 or batch == 0:
        return out, lse
    scale = softmax_scale(sm_scale, d) * LOG2E
    plans = []
    for st in sets:
        h, s = st.pages["k"].shape[1], st.pages["k"].shape[2]
        blocks = triton.cdiv(t * (hq // h), st.cfg["block_m"])
        plans.append((st, blocks, *prefill_splits(blocks * h * batch, st.seq_len, st.cfg["pages"] * s, dev, st.cfg)))
    nst = sum(p[2] for p in plans)
    if nst == 1:
        _launch(q, plans[0], out, lse, scale, t, batch, 0, 1, False)
        return out, lse
    rows = batch * t * hq
    o, ls = torch.empty(rows, nst, d, device=dev, dtype=torch.float32), torch.empty(rows, nst, device=dev)
    sp0 = 0
    for plan in plans:
        _launch(q, plan, o, ls, scale, t, batch, sp0, nst, True)
        sp0 += plan[2]
    merge_splits(o, ls, out.view(rows, d), lse.view(rows), nst, rows, d, dev, sets[-1].cfg)
    return out, lse


def _launch(q, plan, out, lse, qk_scale, t, batch, sp0, nst, split):
    st, blocks, ns, step = plan
    pages, cfg = st.pages, st.cfg
    h, s, d = pages["k"].shape[1], pages["k"].shape[2], q.shape[-1]
    consts = dict(H=h, G=q.shape[-2] // h, S=s, D=d, KIND=KIND[st.codec], GROUP=ref.INT4_GROUP,
                  BLOCK_M=cfg["block_m"], PAGES=cfg["pages"], ON_GPU=not interpreting(), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], LIMITS=st.limits is not None, LENS=st.lens is not None, SPLIT=split,
                  PEEL=bool(cfg.get("peel")))
    launch(_prefill_kernel, (blocks * ns, h, batch),
           (q, *field_args(pages), st.table, out, lse, qk_scale, t, st.seq_len,
            lse if st.limits is None else st.limits, lse if st.lens is None else st.lens, st.bt_stride, step, ns,
            sp0, nst),
           consts, tuple(consts.items()))


def paged_prefill_batch(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor,
                        seq_lens: torch.Tensor, max_seq_len: int, limits: torch.Tensor, sm_scale: float | None = None,
                        config: dict | None = None):
    """paged_prefill for a batch of sequences in one launch: chunks of T queries each.

    q            [B, T, Hq, D] fp16/bf16, contiguous
    block_table  [B, max_pages] int32: each sequence's page ids (rows contiguous)
    seq_lens     [B] int32: tokens in each sequence's pages, at most max_seq_len
    max_seq_len  an upper bound of seq_lens known on the host, at most max_pages * S
    limits       [B, T] int32: how many of its sequence's first tokens each query sees (as
                 paged_prefill's limits: a row's padding queries see 0 and get zeros, lse -inf)
    Returns out [B, T, Hq, D] in q's dtype and lse [B, T, Hq] fp32 (natural log). A row's numbers
    are those of paged_prefill on it alone when neither launch splits the key range (the split
    follows the grid and max_seq_len; with one, results agree to rounding, as decode's do).
    """
    st, dev = _check_set(q, (pages, block_table, seq_lens, max_seq_len, limits), config)
    return _prefill(q, [st], sm_scale, q.shape[0], dev)


def paged_prefill_sets(q: torch.Tensor, sets, sm_scale: float | None = None, config: dict | None = None):
    """paged_prefill_batch over several sets of pages at once (a cache's pools: a 16-bit window
    and quantized pages, say): each set's grid writes its partials (out, lse) at its own offset of
    one buffer and one merge pass combines them, so the result is the softmax over every set's
    keys, with no per-set outputs to merge after.

    q            [B, T, Hq, D] fp16/bf16, contiguous
    sets         (pages, block_table, seq_lens, max_seq_len, limits) per set, as paged_prefill_batch
                 takes them; seq_lens may be None when B = 1 (the row holds max_seq_len tokens)
    config       one tile for every set (default: by head_dim)
    Returns out [B, T, Hq, D] in q's dtype and lse [B, T, Hq] fp32 (natural log) over all sets; a
    query that sees no key of any set gets zeros and lse -inf.
    """
    if not isinstance(sets, (list, tuple)) or not sets:
        raise KernelArgError("paged_prefill_sets needs a list of one or more sets of pages")
    checked = [_check_set(q, entry, config) for entry in sets]
    dev = checked[0][1]
    if any(d != dev for _, d in checked):
        raise KernelArgError("every set of pages must be on q's device")
    return _prefill(q, [st for st, _ in checked], sm_scale, q.shape[0], dev)


def _check_set(q, entry, config) -> tuple[_Set, torch.device]:
    """One (pages, block_table, seq_lens, max_seq_len, limits) of a batch's chunk q [B, T, Hq, D], checked."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 5:
        raise KernelArgError("each set is (pages, block_table, seq_lens, max_seq_len, limits)")
    pages, block_table, seq_lens, max_seq_len, limits = entry
    codec, _, h, s, d = check_pages(pages)
    b, t, _, _ = check_queries(q, 2, h, d)
    check(block_table, "block_table", dtype=INDEX_DTYPES, shape=(b, None), contiguous=False)
    if block_table.stride(1) != 1:
        raise KernelArgError("block_table's rows must be contiguous")
    if seq_lens is None:
        if b != 1:
            raise KernelArgError(f"seq_lens may be left out for one sequence, not {b}")
    else:
        check(seq_lens, "seq_lens", dtype=torch.int32, shape=(b,))
    check(limits, "limits", dtype=torch.int32, shape=(b, t))
    if not 0 <= int(max_seq_len) <= block_table.shape[1] * s:
        raise KernelArgError(f"need 0 <= max_seq_len={max_seq_len} <= max_pages*S={block_table.shape[1] * s}")
    dev = check_device(q, block_table, pages["k"], limits, *([] if seq_lens is None else [seq_lens]))
    cfg = prefill_config(d, config, codec, s)
    check_int4_tile(codec, cfg["pages"] * s)
    return _Set(pages, codec, block_table, block_table.stride(0), seq_lens, int(max_seq_len), limits, cfg), dev


def paged_prefill_batch_ref(q, pages, block_table, seq_lens, max_seq_len, limits, sm_scale=None):
    """paged_prefill_ref row by row. Returns out [B, T, Hq, D] fp32 and lse [B, T, Hq]."""
    rows = [paged_prefill_ref(q[i], pages, block_table[i], int(n), sm_scale, limits[i])
            for i, n in enumerate(seq_lens.tolist())]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def paged_prefill_ref(q, pages, block_table, seq_len, sm_scale=None, limits=None):
    """Dense fp32 reference: dequantize with kernels/quantize.py, causal softmax attention in fp32
    (or each query over its first `limits` keys). Returns out [T, Hq, D] fp32 and lse [T, Hq]."""
    t, hq, d = q.shape
    sc, v = _ref_scores(q, pages, block_table, seq_len, sm_scale, limits)
    lse = torch.logsumexp(sc, -1)  # [H, g, T]; -inf for a query that sees no key
    out = torch.einsum("hgtl,hld->hgtd", torch.softmax(sc, -1).nan_to_num(0.0), v)
    return out.permute(2, 0, 1, 3).reshape(t, hq, d), lse.permute(2, 0, 1).reshape(t, hq)
