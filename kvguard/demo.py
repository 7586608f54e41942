"""`make demo`: a workload through the cache, then through the sidecar.

Part 1 (in process): the same synthetic decode workload — K/V with outlier key
channels, the shape of SmolLM2-135M's attention (3 KV heads, 9 query heads,
head_dim 64) over a few layers — runs through every codec and evictor, and the
table shows what each holds, what it saved against 16-bit, and how far its
attention output moved from the 16-bit cache's.

Part 2 (`kvguard.sidecar.demo`, when the sidecar is installed): starts `kvguard
serve` on SQLite, streams a workload's events through it, erases one user
through the admin API and verifies the signed receipt offline.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .cache import CacheConfig, CacheManager
from .types import Subject

CONFIGS = [
    ("fp16", {}),
    ("int8", {"codec": "int8", "fp_sink": 4}),
    ("fp8", {"codec": "fp8", "fp_sink": 4}),
    ("int4 KIVI", {"codec": "int4", "fp_sink": 4, "fp_window": 64}),
    ("streamingllm", {"evictor": "streamingllm", "evictor_options": {"budget": 192, "sink": 4}}),
    ("h2o", {"evictor": "h2o", "evictor_options": {"budget": 192, "sink": 4, "window": 64}}),
    ("snapkv", {"evictor": "snapkv", "evictor_options": {"budget": 192, "sink": 4, "window": 64}}),
    ("int8 + h2o", {"codec": "int8", "fp_sink": 4,
                    "evictor": "h2o", "evictor_options": {"budget": 192, "sink": 4, "window": 64}}),
]


def workload(layers: int, seqs: int, prompt: int, decode: int, seed: int = 0):
    """K, V [T, 3, 64] and q [T, 9, 64] per sequence and layer, with two outlier key channels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(seqs):
        n = prompt + decode
        per_layer = []
        for _ in range(layers):
            k = torch.randn(n, 3, 64, generator=g)
            k[:, :, [5, 40]] = k[:, :, [5, 40]] * 4 + 12  # large-magnitude channels, as in real keys
            v = torch.randn(n, 3, 64, generator=g)
            q = torch.randn(n, 9, 64, generator=g) + 0.5 * k.repeat_interleave(3, 1).mean(0, keepdim=True)
            per_layer.append((k.half(), v.half(), q.half()))
        out.append(per_layer)
    return out


def run(name: str, opts: dict, data, prompt: int, layers: int):
    cfg = CacheConfig(num_layers=layers, num_kv_heads=3, num_query_heads=9, head_dim=64, num_pages=4096, **opts)
    m = CacheManager(cfg)
    outs = []
    t0 = time.perf_counter()
    for i, seq_data in enumerate(data):
        seq = m.open(Subject("demo-tenant", f"user-{i % 2}", f"session-{i}"))
        n = seq_data[0][0].shape[0]
        steps = [(0, prompt)] + [(j, j + 1) for j in range(prompt, n)]
        for lo, hi in steps:
            for layer, (k, v, q) in enumerate(seq_data):
                m.append(seq, layer, k[lo:hi], v[lo:hi])
                o = m.attend(seq, layer, q[lo:hi])
                if hi > prompt:
                    outs.append(o.float())
    elapsed = time.perf_counter() - t0
    ops: dict[str, int] = {}
    for e in m.events.take_events():
        ops[e.op] = ops.get(e.op, 0) + 1
    return m.stats(), torch.cat(outs), elapsed, ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvguard demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--synthetic-only", action="store_true", help="skip the sidecar part")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    args = p.parse_args(argv)

    data = workload(args.layers, args.sequences, args.prompt, args.decode)
    print(f"Workload: {args.sequences} sequences x ({args.prompt} prompt + {args.decode} decoded tokens), "
          f"{args.layers} layers, 3 KV heads, head_dim 64, pages of 16 tokens\n")
    header = (f"{'method':<14}{'tokens held':>12}{'KV bytes':>12}{'vs 16-bit':>11}{'saved':>8}"
              f"{'pages':>8}{'waste':>7}{'attn dev':>10}{'time s':>8}  events")
    print(header)
    print("-" * len(header))
    ref = None
    for name, opts in CONFIGS:
        stats, outs, elapsed, ops = run(name, opts, data, args.prompt, args.layers)
        if ref is None:
            ref = outs
        dev = ((outs - ref).norm() / ref.norm()).item()
        full = stats.bytes_16bit_equivalent
        print(f"{name:<14}{stats.tokens_held:>12}{stats.bytes_held:>12,}{full:>11,}{stats.saving:>8.1%}"
              f"{sum(stats.pages_used.values()):>8}{stats.waste_slots:>7}{dev:>10.3%}{elapsed:>8.2f}  "
              + ", ".join(f"{k}={v}" for k, v in sorted(ops.items())))
    print("\nattn dev: relative deviation of the decode steps' attention output from the 16-bit cache's.")
    print("saved: KV bytes held against all tokens in 16-bit (evicted tokens count as saved).")
    if args.synthetic_only:
        return 0
    try:
        from .sidecar.demo import main as sidecar_demo
    except ImportError as e:
        print(f"\n(sidecar part unavailable: {e})", file=sys.stderr)
        return 0
    return sidecar_demo()


if __name__ == "__main__":
    sys.exit(main())
