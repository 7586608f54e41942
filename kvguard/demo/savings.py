"""Part 1 of the demo: what each scenario policy holds, from the cache's own accounting.

The bytes per token come from a CacheManager built from the policy for SmolLM2-135M's shape;
how many tokens a sequence keeps follows from the policy (every token, or the evictor's
budget once a sequence passes it), with the 16-bit sink page and recent window counted at
16-bit. No model runs here: memory does not depend on what the tokens are.
"""

from __future__ import annotations

import math

from ..cache import CacheManager
from ..policy import ModelShape, Policy

SMOLLM2 = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, num_query_heads=9)
CONTEXTS = (1024, 8192, 32768)


def held(policy: Policy, n: int) -> tuple[int, int, int]:
    """(tokens kept, KV bytes, pages) of one sequence of n tokens under `policy`."""
    stats = CacheManager(policy.cache_config(SMOLLM2, num_pages=1, num_hot_pages=1)).stats()
    page = policy.page_size
    main = stats.bytes_per_token["main"]
    hot_bpt = stats.bytes_per_token.get("hot", main)
    kept = min(n, policy.evictor.budget) if policy.evictor else n
    hot = (page if policy.codec.fp_sink else 0) + math.ceil(policy.codec.fp_window / page) * page
    hot = min(hot, kept)
    return kept, int(hot * hot_bpt + (kept - hot) * main), math.ceil(kept / page)


def print_table(table: list[list[str]]) -> None:
    """Columns padded to their widest cell, a rule under the first row."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def full_bytes_per_token(shape: ModelShape = SMOLLM2) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2  # K and V, 2 bytes each


def on_device(m: CacheManager, policy: Policy) -> float:
    """Device bytes per token of the pages older than the recent window: with the K/V split,
    the split pool's keys only (its values, and with host_keys its exact keys, in host memory)."""
    split = m.pools.get("split")
    if split is None:
        return m.stats().bytes_per_token["main"]
    return (split.page_bytes - split.value_bytes()) / policy.page_size


def rows(policies: dict[str, Policy]) -> list[list[str]]:
    full = full_bytes_per_token()
    out = []
    for name, p in policies.items():
        m = CacheManager(p.cache_config(SMOLLM2, num_pages=1, num_hot_pages=1))
        stats = m.stats()
        codec = f"{stats.bytes_per_token['main']:,.0f} B ({stats.bytes_per_token['main'] / full:.0%})"
        device = on_device(m, p)
        gpu = f"{device:,.0f} B ({device / full:.0%})"
        keeps = f"{p.evictor.budget:,} ({p.evictor.name})" if p.evictor else "all"
        row = [name, p.steps()[0].key.split("+")[0], codec, gpu, keeps]
        for n in CONTEXTS:
            _, nbytes, pages = held(p, n)
            row.append(f"{pages:>5,} p {1 - nbytes / (n * full):>4.0%}")
        out.append(row)
    return out


def show_savings(policies: dict[str, Policy]) -> None:
    full = full_bytes_per_token()
    print(f"== 1. What each scenario policy saves (SmolLM2-135M: {SMOLLM2.num_layers} layers x "
          f"{SMOLLM2.num_kv_heads} KV heads x {SMOLLM2.head_dim} dims; a 16-bit cache holds {full:,} B per token)\n")
    head = ["policy", "codec", "KV bytes/token", "GPU bytes/token", "tokens kept"] + [f"at {n // 1024}k tokens: pages saved"
                                                                  for n in CONTEXTS]
    table = [head] + rows(policies)
    print_table(table)
    print(f"""
  KV bytes/token: a quantized page's bytes per token, scales included, against 16-bit {full:,} B;
    the sink page and the recent window (16-bit, for fidelity) cost full price, so short
    sequences save less than the codec alone would.
  GPU bytes/token: of a token older than the recent window. With the K/V split (kv_split) its
    value lives in host memory and the GPU holds its key only (INT4 with host_keys, which keeps
    an INT8 copy of the key in host memory too), so the same GPU memory holds a longer context.
  tokens kept: an evictor drops tokens only once a sequence passes its budget; below it, it
    saves nothing and costs nothing. saved: KV memory of one sequence against 16-bit.
  pages: {policies[next(iter(policies))].page_size}-token pages of one sequence (every layer's K and V; 16-bit: n / 16);
    freed pages go back to the pool for other sequences.""")
