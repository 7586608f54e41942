"""The K/V split's decode step against the same cache without it, on CUDA (or a CPU smoke run).

A batch of B sequences holds `--context` tokens of random K/V in every layer; each decode step
writes one token per row and attends every layer (CacheManager.append_step / attend_step).
Without the split the step is the cache's own path (the Triton decode kernels on CUDA). With
it, values older than `--window` tokens live in (pinned) CPU memory and each layer fetches the
values of the top `--fraction` of the cold pages, the next layer's fetched ahead on a side
stream. Prints ms per step (median) and the value bytes fetched per step (from the `fetch`
events), as a ratio against the run without the split in the same process.

    python benchmarks/kvsplit_bench.py --context 8192 --batch 8 --fraction 0.25
    python benchmarks/kvsplit_bench.py --smoke      # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache import events as ev
from kvguard.types import Subject

SHAPES = {"smollm2-135m": (30, 3, 64, 9), "llama-8b": (32, 8, 128, 32)}  # layers, KV heads, head dim, query heads


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(args, split: dict | None) -> tuple[float, float]:
    layers, h, d, hq = SHAPES[args.shape]
    dev = torch.device(args.device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    s = 16
    pages = args.batch * (-(-(args.context + args.steps + s) // s) + 2)
    m = CacheManager(CacheConfig(num_layers=layers, num_kv_heads=h, head_dim=d, num_query_heads=hq, page_size=s,
                                 num_pages=pages, dtype=dtype, device=dev, codec=args.codec, fp_sink=16,
                                 fp_window=128, kv_split=split))
    g = torch.Generator(device=dev).manual_seed(0)
    seqs = [m.open(Subject("bench", f"u{i}", f"s{i}")) for i in range(args.batch)]
    chunk = 1024
    for seq in seqs:
        for lo in range(0, args.context, chunk):
            n = min(chunk, args.context - lo)
            for layer in range(layers):
                k = torch.randn(n, h, d, generator=g, device=dev, dtype=dtype)
                assert m.append(seq, layer, k, torch.randn(n, h, d, generator=g, device=dev, dtype=dtype))
        if split:
            m.split_cold(seq)
    m.events.take_events()
    times, fetched = [], []
    for step in range(args.warmup + args.steps):
        k = torch.randn(layers, args.batch, h, d, generator=g, device=dev, dtype=dtype)
        q = torch.randn(layers, args.batch, hq, d, generator=g, device=dev, dtype=dtype)
        sync(dev)
        t0 = time.perf_counter()
        for layer in range(layers):
            m.append_step(seqs, layer, k[layer], k[layer])
            m.attend_step(seqs, layer, q[layer])
        sync(dev)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            fetched.append(sum(e.bytes for e in m.events.take_events()
                               if isinstance(e, ev.PagesFetched) and e.fields == ("v",)))
        else:
            m.events.take_events()
    for seq in seqs:
        m.free(seq)
    return 1000 * statistics.median(times), statistics.mean(fetched)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--codec", default="int8")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args()
    if args.smoke:
        args.device, args.context, args.batch, args.steps, args.warmup, args.window = "cpu", 256, 2, 2, 1, 64
    base, _ = bench(args, None)
    split, nbytes = bench(args, {"window": args.window, "fraction": args.fraction})
    print(f"{args.shape} {args.codec} B={args.batch} context={args.context} device={args.device}: "
          f"{base:.2f} ms/step without the split, {split:.2f} ms/step with it "
          f"(x{split / base:.2f}; fraction {args.fraction}, window {args.window}), "
          f"{nbytes / 2**20:.2f} MiB of values fetched per step")


if __name__ == "__main__":
    main()
