"""What a K/V split decode step does with the key pass's scores: the softmax's normalizer, each
page's mass, and the pages whose values it reads, all on the device with no host wait.

kernels/page_scores.py writes each page's log-sum-exp per query head. From those:
`page_total` is the normalizer over every page, `page_pick` gives each page its mass (the
largest over query heads of exp(score - total)) and picks the pages to read, by a top-k or by
a threshold (one for all rows, or a row's own: a coverage rule's); `rescale` scales an output
normalized over the pages read to the whole softmax.

Each has two ways to run. One program a row (a row's masses: one sequence, or one (sequence,
query head) for the normalizer) loops over the row: few launches, fit for short rows, latency-
bound on long ones (a 240K-token row is 15,000 pages). Many programs a row, each on a block of
the row: the normalizer from per-block partial sums, the top-k by a radix select whose digit
histograms the blocks add up with atomics (one launch a digit, each recomputing the digits
before it from the histograms), then a count of each block's picks and a write of them at
their place in page order. Both give the same picks (ties at the k-th largest mass go to the
lower slots) and the same normalizer up to rounding. Rows of at least PICK_CONFIG["many_from"]
pages take the second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _interpreter  # noqa: F401  (loop bounds under Triton 3.6's interpreter with NumPy >= 2.4)
from ._checks import KernelArgError
from ._launch import launch

# "block", "num_warps": the one-program pick's loop step and warps; "select": how it finds the
# k-th largest mass, by a radix select (four digit histograms) or a bisection on the bits (31
# counts, from registers when the row fits a block); "many_from": rows of at least this many
# pages take the many-program path (None: never); "many_block": its pages a program
# (benchmarks/cache/kvsplit_bench.py --tune times each)
PICK_CONFIG = {"block": 16384, "num_warps": 16, "select": "radix", "many_from": 4096, "many_block": 256}
SELECTS = ("radix", "bisect")
DIGITS = 4  # the radix select's 8-bit digits of a mass's 32 bits (a row's histograms: 4 x 256 = 1024 counts)


@triton.jit
def _page_mass_kernel(scores, total, mass, hist, n, s_row, s_head, m_row, HQ: tl.constexpr, HP: tl.constexpr,
                      BLOCK: tl.constexpr, HIST: tl.constexpr):
    # mass[b, p] = max over query heads h of exp(scores[b, h, p] - total[b, h]); HIST: add the
    # block's histogram of the masses' top digit to hist[b, 0, :]
    b = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = tl.arange(0, HP)
    ok = (h[:, None] < HQ) & (p[None, :] < n)
    s = tl.load(scores + b.to(tl.int64) * s_row + h[:, None] * s_head + p[None, :], mask=ok, other=float("-inf"))
    t = tl.load(total + b * HQ + h, mask=h < HQ, other=0.0)
    t = tl.where(t == float("-inf"), 0.0, t)  # a row of no pages: every mass 0
    m = tl.max(tl.where(s == float("-inf"), 0.0, tl.exp(s - t[:, None])), 0)  # 0 past the row's pages
    tl.store(mass + b.to(tl.int64) * m_row + p, m, mask=p < n)
    if HIST:
        _add_digit(hist + b * 1024, m.to(tl.int32, bitcast=True), p < n, 0)


# --- one program a row ---------------------------------------------------------------------------

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
    digit, need = _select(hist, need, MASK)
    return prefix | (digit << SHIFT), high | (MASK << SHIFT), need


@triton.jit
def _select(hist, need, MASK: tl.constexpr):
    # from one digit's histogram [256] (digits above MASK never taken): the digit of the need-th
    # largest, and its rank among the pages that share that digit
    d = tl.arange(0, 256)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # pages at this digit or a higher one
    digit = tl.max(tl.where((above >= need) & (d <= MASK), d, 0), 0)
    return digit, need - tl.sum(tl.where(d > digit, hist, 0), 0)


@triton.jit
def _reach(row, n, offs, x, u, ONE: tl.constexpr, BLOCK: tl.constexpr):
    # the pages whose mass's bits are at least u (x: the row, when ONE; past it -1.0, whose
    # bits are negative)
    if ONE:
        return tl.sum((x.to(tl.int32, bitcast=True) >= u).to(tl.int32), 0)
    c = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        y = tl.load(row + start + offs, mask=start + offs < n, other=-1.0)
        c += tl.sum((y.to(tl.int32, bitcast=True) >= u).to(tl.int32), 0)
    return c


@triton.jit
def _kth(row, n, offs, k, ONE: tl.constexpr, BLOCK: tl.constexpr):
    # by bisection on the bits: the k-th largest mass's bits (the greatest u that k pages reach),
    # and how many of the pages at it are to be taken (k less those above it)
    x = tl.load(row + offs, mask=offs < n, other=-1.0)
    lo = tl.zeros((), dtype=tl.int32)  # every page reaches it (masses are >= 0)
    hi = tl.full((), 0x7F800001, tl.int32)  # none does (past inf's bits)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        enough = _reach(row, n, offs, x, mid, ONE, BLOCK) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo, k - _reach(row, n, offs, x, lo + 1, ONE, BLOCK)


@triton.jit
def _page_pick_kernel(mass, table, want, chosen, count, n, threshold, rows, m_row, t_row, c_row, TOPK: tl.constexpr,
                      ROWS: tl.constexpr, BISECT: tl.constexpr, ONE: tl.constexpr, BLOCK: tl.constexpr):
    # one row: the pages to read, in page order, into chosen[b, :count[b]]. TOPK: the want[b]
    # of largest mass (ties at the k-th value go to the lower pages), of them those whose mass
    # reaches `threshold` (0: all); else every page whose mass reaches `threshold`. ROWS: the
    # threshold is rows[b]. BISECT: the k-th largest by bisection, not by digits (ONE: the row
    # fits a block). Masses are >= 0, so their bits order as they do.
    b = tl.program_id(0)
    threshold = _threshold(threshold, rows, b, ROWS)
    row = mass + b.to(tl.int64) * m_row
    offs = tl.arange(0, BLOCK)
    if TOPK and BISECT:
        k = tl.load(want + b)
        lo, ties = _kth(row, n, offs, k, ONE, BLOCK)
    elif TOPK:  # the k-th largest mass's bits, 7 then 8 at a time from the top (a radix select)
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
            keep = (((bits > lo) & (i < n)) | (eq & (rank < ties))) & (k > 0) & (x >= threshold)
            seen += tl.sum(eq.to(tl.int32), 0)
        else:
            keep = (x >= threshold) & (i < n)
        pos = at + tl.cumsum(keep.to(tl.int32), 0) - 1
        page = tl.load(table + b.to(tl.int64) * t_row + i, mask=keep, other=0)
        tl.store(chosen + b.to(tl.int64) * c_row + pos, page, mask=keep)
        at += tl.sum(keep.to(tl.int32), 0)
    tl.store(count + b, at)


# --- many programs a row -------------------------------------------------------------------------
# hist [B, DIGITS, 256] int32 (zeroed): digit j's histogram over the pages that share the
# digits above it with the k-th largest mass; counts [B, C, 2] int32: each block's pages above
# the k-th largest (or reaching the threshold) and at it.

@triton.jit
def _add_digit(hist, bits, ok, J: tl.constexpr):
    # add the histogram of digit J of `bits` (where ok) to hist[J, :]
    local = tl.histogram((bits >> (24 - 8 * J)) & 255, 256, mask=ok)
    d = tl.arange(0, 256)
    tl.atomic_add(hist + J * 256 + d, local, mask=local > 0, sem="relaxed")


@triton.jit
def _known(hist, k, J: tl.constexpr):
    # from the histograms of digits 0..J-1: the bits of the k-th largest mass found so far, which
    # bits those are, and its rank among the pages that share them
    d = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.int32)
    high = tl.zeros((), dtype=tl.int32)
    need = k
    for j in tl.static_range(J):
        digit, need = _select(tl.load(hist + j * 256 + d), need, 255)
        prefix = prefix | (digit << (24 - 8 * j))
        high = ~((1 << (24 - 8 * j)) - 1)  # bits 31 .. 24 - 8j (bit 31 is 0 in every mass)
    return prefix, high, need


@triton.jit
def _many_digit_kernel(mass, want, hist, n, m_row, J: tl.constexpr, BLOCK: tl.constexpr):
    # digit J's histogram of a block's pages that share digits 0..J-1 with the k-th largest
    b = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hb = hist + b * 1024
    prefix, high, _ = _known(hb, tl.load(want + b), J)
    bits = tl.load(mass + b.to(tl.int64) * m_row + i, mask=i < n, other=0.0).to(tl.int32, bitcast=True)
    _add_digit(hb, bits, (i < n) & ((bits & high) == prefix), J)


@triton.jit
def _threshold(threshold, rows, b, ROWS: tl.constexpr):
    # the row's threshold: one for every row, or its own (a coverage rule's)
    if ROWS:
        threshold = tl.load(rows + b)
    return threshold


@triton.jit
def _keeps(mass, want, hist, n, threshold, rows, m_row, b, i, TOPK: tl.constexpr, ROWS: tl.constexpr):
    # a block's pages: those above the k-th largest mass (or reaching the threshold), those at
    # it, and how many of the row's pages at it are to be taken (none when the row takes none)
    threshold = _threshold(threshold, rows, b, ROWS)
    x = tl.load(mass + b.to(tl.int64) * m_row + i, mask=i < n, other=0.0)
    if TOPK:
        k = tl.load(want + b)
        lo, _, ties = _known(hist + b * 1024, k, 4)
        bits = x.to(tl.int32, bitcast=True)
        above = (bits > lo) & (i < n) & (k > 0) & (x >= threshold)
        at = (bits == lo) & (i < n) & (k > 0) & (x >= threshold)  # all or none: they share one mass
    else:
        above = (x >= threshold) & (i < n)
        at = i < 0
        ties = 0
    return above, at, ties


@triton.jit
def _many_count_kernel(mass, want, hist, counts, n, threshold, rows, m_row, C, TOPK: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    above, at, _ = _keeps(mass, want, hist, n, threshold, rows, m_row, b, c * BLOCK + tl.arange(0, BLOCK), TOPK,
                          ROWS)
    base = counts + (b * C + c) * 2
    tl.store(base, tl.sum(above.to(tl.int32), 0))
    tl.store(base + 1, tl.sum(at.to(tl.int32), 0))


@triton.jit
def _many_write_kernel(mass, table, want, hist, counts, chosen, count, n, threshold, rows, m_row, t_row, c_row, C,
                       TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CP: tl.constexpr):
    # a block's picks at their place in the row's page order: after those of the blocks before
    b = tl.program_id(0)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    above, at, ties = _keeps(mass, want, hist, n, threshold, rows, m_row, b, i, TOPK, ROWS)
    cc = tl.arange(0, CP)
    above_c = tl.load(counts + (b * C + cc) * 2, mask=cc < C, other=0)
    at_c = tl.load(counts + (b * C + cc) * 2 + 1, mask=cc < C, other=0)
    at_before_c = tl.cumsum(at_c, 0) - at_c  # pages at the k-th largest in the blocks before each
    taken_c = above_c + tl.minimum(tl.maximum(ties - at_before_c, 0), at_c)
    start = tl.sum(tl.where(cc < c, taken_c, 0), 0)
    rank = tl.sum(tl.where(cc < c, at_c, 0), 0) + tl.cumsum(at.to(tl.int32), 0) - 1
    keep = above | (at & (rank < ties))
    pos = start + tl.cumsum(keep.to(tl.int32), 0) - 1
    page = tl.load(table + b.to(tl.int64) * t_row + i, mask=keep, other=0)
    tl.store(chosen + b.to(tl.int64) * c_row + pos, page, mask=keep)
    if c == 0:
        tl.store(count + b, tl.sum(taken_c, 0))


def page_pick(scores: torch.Tensor, total: torch.Tensor, table: torch.Tensor, width: int,
              want: torch.Tensor | None = None, threshold: float = 0.0, coverage: float | None = None,
              config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages a decode step reads, chosen on the device with no host wait.

    scores [B, Hq, n] fp32 (page_lse's, last dimension contiguous), total [B, Hq] fp32 the
    softmax's normalizer over every page; a page's mass is the largest over query heads of
    exp(score - total). table [B, n] int32 the pages' ids. With `want` ([B] int32, each at most
    `width` and at most the row's pages), row b reads the want[b] pages of largest mass (ties
    to the lower slots), of them those whose mass reaches `threshold` (a mass rule capped at
    want[b] pages; 0: all of them); without, every page whose mass reaches `threshold`. With
    `coverage` (instead of a threshold) each row's threshold is its own: the least mass that
    leaves out only pages whose masses sum to at most 1 - coverage (`coverage_threshold`).

    Returns (chosen [B, width] int32, the page ids in slot order in the first count[b] of row b;
    count [B] int32). `config` overrides PICK_CONFIG, for tuning."""
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
    cfg = {**PICK_CONFIG, **(config or {})}
    topk = want is not None
    many = cfg["many_from"] is not None and n >= cfg["many_from"]
    mass = torch.empty(b, n, device=scores.device, dtype=torch.float32)
    hist = torch.zeros(b, DIGITS, 256, device=scores.device, dtype=torch.int32) if many and topk else mass
    blk = 256
    hp = max(2, triton.next_power_of_2(hq))
    launch(_page_mass_kernel, (b, max(1, triton.cdiv(n, blk))),
           (scores, total, mass, hist, n, scores.stride(0), scores.stride(1), mass.stride(0)),
           dict(HQ=hq, HP=hp, BLOCK=blk, HIST=many and topk, num_warps=4), (hq, hp, blk, many and topk))
    wants = want if topk else count
    rows = mass if coverage is None else coverage_threshold(mass, 1.0 - coverage)
    threshold = (float(threshold), rows, coverage is not None)
    if many:
        _pick_many(mass, table, wants, hist, chosen, count, n, threshold, topk, cfg["many_block"])
        return chosen, count
    blk, warps = cfg["block"], cfg["num_warps"]
    if cfg["select"] not in SELECTS:
        raise KernelArgError(f"select must be one of {', '.join(SELECTS)}, got {cfg['select']!r}")
    bisect = topk and cfg["select"] == "bisect"
    if "block" not in (config or {}):  # a short row in one step of the loops, a warp per 1024 pages
        blk = min(blk, max(1024, triton.next_power_of_2(n)))
        warps = min(warps, max(4, blk // 1024))
    one = bisect and n <= blk  # the row in registers (only the bisection reads it)
    launch(_page_pick_kernel, (b,),
           (mass, table, wants, chosen, count, n, *threshold[:2], mass.stride(0), table.stride(0),
            chosen.stride(0)),
           dict(TOPK=topk, ROWS=threshold[2], BISECT=bisect, ONE=one, BLOCK=blk, num_warps=warps),
           (topk, threshold[2], bisect, one, blk, warps))
    return chosen, count


@triton.jit
def _row_sum(row, n, offs, x, upto, ONE: tl.constexpr, BLOCK: tl.constexpr):
    # the sum of the row's masses whose bits are at most `upto` (x: the row, when ONE)
    if ONE:
        return tl.sum(tl.where(x.to(tl.int32, bitcast=True) <= upto, x, 0.0), 0)
    s = tl.zeros((), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        y = tl.load(row + start + offs, mask=start + offs < n, other=0.0)
        s += tl.sum(tl.where(y.to(tl.int32, bitcast=True) <= upto, y, 0.0), 0)
    return s


@triton.jit
def _coverage_kernel(mass, out, n, miss, m_row, ONE: tl.constexpr, BLOCK: tl.constexpr):
    # out[b]: the least mass v of row b with S(v) > miss, S(v) the sum of the masses <= v (inf
    # when the whole row's is at most miss). S only steps at a mass, so v is the least bit
    # pattern u with S(u) > miss, found by bisection on the bits (masses are >= 0, so their
    # bits order as they do). ONE: the row fits in one block, held in registers through it.
    b = tl.program_id(0)
    row = mass + b.to(tl.int64) * m_row
    offs = tl.arange(0, BLOCK)
    x = tl.load(row + offs, mask=offs < n, other=0.0)
    top = tl.max(x, 0)
    if not ONE:
        for start in range(BLOCK, n, BLOCK):
            top = tl.maximum(top, tl.max(tl.load(row + start + offs, mask=start + offs < n, other=0.0), 0))
    lo = tl.full((), -1, tl.int32)  # S(lo) <= miss
    hi = top.to(tl.int32, bitcast=True)  # S(hi) > miss, unless the whole row's is at most miss
    whole = _row_sum(row, n, offs, x, hi, ONE, BLOCK)
    for _ in range(31):
        mid = lo + (hi - lo) // 2  # lo itself once hi = lo + 1: nothing moves
        above = _row_sum(row, n, offs, x, mid, ONE, BLOCK) > miss
        hi = tl.where(above, mid, hi)
        lo = tl.where(above, lo, mid)
    tl.store(out + b, tl.where(whole > miss, hi.to(tl.float32, bitcast=True), float("inf")))


def coverage_threshold(mass: torch.Tensor, miss: float, block: int = 16384) -> torch.Tensor:
    """[B] fp32: each row of mass [B, n] (>= 0, rows contiguous) its least mass whose pages, with
    every page of less or equal mass, sum to more than `miss` (inf when the whole row sums to at
    most that); the pages that reach it are kept, the others hold at most `miss` of every query
    head's attention (kvguard/cache/picks.py `covering`, the reference). One program a row, a
    bisection on the masses' bits (31 sums over the row, held in registers when it fits in
    `block`): no host wait, no shape that follows the data."""
    b, n = mass.shape
    if mass.dtype != torch.float32 or mass.stride(1) != 1:
        raise KernelArgError(f"mass must be [B, n] fp32 with contiguous rows; got {mass.dtype}")
    out = torch.empty(b, device=mass.device, dtype=torch.float32)
    if b == 0:
        return out
    blk = min(block, max(1024, triton.next_power_of_2(n)))
    one = n <= blk
    warps = min(16, max(4, blk // 1024))
    launch(_coverage_kernel, (b,), (mass, out, n, float(miss), mass.stride(0)),
           dict(ONE=one, BLOCK=blk, num_warps=warps), (one, blk, warps))
    return out


def _pick_many(mass, table, wants, hist, chosen, count, n, threshold, topk, blk) -> None:
    """page_pick's many-program path, after the mass kernel (which, for a top-k, added the top
    digit's histogram): the other digits, then each block's count, then its picks. `threshold`:
    (one for every row, [B] one a row, whether the rows' are used)."""
    b = mass.shape[0]
    c = max(1, triton.cdiv(n, blk))
    warps = max(1, min(8, blk // 256))
    if topk:
        for j in range(1, DIGITS):
            launch(_many_digit_kernel, (b, c), (mass, wants, hist, n, mass.stride(0)),
                   dict(J=j, BLOCK=blk, num_warps=warps), (j, blk, warps))
    counts = torch.empty(b, c, 2, device=mass.device, dtype=torch.int32)
    launch(_many_count_kernel, (b, c), (mass, wants, hist, counts, n, *threshold[:2], mass.stride(0), c),
           dict(TOPK=topk, ROWS=threshold[2], BLOCK=blk, num_warps=warps), (topk, threshold[2], blk, warps))
    cp = max(2, triton.next_power_of_2(c))
    launch(_many_write_kernel, (b, c),
           (mass, table, wants, hist, counts, chosen, count, n, *threshold[:2], mass.stride(0), table.stride(0),
            chosen.stride(0), c),
           dict(TOPK=topk, ROWS=threshold[2], BLOCK=blk, CP=cp, num_warps=warps), (topk, threshold[2], blk, cp, warps))


# --- the normalizer, and the rescale to it -------------------------------------------------------

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
    tl.store(total + row, _log_total(top, tl.sum(acc, 0)))


@triton.jit
def _log_total(top, tot):
    # top + log(tot): the log of a sum of exp taken relative to top; -inf for an empty sum
    return tl.where(tot > 0.0, top + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf"))


@triton.jit
def _total_part_kernel(scores, part, n, s_row, P, HQ: tl.constexpr, BLOCK: tl.constexpr):
    # part[row, c] = (max, sum of exp(x - max)) of a block of row (b, h)'s pages
    row = tl.program_id(0)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(scores + (row // HQ).to(tl.int64) * s_row + (row % HQ) * n + i, mask=i < n, other=float("-inf"))
    m = tl.max(x, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    tl.store(part + (row * P + c) * 2, m)
    tl.store(part + (row * P + c) * 2 + 1, tl.sum(tl.exp(x - m_use), 0))


@triton.jit
def _total_join_kernel(part, total, P, PP: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, PP)
    m = tl.load(part + (row * P + c) * 2, mask=c < P, other=float("-inf"))
    s = tl.load(part + (row * P + c) * 2 + 1, mask=c < P, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    tl.store(total + row, _log_total(top, tl.sum(s * tl.exp(m - top), 0)))


def page_total(scores: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The softmax's normalizer over every page: scores [B, Hq, n] fp32 (rows (b, h) n apart) ->
    [B, Hq], -inf for a row of no pages (torch.logsumexp's). Rows of at least
    PICK_CONFIG["many_from"] pages (`config` overrides it) are summed by many programs a row."""
    b, hq, n = scores.shape
    if scores.dtype != torch.float32 or scores.stride(2) != 1 or scores.stride(1) != n:
        raise KernelArgError("scores must be [B, Hq, n] fp32 with rows of heads contiguous")
    total = torch.empty(b, hq, device=scores.device, dtype=torch.float32)
    if not b * hq:
        return total
    cfg = {**PICK_CONFIG, **(config or {})}
    if cfg["many_from"] is None or n < cfg["many_from"]:
        launch(_total_kernel, (b * hq,), (scores, total, n, scores.stride(0)), dict(HQ=hq, BLOCK=1024, num_warps=4),
               (hq, 1024))
        return total
    blk = 2048
    p = max(1, triton.cdiv(n, blk))
    part = torch.empty(b * hq, p, 2, device=scores.device, dtype=torch.float32)
    launch(_total_part_kernel, (b * hq, p), (scores, part, n, scores.stride(0), p), dict(HQ=hq, BLOCK=blk, num_warps=8),
           (hq, blk))
    pp = max(2, triton.next_power_of_2(p))
    launch(_total_join_kernel, (b * hq,), (part, total, p), dict(PP=pp, num_warps=4), (pp, 4))
    return total


def join_totals(part: torch.Tensor, b: int, hq: int) -> torch.Tensor:
    """The normalizer [B, Hq] fp32 from partial sums part [B * Hq, P, 2] fp32 (each a (max, sum
    of exp(x - max)) over some of a row's logits, natural log; page_scores.page_lse's slices);
    -inf for a row whose every part is empty."""
    if part.dim() != 3 or part.shape[0] != b * hq or part.shape[2] != 2 or not part.is_contiguous() \
            or part.dtype != torch.float32:
        raise KernelArgError(f"part must be a contiguous [{b * hq}, P, 2] fp32 buffer")
    rows, p = part.shape[0], part.shape[1]
    total = torch.empty(b, hq, device=part.device, dtype=torch.float32)
    if rows:
        pp = max(2, triton.next_power_of_2(p))
        warps = 4 if pp <= 1024 else 8
        launch(_total_join_kernel, (rows,), (part, total, p), dict(PP=pp, num_warps=warps), (pp, warps))
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
