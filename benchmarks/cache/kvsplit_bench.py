"""The K/V split at a fixed device budget for KV: the longest context it holds, and its decode step.

For a model shape and a device budget (`--budget-gb`, default 16), three caches are sized to it:
16-bit pages, INT8 pages, and INT8 with the K/V split (keys of cold pages on the device, their
values in pinned host memory, the window's pages whole). Each is filled, through the cache's own
write path, with the longest context its pools hold for each of `--batch` sequences (within 3
pages a sequence), and then decodes steps
(CacheManager.append_step / attend_step, every layer) with random K/V and queries. Printed per
configuration: tokens held, device bytes of its pools (measured: torch.cuda.memory_allocated
around the cache), host bytes, ms per step (median), value bytes read from the host per step
(from the `fetch` events), and the step time against INT8 at INT8's longest context. The split
is timed at its own longest context and at INT8's, for each rule of `--fractions`: a top fraction
of the cold pages read per layer (0.01), or a coverage rule (c0.99: the fewest pages holding 99 %
of every query head's attention, the shipped policies' rule). Random keys spread attention evenly,
so a fraction is set, not found, and coverage reads nearly every page. `--hot SHARE` makes that
share of the pages heavy hitters for every query head (their keys and every query share a
direction, worth HOT_LOGIT nats of logit), so that a coverage rule reads about that share. Which
share a real model reads is docs/fidelity.md's question.

Before timing, the check (default on; benchmarks/cache/kvsplit_check.py) compares on the device the
split's kernel path with every page read against the same cache without the split, with a
fraction against the split's reference path (dense fp32, values copied in), replayed steps
against eager ones, and slots against none; `--check-only` runs it alone (on the CPU too, under
TRITON_INTERPRET=1, on `--smoke`'s shape).

    python benchmarks/cache/kvsplit_bench.py                # llama-8b, 16 GB, on CUDA
    python benchmarks/cache/kvsplit_bench.py --batch 8 --no-check
    python benchmarks/cache/kvsplit_bench.py --profile      # where the split's step spends its time
    python benchmarks/cache/kvsplit_bench.py --prefill 32768,131072 --chunk 512   # a prompt chunk after the split
    python benchmarks/cache/kvsplit_bench.py --no-check --fractions 0.01 --split-keys int8 --slots 2,4
                                                            # and with the pages read last kept on the device
    python benchmarks/cache/kvsplit_bench.py --fractions 0.01 --split-keys int8,int4h --slots 2,4
                                                            # INT4 keys pick, INT8 keys in host memory attend
    python benchmarks/cache/kvsplit_bench.py --no-check --fractions 0.01,c0.99 --hot 0.01 --split-keys int8
                                                            # the coverage rule where 1 % of the pages matter
    python benchmarks/cache/kvsplit_bench.py --smoke        # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

from benchmarks._lib.report import md_head, md_row  # noqa: E402
from benchmarks._lib.timing import sync  # noqa: E402
from benchmarks.cache.kvsplit_check import TIMED_PAGES, check  # noqa: E402
from kvguard.cache import CacheConfig, CacheManager  # noqa: E402
from kvguard.cache import events as ev  # noqa: E402
from kvguard.cache.config import KVSplit  # noqa: E402
from kvguard.types import Subject  # noqa: E402

# layers, KV heads, head dim, query heads ("tiny": --smoke --check-only, interpreted on the CPU)
SHAPES = {"smollm2-135m": (30, 3, 64, 9), "llama-8b": (32, 8, 128, 32), "tiny": (2, 2, 32, 4)}
S = 16
HOT_LOGIT = 12.0  # --hot: the logit a heavy-hitter page's keys gain with every query (nats)


def page_bytes(args, codec: str, keys_only: bool = False) -> int:
    """Device bytes of one page (every layer) of a codec; keys_only: the split pool's (int4: its
    keys only, the split's kv_split.keys)."""
    layers, h, d, _ = SHAPES[args.shape]
    if codec == "fp16":
        per = {"k": h * S * d * 2, "v": h * S * d * 2}
    elif codec == "int4":  # keys only: two codes a byte, per-channel scales and zeros
        per = {"k": h * S * d // 2, "k_scale": h * d * 2, "k_zero": h * d * 2}
    else:  # int8: codes, per-channel key scales, per-token value scales
        per = {"k": h * S * d, "k_scale": h * d * 2, "v": h * S * d, "v_scale": h * S * 2}
    return layers * sum(b for f, b in per.items() if not (keys_only and f.startswith("v")))


def key_options(keys: str) -> dict:
    """The kv_split options of a --split-keys name: int8, fp8, int4, or int4h (INT4 keys on the
    device pick the pages, INT8 keys in host memory attend: kv_split.host_keys)."""
    return {"keys": keys[:-1], "host_keys": True} if keys.endswith("h") else {"keys": keys}


def sizes(args, kind: str, keys: str = "int8") -> dict:
    """Pools of one configuration within the budget: (main pages, hot pages, split pages)."""
    budget = int(args.budget_gb * 2**30)
    b = args.batch
    # a prompt chunk in 16-bit, and each row's sink page and 16-bit window with the steps after it
    hot = -(-(args.chunk + 2 * S) // S) + b * (128 // S + 4) + 8
    hot_bytes = hot * page_bytes(args, "fp16")
    if kind == "fp16":
        return dict(codec="fp16", num_hot_pages=(budget // page_bytes(args, "fp16")), num_pages=1, split=None)
    if kind == "int8":
        return dict(codec="int8", num_hot_pages=hot, num_pages=(budget - hot_bytes) // page_bytes(args, "int8"),
                    split=None)
    # each row's window, and a chunk quantized before it moves
    main = -(-(2 * args.chunk) // S) + b * (args.window // S + 2) + 8
    left = budget - hot_bytes - main * page_bytes(args, "int8")
    return dict(codec="int8", num_hot_pages=hot, num_pages=main, split=left // page_bytes(args, key_options(keys)["keys"], True))


def rule_of(x: str) -> dict:
    """A --fractions entry as the split's rule: 0.01 (that fraction of the cold pages, the top by
    mass) or c0.99 (kv_split.coverage)."""
    return {"coverage": float(x[1:])} if x.startswith("c") else {"fraction": float(x)}


def named(x: str) -> str:
    return f"c={x[1:]}" if x.startswith("c") else f"f={x}"


def make(args, kind: str, rule: str, keys: str = "int8",
         kernels: bool | None = None) -> tuple[CacheManager, int, int]:
    """The cache, its device bytes (measured) and the tokens each of `--batch` sequences can hold
    in it (within 3 pages a sequence of the most); `keys`: the split's key codec; `kernels`: the
    kernel path (default on CUDA only)."""
    layers, h, d, hq = SHAPES[args.shape]
    dev = torch.device(args.device)
    z = sizes(args, kind, keys)
    split = None if z["split"] is None else {"window": args.window, **rule_of(rule), "capacity": z["split"],
                                              **key_options(keys)}
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    m = CacheManager(CacheConfig(num_layers=layers, num_kv_heads=h, head_dim=d, num_query_heads=hq, page_size=S,
                                 num_pages=z["num_pages"], num_hot_pages=z["num_hot_pages"],
                                 dtype=torch.float16 if dev.type == "cuda" or kernels else torch.float32, device=dev,
                                 codec=z["codec"], fp_sink=16, fp_window=128, kv_split=split,
                                 use_kernels=dev.type == "cuda" if kernels is None else kernels))
    used = (torch.cuda.memory_allocated(dev) - before) if dev.type == "cuda" else sum(
        t.numel() * t.element_size() for p in m.pools.values() for t in p._stacks.values() if t.device == dev)
    b = args.batch
    if kind == "fp16":
        tokens = (z["num_hot_pages"] // b - 3) * S
    elif kind == "int8":
        tokens = (z["num_pages"] // b - 3) * S + 128 + 16  # the sink page and the window stay 16-bit
    else:
        tokens = (z["split"] // b - 3) * S + args.window
    return m, used, tokens - 2 * (args.steps + args.warmup) - 2  # room for the eager steps and the graph's


def hot_direction(args, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[d]: what --hot adds to a heavy hitter's keys and to every query (their product, at the
    softmax's scale 1/sqrt(d), is HOT_LOGIT; zero without --hot)."""
    d = SHAPES[args.shape][2]
    return torch.full((d,), (HOT_LOGIT * d**0.5) ** 0.5 / d**0.5 if args.hot else 0.0, device=dev, dtype=dtype)


def fill(m: CacheManager, tokens: int, args) -> list:
    """`--batch` sequences of `tokens` tokens each, written through the cache's write path (with
    --hot, that share of each row's pages, drawn at random, heavy hitters)."""
    layers, h, d, _ = SHAPES[args.shape]
    dev, dtype = m.cfg.device, m.cfg.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    u = hot_direction(args, dev, dtype)
    t0 = time.perf_counter()
    seqs = []
    for i in range(args.batch):
        seq = m.open(Subject("bench", f"u{i}", f"s{i}"))
        for lo in range(0, tokens, args.chunk):
            n = min(args.chunk, tokens - lo)
            bump = 0.0  # (drawn only with --hot: without it the keys are those of the runs before it)
            if args.hot:
                hot = (torch.rand(-(-n // S), generator=g, device=dev) < args.hot).repeat_interleave(S)[:n]
                bump = hot[:, None, None] * u
            for layer in range(layers):
                k = torch.randn(n, h, d, generator=g, device=dev, dtype=dtype) + bump
                if not m.append(seq, layer, k, torch.randn(n, h, d, generator=g, device=dev, dtype=dtype)):
                    raise SystemExit(f"the cache ran out of pages at row {i}, {lo} tokens (of {tokens})")
            if m.split is not None:
                m.split_cold(seq)
        seqs.append(seq)
        sync(dev)
        print(f"    filled row {i + 1} of {args.batch}: {tokens:,} tokens ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    m.events.take_events()
    return seqs


def decode(m: CacheManager, seqs: list, args) -> tuple[float, float]:
    """ms per step (median) and value bytes read from the host per step (mean)."""
    layers, h, d, hq = SHAPES[args.shape]
    dev, dtype = m.cfg.device, m.cfg.dtype
    g = torch.Generator(device=dev).manual_seed(1)
    times, fetched, hosts = [], [], []
    u = hot_direction(args, dev, dtype)
    for step in range(args.warmup + args.steps):
        k = torch.randn(layers, len(seqs), h, d, generator=g, device=dev, dtype=dtype)
        q = torch.randn(layers, len(seqs), hq, d, generator=g, device=dev, dtype=dtype) + u
        sync(dev)
        t0 = time.perf_counter()
        for layer in range(layers):
            m.append_step(seqs, layer, k[layer], k[layer])
            m.attend_step(seqs, layer, q[layer])
        launched = time.perf_counter()
        sync(dev)
        got = reported(m)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            hosts.append(launched - t0)
            fetched.append(got)
    decode.host_ms = 1000 * statistics.median(hosts)  # the host's share: launching the step's work
    return 1000 * statistics.median(times), statistics.mean(fetched)


def decode_graph(m: CacheManager, seqs: list, args) -> tuple[float, float]:
    """As `decode`, through a StaticStep whose layers are captured in one CUDA graph and replayed
    (what the serving engine does on CUDA): the host's work per step is the step's bookkeeping
    (begin/end) and one launch. ms per step (median) and value bytes read from the host per step."""
    from kvguard.cache.step import StaticStep

    layers, h, d, hq = SHAPES[args.shape]
    dev, dtype = m.cfg.device, m.cfg.dtype
    step = StaticStep(m, seqs, max(m.length(s) for s in seqs) + args.warmup + args.steps + 2)
    g = torch.Generator(device=dev).manual_seed(1)
    k = torch.randn(layers, len(seqs), h, d, generator=g, device=dev, dtype=dtype)
    q = torch.randn(layers, len(seqs), hq, d, generator=g, device=dev, dtype=dtype) + hot_direction(args, dev, dtype)

    def body():
        for layer in range(layers):
            step.write(layer, k[layer], k[layer])
            step.attend(layer, q[layer])

    side = torch.cuda.Stream(device=dev)  # the first step eagerly, off the default stream (as DecodeGraph)
    side.wait_stream(torch.cuda.current_stream(dev))
    with step, torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with step:
        with torch.cuda.graph(graph):
            body()
        graph.replay()
    sync(dev)
    m.events.take_events()
    times, fetched, phases = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(args.warmup + args.steps):
        # as the serving engine orders a step: the host's bookkeeping after the replay is queued
        # (end(), which turns earlier steps' reads into events) runs while the device works
        t0 = time.perf_counter()
        step.begin()
        t1 = time.perf_counter()
        start.record()
        graph.replay()
        end.record()
        step.replayed()
        t2 = time.perf_counter()
        step.end()
        t3 = time.perf_counter()
        end.synchronize()
        t4 = time.perf_counter()
        # this step's fetch events come at a later step's end(): the mean over steps is the same
        got = reported(m, wait=False)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            fetched.append(got)
            phases.append((t1 - t0, start.elapsed_time(end) / 1000, t3 - t2, t4 - t3))
    reported(m)
    del graph
    # the step's parts: the host's bookkeeping before (begin) and after the replay is queued (end,
    # the earlier steps' fetch events included), the device's replay, and the wait for it
    decode_graph.phases = [1000 * statistics.median(p) for p in zip(*phases)]
    return 1000 * statistics.median(times), statistics.mean(fetched)


SLOT_MARGIN = 8  # pages: a row's split pages may grow by this much while its steps are timed


def with_slots(m: CacheManager, seqs: list, rule: str, keys: str, mult: int, run) -> None:
    """Run `run(hot, label)` with the split's rule (a fraction) and device slots for `mult` x the
    pages a step's rows pick (kv_split.slots, kvguard/cache/hot.py), then take the slots away."""
    from kvguard.cache.hot import HotValues

    if not m.cfg.use_kernels or "fraction" not in rule_of(rule):
        print(f"    (slots need the kernel path and a capped rule: not timed with {named(rule)} on {m.cfg.device})")
        return
    fraction = rule_of(rule)["fraction"]
    # a row's split pages, and a few more: the timed steps move pages in, and a step whose picks
    # (a fraction of the pages, rounded up) outgrow half the ring reads in place, without its slots
    held = max(sum(r.where == "split" for r in m.seqs.get(s).pages) for s in seqs) + SLOT_MARGIN
    slots = mult * max(1, KVSplit(window=0, fraction=fraction).pages(held)) * len(seqs)
    m.split.rule = KVSplit(window=m.split.rule.window, fraction=fraction, slots=slots, **key_options(keys))
    hot = m.split.hot = HotValues(m.split.pool, slots, m.cfg.device, m.split.view)
    try:
        run(hot, f"slots {mult}xk")
    finally:
        m.split.pool.on_wipe.remove(hot.forget)
        m.split.hot = None


def reported(m: CacheManager, wait: bool = True) -> int:
    """Bytes the split's `fetch` events emitted so far report reading from the host (values, and
    with host keys the keys); with `wait`, the split's reads of every step emitted first (waits
    for the device)."""
    if wait and m.split is not None:
        m.split.drain()
    return sum(e.bytes for e in m.events.take_events() if isinstance(e, ev.PagesFetched) and "v" in (e.fields or ()))


def profile(args, rule: str) -> None:
    """The device time of each kernel of the split's decode step, at INT8's longest context (the
    last of --split-keys)."""
    _, _, int8_tokens = make(args, "int8", "1.0")
    m, _, _ = make(args, "split", rule, args.split_keys.split(",")[-1])
    seqs = fill(m, int8_tokens, args)
    decode(m, seqs, args)
    import cProfile
    import pstats

    args.warmup, args.steps = 0, 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ms, _ = decode(m, seqs, args)
    print(f"split {named(rule)} at {int8_tokens:,} tokens: {ms:.2f} ms/step")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    host = cProfile.Profile()
    host.enable()
    ms, _ = decode(m, seqs, args)
    host.disable()
    print(f"under cProfile: {ms:.2f} ms/step")
    pstats.Stats(host).sort_stats("tottime").print_stats(25)


def prefill(args, contexts: list[int], rules: list[str]) -> None:
    """One prompt chunk (`--chunk` queries) of a sequence whose older values the split holds, on
    the kernel path (each query picks its pages; the picked ones gathered once into device
    memory) and on the reference path (dense fp32), against the same chunk over INT8 pages
    without the split (the prefill kernel). `--layers` of the shape; ms a layer, best of two."""
    layers, h, d, hq = SHAPES[args.shape]
    layers = min(layers, args.layers)
    dev = torch.device(args.device)
    t = args.chunk
    print(f"\n{args.shape} ({layers} layers timed), a {t}-query chunk, ms per layer; device {args.device}")
    print(md_head("context", "configuration", "kernel path ms", "reference path ms", "x INT8", "MiB from host a layer"))
    for n in contexts:
        for name, split in [("int8, no split", None)] + [
                (f"split {named(r)}", {"window": args.window, **rule_of(r)}) for r in rules] + [
                ("split mass 0.001", {"window": args.window, "mass": 1e-3})]:
            times = {}
            paths = (True, False) if split and args.reference else (True,)
            for kernels in (paths if dev.type == "cuda" else (False,)):  # the kernels need CUDA (or the interpreter)
                pages = -(-(n + 2 * t) // S) + 8
                m = CacheManager(CacheConfig(num_layers=layers, num_kv_heads=h, head_dim=d, num_query_heads=hq,
                                             page_size=S, num_pages=pages, num_hot_pages=-(-(4096 + 4 * t) // S) + 32,
                                             dtype=torch.float16, device=dev, codec="int8", fp_sink=16,
                                             fp_window=128, kv_split=split, use_kernels=kernels))
                g = torch.Generator(device=dev).manual_seed(5)
                seq = m.open(Subject("bench", "u", "s"))
                for lo in range(0, n, 4096):
                    for layer in range(layers):
                        k = torch.randn(min(4096, n - lo), h, d, generator=g, device=dev, dtype=torch.float16)
                        assert m.append(seq, layer, k, torch.randn_like(k))
                    if split:
                        m.split_cold(seq)
                for layer in range(layers):  # the chunk: the split moved the older pages when it came
                    k = torch.randn(t, h, d, generator=g, device=dev, dtype=torch.float16)
                    assert m.append(seq, layer, k, torch.randn_like(k))
                q = torch.randn(layers, t, hq, d, generator=g, device=dev, dtype=torch.float16)
                m.events.take_events()
                reps = []
                for _ in range(2 if kernels or dev.type != "cuda" else 1):
                    sync(dev)
                    t0 = time.perf_counter()
                    for layer in range(layers):
                        m.attend(seq, layer, q[layer])
                    sync(dev)
                    reps.append((time.perf_counter() - t0) * 1e3 / layers)
                times[kernels] = min(reps)
                if kernels or dev.type != "cuda":  # the bytes of the path timed in the table's ratio
                    fetched = reported(m) / (len(reps) * layers)
                if kernels and split and args.profile and dev.type == "cuda":
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        m.attend(seq, 0, q[0])
                        sync(dev)
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))
                del m, seq
                gc.collect()
            ms = times.get(True, times.get(False))
            base = ms if split is None else base
            kernel_ms, ref_ms = (f"{times[p]:.2f}" if p in times else "-" for p in (True, False))
            print(f"| {n:,} | {name} | {kernel_ms} | {ref_ms} | {ms / base:.2f} | {fetched / 2**20:.1f} |", flush=True)


def sweep(args, contexts: list[int], rules: list[str]) -> None:
    """The step of INT8 and of the split (each of --split-keys) at each context, in the same caches
    (sized to the budget)."""
    times: dict[tuple, tuple[float, float, float]] = {}
    graphs = args.device.startswith("cuda")
    keys = args.split_keys.split(",")
    for kind, kc in [("int8", "int8")] + [("split", k) for k in keys]:
        m, _, most = make(args, kind, rules[0], kc)
        for at in contexts:
            if at > most:
                raise SystemExit(f"{at} tokens do not fit the {kind} cache's {most}")
            seqs = fill(m, at, args)
            for f in rules if kind == "split" else [None]:
                if f is not None:
                    m.split.rule = KVSplit(window=args.window, **rule_of(f), **key_options(kc))
                ms, fetched = decode(m, seqs, args)
                gms = decode_graph(m, seqs, args)[0] if graphs else float("nan")
                times[(kind, kc, f, at)] = ms, fetched, gms
                print(f"  {kind} keys {kc} {f and named(f)} at {at:,}: {ms:.2f} ms/step, graph {gms:.2f}", flush=True)
            for seq in seqs:
                m.free(seq)
            m.events.take_events()
        del m
    print(f"\n{args.shape}, B={args.batch}, ms/step eager / replayed from a CUDA graph (x INT8's) and MiB of "
          "values from the host a step")
    cols = [(k, f) for k in keys for f in rules]
    print(md_head("context", "int8", *(f"int8+split{'' if k == 'int8' else ' k-' + k} {named(f)}" for k, f in cols)))
    for at in contexts:
        base, _, gbase = times[("int8", "int8", None, at)]
        cells = []
        for k, f in cols:
            ms, fetched, gms = times[("split", k, f, at)]
            cells.append(f"{ms:.2f} (x{ms / base:.2f}) / {gms:.2f} (x{gms / gbase:.2f}), {fetched / 2**20:.0f} MiB")
        print(md_row(f"{at:,}", f"{base:.2f} / {gbase:.2f}", *cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--budget-gb", type=float, default=16.0, help="device bytes for the KV pools (GiB)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together, each as long as fits")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--fractions", default="0.01,0.05,0.25", metavar="RULES",
                   help="the split's rules: a fraction of the cold pages (0.01), or cN for kv_split.coverage N "
                        "(c0.99)")
    p.add_argument("--hot", type=float, default=0.0, metavar="SHARE",
                   help="this share of the pages heavy hitters for every query head (default: none, random keys "
                        "spread attention evenly); a coverage rule then reads about that share")
    p.add_argument("--split-keys", default="int8,int4,int4h",
                   help="the split's key codecs to run (kv_split.keys; int4h: INT4 on the device to pick, INT8 in "
                        "host memory to attend, kv_split.host_keys)")
    p.add_argument("--chunk", type=int, default=2048, help="prompt tokens written at a time")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--check-only", action="store_true",
                   help="only the check (benchmarks/cache/kvsplit_check.py); on the CPU under TRITON_INTERPRET=1 too")
    p.add_argument("--profile", action="store_true", help="only profile the split's step at INT8's context "
                   "(with --prefill: the kernels of one chunk's layer too)")
    p.add_argument("--contexts", default="", help="instead: INT8 and the split at these contexts (comma-separated "
                   "tokens a row, each within INT8's longest), step time and bytes from the host")
    p.add_argument("--tune", type=int, default=0, metavar="TOKENS",
                   help="instead: the split's per-layer device work at this context, the key pass in each "
                   "configuration against the copy ceiling (CUDA)")
    p.add_argument("--prefill", default="", metavar="CONTEXTS",
                   help="instead: one --chunk of queries at these contexts (comma-separated), the split's kernel "
                   "and reference paths against INT8 without the split")
    p.add_argument("--layers", type=int, default=4, help="layers of the shape --prefill times")
    p.add_argument("--no-reference", dest="reference", action="store_false", help="--prefill: no reference path")
    p.add_argument("--many-from", type=int, default=None, metavar="PAGES",
                   help="rows of at least this many pages are normalized and picked by many programs a row "
                        "(kernels/page_pick.py PICK_CONFIG['many_from'])")
    p.add_argument("--slots", default="", metavar="M,...",
                   help="also the split at INT8's context with device slots for M x the pages a step picks "
                        "(kv_split.slots): eager steps draw new queries (picks repeat by chance), the graph "
                        "replays one (they repeat): the two ends of what the slots save")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args()
    if args.many_from is not None:
        from kvguard.kernels.page_pick import PICK_CONFIG

        PICK_CONFIG["many_from"] = args.many_from
    if args.smoke:
        args.shape, args.device, args.budget_gb, args.steps, args.warmup = "smollm2-135m", "cpu", 0.035, 1, 0
        args.chunk, args.window, args.check, args.batch = 256, 64, args.check_only, 2
        if args.check_only:
            args.shape = "tiny"
    if args.check_only and not args.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--check-only on the CPU runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
    if args.check and (args.device.startswith("cuda") or args.check_only):
        cuda = args.device.startswith("cuda")  # on the CPU (interpreted): a short context, --smoke's window
        # interpreted on the CPU: shorter rows, and picks of rows long enough to take the many-program path
        ok, slots_ok = check(SHAPES[args.shape], args.device, 4096 + 300 if cuda else 320, 512 if cuda else 64,
                             64 if cuda else 16, TIMED_PAGES if cuda else (4_513, 7_019))
        if not ok:
            raise SystemExit(1)
        if not slots_ok and args.slots:
            print("check: with slots vs without FAILED: the --slots rows are not timed")
            args.slots = ""
        if args.check_only:
            return
    if not 0 <= args.hot < 1:
        raise SystemExit(f"--hot must be in [0, 1), got {args.hot}")
    fractions = args.fractions.split(",")
    for f in fractions:
        try:
            KVSplit(window=args.window, **rule_of(f))
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--fractions: {f!r} is not a rule ({e})") from None
    rows = []
    if args.prefill:
        prefill(args, [int(c) for c in args.prefill.split(",")], fractions)
        return
    if args.profile:
        profile(args, fractions[0])
        return
    if args.tune:
        from benchmarks.cache.kvsplit_tune import tune

        tune(args, args.tune, SHAPES[args.shape], S)
        return
    if args.contexts:
        sweep(args, [int(c) for c in args.contexts.split(",")], fractions)
        return

    graphs = args.device.startswith("cuda")

    def row(name, m, seqs, used, at):
        """One configuration's eager step, then its step replayed from a CUDA graph."""
        ms, fetched = decode(m, seqs, args)
        host_ms = decode.host_ms
        gms = decode_graph(m, seqs, args)[0] if graphs else float("nan")
        if graphs:
            print("    graph step's parts, ms: begin {:.2f}, device {:.2f}, end {:.2f}, waiting {:.2f}".format(
                *decode_graph.phases))
        host = sum(t.numel() * t.element_size() for pl in m.pools.values() for t in pl._stacks.values()
                   if t.device.type == "cpu" and m.cfg.device.type != "cpu")
        rows.append((name, at, used, host, ms, host_ms, gms, fetched))
        print(f"  {name}: {at:,} tokens a row, {ms:.2f} ms/step ({host_ms:.2f} ms of it launching), "
              f"graph {gms:.2f} ms/step, {fetched / 2**20:.1f} MiB/step from the host", flush=True)
        return ms, gms

    for kind in ("fp16", "int8"):
        m, used, tokens = make(args, kind, "1.0")
        print(f"{kind}: {used / 2**30:.2f} GiB of pools, {tokens:,} tokens a row", flush=True)
        seqs = fill(m, tokens, args)
        ms, gms = row(kind, m, seqs, used, tokens)
        if kind == "int8":
            int8_tokens, int8_ms, int8_gms = tokens, ms, gms
        del m, seqs
    for keys in args.split_keys.split(","):
        m, used, tokens = make(args, "split", fractions[0], keys)
        name = "int8+split" + ("" if keys == "int8" else f" k-{keys}")
        print(f"{name}: {used / 2**30:.2f} GiB of pools, {tokens:,} tokens a row", flush=True)
        for at in (tokens, int8_tokens):
            seqs = fill(m, at, args)
            for f in fractions:
                m.split.rule = KVSplit(window=args.window, **rule_of(f), **key_options(keys))
                row(f"{name} {named(f)}", m, seqs, used, at)
            for mult in (int(x) for x in args.slots.split(",") if x) if at == int8_tokens else ():
                for f in fractions:
                    with_slots(m, seqs, f, keys, mult, lambda hot, label: row(f"{name} {named(f)} {label}", m, seqs,
                                                                        used + hot.nbytes, at))
            for seq in seqs:
                m.free(seq)
            m.events.take_events()
        del m
    print(f"\n{args.shape}, B={args.batch}, device budget {args.budget_gb:g} GiB for KV pools, device {args.device}"
          f" ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'})")
    print(md_head("configuration", "context a row (tokens)", "vs INT8's", "device pools GiB", "host GiB", "eager ms/step",
                  "of it launching", "x INT8 eager", "graph ms/step", "x INT8 graph", "MiB from host/step"))
    for name, at, used, host, ms, launch_ms, gms, fetched in rows:
        print(f"| {name} | {at:,} | {at / int8_tokens:.2f}x | {used / 2**30:.2f} | {host / 2**30:.2f} | {ms:.2f} "
              f"| {launch_ms:.2f} | {ms / int8_ms:.2f} | {gms:.2f} | {gms / int8_gms:.2f} | {fetched / 2**20:.1f} |")

if __name__ == "__main__":
    main()
