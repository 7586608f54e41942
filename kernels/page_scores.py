"""Each page's log-sum-exp of one decode query's attention logits: the K/V split's scores.

The K/V split (kvguard/cache/split.py) keeps keys on the device and the values of cold pages in
host memory. Before a decode step reads any value it needs, for every page, how much of the
softmax falls there: this pass reads keys only and writes, per query head and page, the
natural log of the sum of exp of the page's scaled logits. The logsumexp over every page of
every set is the softmax's normalizer, and exp(page - normalizer) the page's mass, exactly.

A decode step's pass (`transposed`, the default) is laid out as paged_decode's tile of the
quantized codecs: grid B x H x splits, a program one sequence, one KV head and one slice of its
pages, looping over them a few pages a step (software-pipelined), the tokens the rows of the
tensor-core product and the group's query heads its columns. Besides each page's log-sum-exp it
keeps the slice's, and `page_lse_sets` joins those into the softmax's normalizer: a few hundred
partial sums a row, where summing the pages' scores again would take one pass over every page
(on one streaming multiprocessor a row: kernels/page_pick.py `page_total`).

The other layout (grid B x H x page chunks, a program PAGES pages at a time, the group's query
heads padded to 16 columns) serves queries of one sequence that share its block table (a
chunk's, `shared`): they go ROWS to a program, each page's keys read once for ROWS queries, the
product's columns ROWS groups of heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import KIND, KernelArgError, check_decode, field_args, softmax_scale
from ._launch import launch
from ._pages import load_keys_f16
from .paged_decode import _on_gpu, _signature, num_splits

LOG2E = 1.4426950408889634


@triton.jit
def _page_lse_kernel(q, kp, ksp, kzp, block_table, seq_lens, out, qk_scale, bt_stride, out_stride, n_pages,
                     n_rows, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, S: tl.constexpr,
                     D: tl.constexpr, KIND: tl.constexpr, PAGES: tl.constexpr, ITERS: tl.constexpr,
                     ON_GPU: tl.constexpr, ROWS: tl.constexpr = 1):
    # q [B, Hq, D]; block_table [B, *]; seq_lens [B] tokens; out [B, Hq, n_pages] fp32, rows
    # (b, hq) out_stride apart. A program takes ITERS steps of PAGES pages, and ROWS queries
    # (rows ROWS * program .. of n_rows) that share the first one's block table and length.
    b = tl.program_id(0) * ROWS
    h = tl.program_id(1)
    c = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    r = tl.arange(0, GP)
    row_ok = (r < ROWS * G) & (b + r // G < n_rows)
    qrow = (b + r // G) * (H * G) + h * G + r % G
    d = tl.arange(0, D)
    qv = tl.load(q + qrow[None, :] * D + d[:, None], mask=row_ok[None, :], other=0.0).to(tl.float16)
    for it in range(ITERS):
        pi = (c * ITERS + it) * PAGES + tl.arange(0, PAGES)  # the sequence's page slots of this step
        ok = (pi[:, None] * S + tl.arange(0, S)[None, :]) < seq_len  # [PAGES, S] tokens that exist
        page = tl.load(block_table + b.to(tl.int64) * bt_stride + pi, mask=pi * S < seq_len, other=0).to(tl.int64)
        k = load_keys_f16(kp, ksp, kzp, page, ok, h, H, S, D, PAGES, KIND, ON_GPU)  # [PAGES*S, D]
        s = tl.dot(k, qv) * qk_scale  # [PAGES*S, GP] base-2 logits
        s = tl.where(ok.reshape(PAGES * S, 1), s, float("-inf")).reshape(PAGES, S, GP)
        m = tl.max(s, 1)  # [PAGES, GP]
        m_use = tl.where(m == float("-inf"), 0.0, m)
        l = tl.sum(tl.exp2(s - m_use[:, None, :]), 1)
        lse = tl.where(l > 0.0, (m_use + tl.log2(tl.where(l > 0.0, l, 1.0))) * 0.6931471805599453, float("-inf"))
        at = out + qrow[None, :].to(tl.int64) * out_stride + pi[:, None]
        tl.store(at, lse, mask=(pi < n_pages)[:, None] & row_ok[None, :])


@triton.jit
def _lse_step(m_run, l_run, qt, start, hi, bt, kp, ksp, kzp, out, qrow, row_ok, h, qk_scale, out_stride, n_pages,
              H: tl.constexpr, GP: tl.constexpr, S: tl.constexpr, D: tl.constexpr, PAGES: tl.constexpr,
              W: tl.constexpr, KIND: tl.constexpr, ON_GPU: tl.constexpr, MASKED: tl.constexpr):
    # one step of _page_lse_kernel_t over the PAGES pages from token `start`: their log-sum-exp
    # stored, the slice's running (max, sum) in base 2 carried on. MASKED: tokens at or past hi
    # are left out; without it every token of the step must exist
    BW: tl.constexpr = (PAGES // W) * S
    pi = start // S + tl.arange(0, PAGES)
    if MASKED:
        page = tl.load(bt + pi, mask=pi * S < hi, other=0).to(tl.int64)
        ok = (start + tl.arange(0, PAGES * S) < hi).reshape(PAGES, S)
    else:
        page = tl.load(bt + pi).to(tl.int64)
        ok = None
    k = load_keys_f16(kp, ksp, kzp, page, ok, h, H, S, D, PAGES, KIND, ON_GPU)
    s = (tl.dot(k.reshape(W, BW, D), qt) * qk_scale).reshape(PAGES, S, GP)  # base-2 logits
    if MASKED:
        s = tl.where(ok.reshape(PAGES, S, 1), s, float("-inf"))
    mp = tl.max(s, 1)  # [PAGES, GP]
    mu = tl.where(mp == float("-inf"), 0.0, mp)
    lp = tl.sum(tl.exp2(s - mu[:, None, :]), 1)
    lse = tl.where(lp > 0.0, (mu + tl.log2(tl.where(lp > 0.0, lp, 1.0))) * 0.6931471805599453, float("-inf"))
    at = out + qrow[None, :].to(tl.int64) * out_stride + pi[:, None]
    tl.store(at, lse, mask=(pi < n_pages)[:, None] & row_ok[None, :])
    m_new = tl.maximum(m_run, tl.max(mp, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_run = l_run * tl.exp2(m_run - m_use) + tl.sum(lp * tl.exp2(mp - m_use[None, :]), 0)
    return m_new, l_run


@triton.jit
def _page_lse_kernel_t(q, kp, ksp, kzp, block_table, seq_lens, out, part, qk_scale, bt_stride, out_stride, n_pages,
                       split_tokens, max_len, n_parts, sp0, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                       S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, PAGES: tl.constexpr,
                       W: tl.constexpr, ON_GPU: tl.constexpr, PEEL: tl.constexpr):
    # q [B, Hq, D]; out [B, Hq, n_pages] fp32 rows out_stride apart; part [B * Hq, n_parts, 2]
    # fp32: this slice's (max, sum of exp(x - max)) of its logits, natural log, at column sp0 + sp.
    # A program takes the slots [sp * split_tokens, + split_tokens) of row b's table (at most
    # max_len tokens); slots past the row's tokens get -inf.
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    BN: tl.constexpr = PAGES * S
    seq_len = tl.load(seq_lens + b)
    lo = sp * split_tokens
    end = tl.minimum(lo + split_tokens, max_len)
    hi = tl.minimum(seq_len, end)
    r = tl.arange(0, GP)
    row_ok = r < G
    qrow = b * (H * G) + h * G + r
    d = tl.arange(0, D)
    qv = tl.load(q + qrow[None, :] * D + d[:, None], mask=row_ok[None, :], other=0.0).to(tl.float16)  # [D, GP]
    qt = tl.broadcast_to(qv[None, :, :], (W, D, GP))
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    bt = block_table + b.to(tl.int64) * bt_stride
    if PEEL:
        full = lo + tl.maximum(hi - lo, 0) // BN * BN
        for start in range(lo, full, BN):
            m_run, l_run = _lse_step(m_run, l_run, qt, start, hi, bt, kp, ksp, kzp, out, qrow, row_ok, h, qk_scale,
                                     out_stride, n_pages, H, GP, S, D, PAGES, W, KIND, ON_GPU, False)
        if full < hi:
            m_run, l_run = _lse_step(m_run, l_run, qt, full, hi, bt, kp, ksp, kzp, out, qrow, row_ok, h, qk_scale,
                                     out_stride, n_pages, H, GP, S, D, PAGES, W, KIND, ON_GPU, True)
    else:
        for start in range(lo, hi, BN):
            m_run, l_run = _lse_step(m_run, l_run, qt, start, hi, bt, kp, ksp, kzp, out, qrow, row_ok, h, qk_scale,
                                     out_stride, n_pages, H, GP, S, D, PAGES, W, KIND, ON_GPU, True)
    # the slice's slots past the row's tokens (no keys to read): -inf
    for start in range(lo + tl.maximum(hi - lo + BN - 1, 0) // BN * BN, end, BN):
        pi = start // S + tl.arange(0, PAGES)
        at = out + qrow[None, :].to(tl.int64) * out_stride + pi[:, None]
        tl.store(at, tl.full([PAGES, GP], float("-inf"), tl.float32), mask=(pi < n_pages)[:, None] & row_ok[None, :])
    mt = tl.where(l_run > 0.0, m_run * 0.6931471805599453, float("-inf"))
    at = part + (qrow.to(tl.int64) * n_parts + sp0 + sp) * 2
    tl.store(at, mt, mask=row_ok)
    tl.store(at + 1, l_run, mask=row_ok)


# the decode step's pass (`transposed`: _page_lse_kernel_t, as paged_decode's int8 tile: pages a
# step, warps, programs an SM and how they fill it, the fewest steps a split) or the other
# (pages a step, steps a program); benchmarks/cache/kvsplit_bench.py --tune times both
DEFAULT_CONFIG = {"transposed": True, "pages": 2, "num_warps": 1, "num_stages": 3, "programs_per_sm": 16,
                  "fill": "waves", "min_steps": 2, "peel": True, "words": True}
BLOCK_CONFIG = {"transposed": False, "pages": 8, "iters": 1, "num_warps": 4, "num_stages": 3}  # `shared`'s
SHARED_COLUMNS = 64  # query heads of a product when rows share their pages (page_lse's `shared`)


_CHECKED: dict[tuple, tuple] = {}  # what the checks found, per kind of call (as paged_decode's _TILES)


def _plan(q, pages, block_table, seq_lens, config, shared) -> tuple:
    """What a page_lse call launches, checked once per kind of call: (transposed, constexprs,
    their key, D, splits, tokens a split)."""
    key = _signature(q, pages, block_table, seq_lens) if config is None else None
    key = key and (key, shared)
    hit = _CHECKED.get(key) if key is not None else None
    if hit is not None:
        return hit
    codec, h, s, d, b, dev = check_decode(q, pages, block_table, seq_lens)
    g = q.shape[1] // h
    cfg = {**(BLOCK_CONFIG if shared else DEFAULT_CONFIG), **(config or {})}
    if shared and cfg["transposed"]:
        raise KernelArgError("rows sharing their pages take the block layout (transposed False)")
    # codes as int32 words need 4-byte aligned rows (true of whole page tensors)
    words = bool(cfg.get("words")) and s % 4 == 0 and pages["k"].data_ptr() % 4 == 0
    common = dict(H=h, G=g, S=s, D=d, KIND=KIND[codec], PAGES=cfg["pages"], ON_GPU=_on_gpu(codec, cfg, words),
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    ns = step = 0
    if cfg["transposed"]:
        if cfg["pages"] % cfg["num_warps"]:
            raise KernelArgError(f"transposed needs pages ({cfg['pages']}) divisible by num_warps ({cfg['num_warps']})")
        bn = cfg["pages"] * s
        if b and block_table.shape[1]:  # else nothing is launched
            ns, step = num_splits(b, h, block_table.shape[1] * s, dev, bn, cfg.get("programs_per_sm", 16),
                                  min_split=cfg.get("min_steps", 2) * bn, fill=cfg.get("fill", "waves"))
        consts = dict(common, GP=triton.next_power_of_2(g), W=cfg["num_warps"], PEEL=bool(cfg.get("peel")))
    else:
        rows = max(1, SHARED_COLUMNS // g) if shared else 1
        consts = dict(common, GP=max(16, triton.next_power_of_2(rows * g)), ROWS=rows, ITERS=cfg.get("iters", 1))
    hit = (bool(cfg["transposed"]), consts, tuple(sorted(consts.items())), d, ns, step)
    if key is not None:
        if len(_CHECKED) >= 256:
            _CHECKED.clear()
        _CHECKED[key] = hit
    return hit


def page_lse(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
             sm_scale: float | None = None, out: torch.Tensor | None = None, config: dict | None = None,
             shared: bool = False, part: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """q [B, Hq, D] 16-bit; pages one layer's page fields (any codec; only the keys are read);
    block_table [B, n] int32 page ids; seq_lens [B] int32 tokens (at most n * S).

    Returns [B, Hq, n] fp32: per query head and page slot, log of the sum over the page's tokens
    of exp(q . k * sm_scale); -inf for a slot past the sequence's tokens. `out`, if given, is
    written and returned: [B, Hq, n] fp32 whose last dimension is contiguous (a slice of a wider
    buffer, so that several sets of pages fill one). `config` overrides DEFAULT_CONFIG (or, with
    `shared`, BLOCK_CONFIG), for tuning. `shared`: every row has the same block table and length
    (a chunk's queries over one sequence's pages; block_table and seq_lens may then be expanded
    views): a program takes several rows, each page read once for them (SHARED_COLUMNS query
    heads a product). `part` (the transposed pass; page_lse_sets): where its slices' partial
    normalizers go, a [B * Hq, P, 2] fp32 buffer and the first of this call's columns."""
    transposed, consts, ckey, d, ns, step = _plan(q, pages, block_table, seq_lens, config, shared)
    b, hq, _ = q.shape
    n = block_table.shape[1]
    if out is None:
        out = torch.empty(b, hq, n, device=q.device, dtype=torch.float32)
    elif (out.shape != (b, hq, n) or out.dtype != torch.float32 or out.device != q.device or out.stride(2) != 1
          or out.stride(0) != hq * out.stride(1)):
        raise KernelArgError(f"out must be [{b}, {hq}, {n}] fp32 on {q.device}, rows evenly strided, pages contiguous")
    if n == 0 or b == 0:
        return out
    scale = softmax_scale(sm_scale, d) * LOG2E
    keys = field_args(pages)[:3]
    if not transposed:
        args = (q, *keys, block_table, seq_lens, out, scale, block_table.stride(0), out.stride(1), n, b)
        launch(_page_lse_kernel, (triton.cdiv(b, consts["ROWS"]), consts["H"],
                                  triton.cdiv(n, consts["PAGES"] * consts["ITERS"])), args, consts, ckey)
        return out
    if part is None:
        buf, col = torch.empty(b * hq, ns, 2, device=q.device, dtype=torch.float32), 0
    else:
        buf, col = part
        if buf.dim() != 3 or buf.shape[0] != b * hq or buf.shape[2] != 2 or not 0 <= col <= buf.shape[1] - ns \
                or not buf.is_contiguous() or buf.dtype != torch.float32:
            raise KernelArgError(f"part must be a contiguous [{b * hq}, P, 2] fp32 buffer with {ns} columns from {col}")
    args = (q, *keys, block_table, seq_lens, out, buf, scale, block_table.stride(0), out.stride(1), n, step, n * consts["S"],
            buf.shape[1], col)
    launch(_page_lse_kernel_t, (b, consts["H"], ns), args, consts, ckey)
    return out


def lse_splits(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
               config: dict | None = None) -> int:
    """Columns of `part` a page_lse call writes (its slices; 0 when it writes none)."""
    return _plan(q, pages, block_table, seq_lens, config, False)[4]


def page_lse_sets(q: torch.Tensor, sets: list[tuple], sm_scale: float | None = None,
                  config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every page's log-sum-exp over several sets of pages of the same rows (pools of different
    codecs), side by side in the order given, and the softmax's normalizer over all of them.

    sets: (pages, block_table [B, n_i], seq_lens [B]) each, as page_lse takes them. Returns
    scores [B, Hq, sum n_i] fp32 and total [B, Hq] fp32 (-inf for a row of no tokens): joined
    from the slices' partial sums (one small kernel) where the pass keeps them, else summed over
    the scores (page_pick.page_total)."""
    from .page_pick import join_totals, page_total

    b, hq, _ = q.shape
    widths = [t.shape[1] for _, t, _ in sets]
    scores = torch.empty(b, hq, sum(widths), device=q.device, dtype=torch.float32)
    cols = [lse_splits(q, *entry, config=config) for entry in sets]
    parts = all(cols) and b * hq > 0
    buf = torch.empty(b * hq, sum(cols), 2, device=q.device, dtype=torch.float32) if parts else None
    lo = col = 0
    for (pages, table, lens), w, c in zip(sets, widths, cols):
        page_lse(q, pages, table, lens, sm_scale, out=scores[:, :, lo:lo + w], config=config,
                 part=(buf, col) if parts else None)
        lo, col = lo + w, col + c
    return scores, join_totals(buf, b, hq) if parts else page_total(scores)


def page_lse_ref(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor,
                 seq_lens: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """page_lse in fp32 from the keys dequantized by kernels/quantize.py."""
    from . import quantize as ref

    b, hq, d = q.shape
    s = pages["k"].shape[2]
    h = pages["k"].shape[1]
    n = block_table.shape[1]
    scale = softmax_scale(sm_scale, d)
    out = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(b):
        used = -(-int(seq_lens[i]) // s)
        if not used:
            continue
        idx = block_table[i, :used].long()
        k, _ = ref.decode_pages({f: t[idx.to(t.device)].to(q.device) for f, t in pages.items()})  # [n, H, S, D]
        k = k.float().repeat_interleave(hq // h, dim=1)  # [n, Hq, S, D]
        logits = torch.einsum("hd,nhsd->hns", q[i].float(), k) * scale
        tok = torch.arange(used * s, device=q.device).view(used, s) < int(seq_lens[i])
        logits = logits.masked_fill(~tok[None], float("-inf"))
        out[i, :, :used] = torch.logsumexp(logits, dim=-1)
    return out
