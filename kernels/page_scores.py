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
