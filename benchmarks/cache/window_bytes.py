"""KV bytes per token of SmolLM2-135M and Gemma 3 270M, sliding-window layers kept whole or to their window.

    PYTHONPATH=. python3 benchmarks/cache/window_bytes.py [--tokens 8192,32768] [--json out.json]

Counted, not measured: from each model's attention shape (its transformers config: layers, KV
heads, head_dim, which layers slide and by how much) and the bytes of one page of a CacheManager
of that shape in each codec (16 tokens of every layer the page holds, scales included). One
sequence of N tokens holds ceil(N / 16) pages of its global layers; a sliding-window layer held
whole (every layer global, as kvguard did before it knew windows) holds as many, one held to its
window holds at most window + 15 tokens after a step, ceil((window + 15) / 16) pages. Every page
is counted in the codec (the 16-bit tail page of a quantized cache is left out).
"""

from __future__ import annotations

import argparse
import json
import math

from kvguard.cache import CacheConfig, CacheManager

PAGE = 16
# (layers, KV heads, head_dim, query heads, {window: layers}); read from the models' configs
# (tests/hf/test_gemma3.py checks Gemma 3's windows against its loaded config)
MODELS = {
    "smollm2-135m": (30, 3, 64, 9, {}),
    "gemma3-270m": (18, 1, 256, 4, {512: 15}),
}


def page_bytes(layers: int, heads: int, dim: int, qheads: int, codec: str) -> int:
    m = CacheManager(CacheConfig(num_layers=layers, num_kv_heads=heads, head_dim=dim, num_query_heads=qheads,
                                 codec=codec, num_pages=1, num_hot_pages=1, page_size=PAGE))
    return m.store.pools[m.store.codec_pool].page_bytes


def count(model: str, tokens: int, codec: str) -> dict:
    layers, heads, dim, qheads, windows = MODELS[model]
    per_layer = page_bytes(1, heads, dim, qheads, codec)  # one layer's share of a page
    pages = math.ceil(tokens / PAGE)
    whole = pages * layers * per_layer
    windowed = sum(min(pages, math.ceil((w + PAGE - 1) / PAGE)) * n * per_layer for w, n in windows.items())
    windowed += pages * (layers - sum(windows.values())) * per_layer
    return {"model": model, "tokens": tokens, "codec": codec, "bytes_per_token_whole": whole / tokens,
            "bytes_per_token_windowed": windowed / tokens, "saving": 1 - windowed / whole}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--codecs", default="fp16,int8")
    p.add_argument("--json")
    args = p.parse_args()
    rows = [count(m, int(n), c) for m in MODELS for n in args.tokens.split(",") for c in args.codecs.split(",")]
    print("| model | tokens | codec | bytes/token, every layer whole | bytes/token, windows kept | saved |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['codec']} | {r['bytes_per_token_whole']:,.0f} | "
              f"{r['bytes_per_token_windowed']:,.0f} | {r['saving']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
