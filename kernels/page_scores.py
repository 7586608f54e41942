"""Each page's log-sum-exp of one decode query's attention logits: the K/V split's scores.

The K/V split (kvguard/cache/split.py) keeps keys on the device and the values of cold pages in
host memory. Before a decode step reads any value it needs, for every page, how much of the
softmax falls there: this pass reads keys only and writes, per query head and page, the
natural log of the sum of exp of the page's scaled logits. The logsumexp over every page of
every set is the softmax's normalizer, and exp(page - normalizer) the page's mass, exactly.

Grid B x H x page chunks: a program takes one sequence, one KV head with its group of query
heads (the columns of one tensor-core product, padded to 16), and PAGES pages. Queries of one
sequence (a chunk's, which share its block table) may go ROWS to a program (`shared`): each
page's keys are then read once for ROWS queries, the product's columns ROWS groups of heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import KIND, KernelArgError, check_decode, field_args, softmax_scale
from ._launch import launch
from ._pages import load_keys_f16
from .paged_decode import _on_gpu, _signature

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


# pages a step, steps a program, and the launch's (benchmarks/kvsplit_bench.py --tune)
DEFAULT_CONFIG = {"pages": 8, "iters": 1, "num_warps": 4, "num_stages": 3}
SHARED_COLUMNS = 64  # query heads of a product when rows share their pages (page_lse's `shared`)


_CHECKED: dict[tuple, tuple] = {}  # what the checks found, per kind of call (as paged_decode's _TILES)


def page_lse(q: torch.Tensor, pages: dict[str, torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
             sm_scale: float | None = None, out: torch.Tensor | None = None, config: dict | None = None,
             shared: bool = False) -> torch.Tensor:
    """q [B, Hq, D] 16-bit; pages one layer's page fields (any codec; only the keys are read);
    block_table [B, n] int32 page ids; seq_lens [B] int32 tokens (at most n * S).

    Returns [B, Hq, n] fp32: per query head and page slot, log of the sum over the page's tokens
    of exp(q . k * sm_scale); -inf for a slot past the sequence's tokens. `out`, if given, is
    written and returned: [B, Hq, n] fp32 whose last dimension is contiguous (a slice of a wider
    buffer, so that several sets of pages fill one). `config` overrides DEFAULT_CONFIG (pages a
    step, steps a program, num_warps, num_stages), for tuning. `shared`: every row has the same
    block table and length (a chunk's queries over one sequence's pages; block_table and
    seq_lens may then be expanded views): a program takes several rows, each page read once
    for them (SHARED_COLUMNS query heads a product)."""
    key = _signature(q, pages, block_table, seq_lens) if config is None else None
    key = key and (key, shared)
    hit = _CHECKED.get(key) if key is not None else None
    if hit is None:
        codec, h, s, d, _, _ = check_decode(q, pages, block_table, seq_lens)
        g = q.shape[1] // h
        rows = max(1, SHARED_COLUMNS // g) if shared else 1
        cfg = {**DEFAULT_CONFIG, **(config or {})}
        # codes as int32 words need 4-byte aligned rows (true of whole page tensors)
        words = bool(cfg.get("words")) and s % 4 == 0 and pages["k"].data_ptr() % 4 == 0
        consts = dict(H=h, G=g, GP=max(16, triton.next_power_of_2(rows * g)), ROWS=rows, S=s, D=d, KIND=KIND[codec],
                      PAGES=cfg["pages"], ITERS=cfg["iters"], ON_GPU=_on_gpu(codec, cfg, words),
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        hit = (consts, tuple(sorted(consts.items())), d)
        if key is not None:
            if len(_CHECKED) >= 256:
                _CHECKED.clear()
            _CHECKED[key] = hit
    consts, ckey, d = hit
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
    args = (q, *field_args(pages)[:3], block_table, seq_lens, out, scale, block_table.stride(0), out.stride(1), n, b)
    launch(_page_lse_kernel, (triton.cdiv(b, consts["ROWS"]), consts["H"], triton.cdiv(n, consts["PAGES"] * consts["ITERS"])),
           args, consts, ckey)
    return out


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


# --- the pages a decode step reads: each page's mass, then the rule's picks ----------------------

@triton.jit
def _page_mass_kernel(scores, total, mass, n, s_row, s_head, m_row, HQ: tl.constexpr, HP: tl.constexpr,
                      BLOCK: tl.constexpr):
    # mass[b, p] = max over query heads h of exp(scores[b, h, p] - total[b, h])
    b = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = tl.arange(0, HP)
    ok = (h[:, None] < HQ) & (p[None, :] < n)
    s = tl.load(scores + b.to(tl.int64) * s_row + h[:, None] * s_head + p[None, :], mask=ok, other=float("-inf"))
    t = tl.load(total + b * HQ + h, mask=h < HQ, other=0.0)
    t = tl.where(t == float("-inf"), 0.0, t)  # a row of no pages: every mass 0
    m = tl.max(tl.where(s == float("-inf"), 0.0, tl.exp(s - t[:, None])), 0)  # 0 past the row's pages
    tl.store(mass + b.to(tl.int64) * m_row + p, m, mask=p < n)


@triton.jit
def _digit(row, n, offs, prefix, high, need, SHIFT: tl.constexpr, MASK: tl.constexpr, BLOCK: tl.constexpr):
    # one digit of a radix select: among the pages whose bits above SHIFT are `prefix`, the
    # digit of the need-th largest, and its rank among those that share it
    hist = tl.zeros((256,), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        i = start + offs
        bits = tl.load(row + i, mask=i < n, other=-1.0).to(tl.int32, bitcast=True)
        ok = (i < n) & ((bits & high) == prefix)
        hist += tl.histogram((bits >> SHIFT) & MASK, 256, mask=ok)
    d = tl.arange(0, 256)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # pages at this digit or a higher one
    digit = tl.max(tl.where((above >= need) & (d <= MASK), d, 0), 0)
    need -= tl.sum(tl.where(d > digit, hist, 0), 0)
    return prefix | (digit << SHIFT), high | (MASK << SHIFT), need


@triton.jit
def _page_pick_kernel(mass, table, want, chosen, count, n, threshold, m_row, t_row, c_row, TOPK: tl.constexpr,
                      BLOCK: tl.constexpr):
    # one row: the pages to read, in page order, into chosen[b, :count[b]]. TOPK: the want[b]
    # of largest mass (ties at the k-th value go to the lower pages); else every page whose
    # mass reaches `threshold`. Masses are >= 0, so their bits order as they do.
    b = tl.program_id(0)
    row = mass + b.to(tl.int64) * m_row
    offs = tl.arange(0, BLOCK)
    if TOPK:  # the k-th largest mass's bits, 7 then 8 at a time from the top (a radix select)
        k = tl.load(want + b)
        prefix = tl.zeros((), dtype=tl.int32)  # the bits found so far
        high = tl.zeros((), dtype=tl.int32)  # which bits those are
        need = k  # the k-th largest's rank among the pages that share the prefix
        prefix, high, need = _digit(row, n, offs, prefix, high, need, 24, 127, BLOCK)  # bit 31 is 0
        prefix, high, need = _digit(row, n, offs, prefix, high, need, 16, 255, BLOCK)
        prefix, high, need = _digit(row, n, offs, prefix, high, need, 8, 255, BLOCK)
        lo, _, ties = _digit(row, n, offs, prefix, high, need, 0, 255, BLOCK)  # ties: pages at it still to take
    at = tl.zeros((), dtype=tl.int32)
    seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        i = start + offs
        x = tl.load(row + i, mask=i < n, other=-1.0)
        if TOPK:
            bits = x.to(tl.int32, bitcast=True)
            eq = (bits == lo) & (i < n)
            rank = seen + tl.cumsum(eq.to(tl.int32), 0) - 1
            keep = (((bits > lo) & (i < n)) | (eq & (rank < ties))) & (k > 0)
            seen += tl.sum(eq.to(tl.int32), 0)
        else:
            keep = (x >= threshold) & (i < n)
        pos = at + tl.cumsum(keep.to(tl.int32), 0) - 1
        page = tl.load(table + b.to(tl.int64) * t_row + i, mask=keep, other=0)
        tl.store(chosen + b.to(tl.int64) * c_row + pos, page, mask=keep)
        at += tl.sum(keep.to(tl.int32), 0)
    tl.store(count + b, at)


def page_pick(scores: torch.Tensor, total: torch.Tensor, table: torch.Tensor, width: int,
              want: torch.Tensor | None = None, threshold: float = 0.0,
              config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages a decode step reads, chosen on the device with no host wait.

    scores [B, Hq, n] fp32 (page_lse's, last dimension contiguous), total [B, Hq] fp32 the
    softmax's normalizer over every page; a page's mass is the largest over query heads of
    exp(score - total). table [B, n] int32 the pages' ids. With `want` ([B] int32, each at most
    `width` and at most the row's pages), row b reads the want[b] pages of largest mass (ties
    to the lower slots); without, every page whose mass reaches `threshold`.

    Returns (chosen [B, width] int32, the page ids in slot order in the first count[b] of row b;
    count [B] int32). `config` overrides PICK_CONFIG (pages a step of the pick's loops, and its
    warps), for tuning.

    One program a row picks: the top-k by a radix select over the masses' bits (four passes
    over the row's masses, then one that writes the picks), the threshold in that last pass."""
    b, hq, n = scores.shape
    if scores.dtype != torch.float32 or scores.stride(2) != 1 or total.shape != (b, hq) or not total.is_contiguous():
        raise KernelArgError(f"scores must be [B, Hq, n] fp32 with contiguous pages and total [B, Hq] fp32; got "
                             f"{tuple(scores.shape)} {scores.dtype}, total {tuple(total.shape)}")
    if table.shape != (b, n) or table.dtype != torch.int32 or table.stride(1) != 1:
        raise KernelArgError(f"table must be [{b}, {n}] int32 with contiguous rows")
    if want is not None and (want.shape != (b,) or want.dtype != torch.int32):
        raise KernelArgError(f"want must be [{b}] int32")
    if not 0 <= width <= n:
        raise KernelArgError(f"width {width} must lie in [0, {n}]")
    chosen = torch.empty(b, width, device=scores.device, dtype=torch.int32)
    count = torch.empty(b, device=scores.device, dtype=torch.int32)
    if b == 0:
        return chosen, count
    mass = torch.empty(b, n, device=scores.device, dtype=torch.float32)
    blk = 256
    hp = max(2, triton.next_power_of_2(hq))
    launch(_page_mass_kernel, (b, max(1, triton.cdiv(n, blk))),
           (scores, total, mass, n, scores.stride(0), scores.stride(1), mass.stride(0)),
           dict(HQ=hq, HP=hp, BLOCK=blk, num_warps=4), (hq, hp, blk))
    topk = want is not None
    cfg = {**PICK_CONFIG, **(config or {})}
    blk, warps = cfg["block"], cfg["num_warps"]
    if config is None:  # a short row in one step of the loops, a warp per 1024 pages
        blk = min(blk, max(1024, triton.next_power_of_2(n)))
        warps = min(warps, max(4, blk // 1024))
    launch(_page_pick_kernel, (b,),
           (mass, table, want if topk else count, chosen, count, n, float(threshold), mass.stride(0), table.stride(0),
            chosen.stride(0)),
           dict(TOPK=topk, BLOCK=blk, num_warps=warps), (topk, blk, warps))
    return chosen, count


PICK_CONFIG = {"block": 16384, "num_warps": 16}  # benchmarks/kvsplit_bench.py --tune


@triton.jit
def _total_kernel(scores, total, n, s_row, HQ: tl.constexpr, BLOCK: tl.constexpr):
    # total[b, h] = log of the sum over pages of exp(scores[b, h, :]), one program a row
    row = tl.program_id(0)
    base = scores + (row // HQ).to(tl.int64) * s_row + (row % HQ) * n
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, n, BLOCK):
        m = tl.maximum(m, tl.load(base + start + offs, mask=start + offs < n, other=float("-inf")))
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.exp(tl.load(base + start + offs, mask=start + offs < n, other=float("-inf")) - top)
    tot = tl.sum(acc, 0)
    tl.store(total + row, tl.where(tot > 0.0, top + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf")))


def page_total(scores: torch.Tensor) -> torch.Tensor:
    """The softmax's normalizer over every page: scores [B, Hq, n] fp32 (rows (b, h) n apart) ->
    [B, Hq], -inf for a row of no pages (torch.logsumexp's, in one launch)."""
    b, hq, n = scores.shape
    if scores.dtype != torch.float32 or scores.stride(2) != 1 or scores.stride(1) != n:
        raise KernelArgError("scores must be [B, Hq, n] fp32 with rows of heads contiguous")
    total = torch.empty(b, hq, device=scores.device, dtype=torch.float32)
    if b * hq:
        launch(_total_kernel, (b * hq,), (scores, total, n, scores.stride(0)), dict(HQ=hq, BLOCK=1024, num_warps=4),
               (hq, 1024))
    return total


@triton.jit
def _rescale_kernel(out, part, total, D: tl.constexpr):
    # out[r, :] *= exp(part[r] - total[r]), in out's 16-bit dtype through fp32
    r = tl.program_id(0)
    d = tl.arange(0, D)
    w = tl.exp(tl.load(part + r) - tl.load(total + r))
    x = tl.load(out + r.to(tl.int64) * D + d).to(tl.float32)
    tl.store(out + r.to(tl.int64) * D + d, (x * w).to(out.dtype.element_ty))


def rescale(out: torch.Tensor, part: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Attention normalized over some of the keys (part, its log-normalizer) scaled to the whole
    softmax (total): out [B, Hq, D] 16-bit, in place, times exp(part - total) ([B, Hq] fp32)."""
    b, hq, d = out.shape
    if (not out.is_contiguous() or part.shape != (b, hq) or total.shape != (b, hq) or not part.is_contiguous()
            or not total.is_contiguous() or d & (d - 1)):
        raise KernelArgError("rescale takes a contiguous out [B, Hq, D] (D a power of 2) and [B, Hq] fp32 part, total")
    if b * hq:
        launch(_rescale_kernel, (b * hq,), (out, part, total), dict(D=d, num_warps=1), (d,))
    return out
