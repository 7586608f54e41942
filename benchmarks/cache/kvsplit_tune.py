"""The K/V split's per-layer device work at one context, each part apart
(`benchmarks/cache/kvsplit_bench.py --tune TOKENS`): the key pass (page_lse) in each configuration
against a device copy of the same bytes (the bandwidth ceiling), the normalizer, the page picks
in each tile (top-k of 1 %, the mass rule's threshold, the coverage rule), and one layer of
INT8's decode over the whole context, which the split's step is compared with. Each is timed as
a CUDA graph of 20 calls replayed (the device's time, as in a captured step; not the host's
launching of each call, which eager calls of small kernels would measure instead)."""

from __future__ import annotations

import itertools
import time

import torch


def tune(args, context: int, shape: tuple[int, int, int, int], S: int) -> None:
    """Prints the tables above for `context` tokens a row of `shape` (layers, KV heads, head
    dim, query heads), pages of S tokens."""
    from kvguard.kernels import quantize as ref
    from kvguard.kernels.page_pick import PICK_CONFIG, coverage_threshold, page_pick, page_total
    from kvguard.kernels.page_scores import BLOCK_CONFIG, DEFAULT_CONFIG, page_lse, page_lse_sets
    from kvguard.kernels.paged_decode import paged_decode_sets

    from kvguard.cache.picks import covering

    _, h, d, hq = shape
    dev, b = torch.device(args.device), args.batch
    n = context // S  # pages a row
    g = torch.Generator(device=dev).manual_seed(0)
    int4 = args.split_keys.split(",")[-1].removesuffix("h") == "int4"  # the split's keys in INT4 (values INT8)

    def encode(k, v):
        f = ref.encode_int8(k, v)
        return f if not int4 else {**{n: t for n, t in ref.encode_int4(k, k).items() if n.startswith("k")},
                                   "v": f["v"], "v_scale": f["v_scale"]}
    parts = [encode(torch.randn(1024, h, S, d, generator=g, device=dev),
                    torch.randn(1024, h, S, d, generator=g, device=dev)) for _ in range(-(-n * b // 1024))]
    pages = {f: torch.cat([p[f] for p in parts])[: n * b].contiguous() for f in parts[0]}
    del parts
    table = torch.randperm(n * b, device=dev, dtype=torch.int64).to(torch.int32).view(b, n)
    lens = torch.full((b,), n * S, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, generator=g, device=dev, dtype=torch.float16)
    key_bytes = sum(t.numel() * t.element_size() for f, t in pages.items() if f.startswith("k"))  # the key pass reads

    def ms(fn, reps=20) -> float:
        if dev.type == "cpu":  # --smoke under TRITON_INTERPRET=1: the code path, once, not a time
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        fn()
        # the reps captured in one CUDA graph and replayed, as a step runs them: device time and
        # the graph's gaps between kernels, not the host's launching of each call
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        end.synchronize()
        del graph
        return start.elapsed_time(end) / (3 * reps)

    keys = pages["k"]
    copy_ms = ms(lambda: torch.empty_like(keys).copy_(keys))
    print(f"\n{args.shape}, B={b}, {context:,} tokens a row ({n:,} pages), one layer; {'INT4' if int4 else 'INT8'} "
          f"keys {key_bytes / 2**20:.0f} MiB")
    print(f"device copy of the key codes: {copy_ms * 1e3:.0f} us, {2 * keys.numel() / copy_ms / 1e6:.0f} GB/s "
          "(read + write)")
    scores = page_lse(q, pages, table, lens, config=BLOCK_CONFIG)
    load = "pairs" if int4 else "words"  # int4: nibbles to channel-ordered pairs; int8: codes as int32 words
    print(f"| key pass: layout | pages a step | steps or programs an SM | warps | {load} | us | GB/s read | "
          "x copy time |\n|---|---|---|---|---|---|---|---|")
    configs = [{"transposed": False, "pages": pg, "iters": it, "num_warps": w, load: st}
               for pg, it, w, st in itertools.product((4, 8), (1, 4), (4,), (False, True))]
    configs += [{**DEFAULT_CONFIG, "pages": pg, "programs_per_sm": pps, "num_warps": w, load: st}
                for pg, pps, w, st in itertools.product((1, 2, 4), (8, 16, 24), (1, 2), (True,)) if pg % w == 0]
    results = []
    for cfg in configs:
        steps = cfg["programs_per_sm"] if cfg["transposed"] else cfg["iters"]
        tile = f"{'decode (transposed)' if cfg['transposed'] else 'block'} | {cfg['pages']} | {steps} | " \
               f"{cfg['num_warps']} | {cfg[load]}"
        try:
            got = page_lse(q, pages, table, lens, config=cfg)
        except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
            print(f"| {tile} | failed: {type(e).__name__} | | |")
            continue
        if not torch.allclose(got, scores, rtol=1e-3, atol=1e-3):
            print(f"| {tile} | WRONG | | |")
            continue
        t = ms(lambda cfg=cfg: page_lse(q, pages, table, lens, config=cfg))
        results.append((t, tile))
        print(f"| {tile} | {t * 1e3:.0f} | {key_bytes / t / 1e6:.0f} | {t / copy_ms:.2f} |", flush=True)
    best = min(results)
    default_ms = ms(lambda: page_lse(q, pages, table, lens))
    print(f"fastest: {best[1]}: {best[0] * 1e3:.0f} us; the default {DEFAULT_CONFIG}: {default_ms * 1e3:.0f} us")
    sets = [(pages, table, lens)]
    _, joined = page_lse_sets(q, sets)
    ok = torch.allclose(joined, torch.logsumexp(scores, dim=-1), rtol=1e-5, atol=1e-4)
    both = ms(lambda: page_lse_sets(q, sets))
    print("key pass and normalizer (page_lse_sets, the step's): " + (f"{both * 1e3:.0f} us" if ok else "WRONG"))
    total = torch.logsumexp(scores, dim=-1)
    one, many = {"many_from": None}, {"many_from": 1}
    for name, cfg in (("one program a row", one), ("many programs a row", many)):
        got = page_total(scores, config=cfg)
        ok = torch.allclose(got, total, rtol=1e-5, atol=1e-4)
        print(f"normalizer (page_total), {name}: "
              + (f"{ms(lambda cfg=cfg: page_total(scores, config=cfg)) * 1e3:.0f} us" if ok else "WRONG"))
    print(f"normalizer, torch.logsumexp: {ms(lambda: torch.logsumexp(scores, dim=-1)) * 1e3:.0f} us")
    k = max(1, n // 100)
    wants = torch.full((b,), k, dtype=torch.int32, device=dev)
    old_ms = ms(lambda: table.gather(1, torch.exp(scores - total[..., None]).amax(dim=1).topk(k, dim=-1).indices))
    print(f"picks of 1 % ({k} of {n:,} pages), mass included: torch topk + gather {old_ms * 1e3:.0f} us")
    print("| page_pick | block | warps | top-k us | mass threshold us |\n|---|---|---|---|---|")
    shares = torch.exp(scores - total[..., None]).amax(dim=1)  # each page's mass, as page_pick computes it
    top = set(table[0, shares[0].topk(k).indices].tolist())
    above = shares[0] >= 1e-3
    tiles = [("one program a row", {"block": blk, "num_warps": w, **one})
             for blk, w in ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16), (16384, 16))]
    tiles += [("one program a row, k-th by bisection", {"block": blk, "num_warps": w, "select": "bisect", **one})
              for blk, w in ((4096, 8), (8192, 16), (16384, 16), (16384, 32))]
    tiles += [("many programs a row", {"many_block": blk, **many}) for blk in (256, 512, 1024, 2048, 4096)]
    for name, cfg in tiles:
        chosen, count = page_pick(scores, total, table, k, wants, config=cfg)
        picked, found = page_pick(scores, total, table, n, threshold=1e-3, config=cfg)
        tile = cfg.get("many_block", cfg.get("block"))
        if (int(count[0]) != k or set(chosen[0].tolist()) != top or int(found[0]) != int(above.sum())
                or not torch.equal(picked[0, :int(found[0])], table[0, above])):
            print(f"| {name} | {tile} | {cfg.get('num_warps', '')} | WRONG | |")
            continue
        t1 = ms(lambda cfg=cfg: page_pick(scores, total, table, k, wants, config=cfg))
        t2 = ms(lambda cfg=cfg: page_pick(scores, total, table, n, threshold=1e-3, config=cfg))
        print(f"| {name} | {tile} | {cfg.get('num_warps', '')} | {t1 * 1e3:.0f} | {t2 * 1e3:.0f} |", flush=True)
    print(f"(the serving default: {PICK_CONFIG})")
    picked, found = page_pick(scores, total, table, n, coverage=0.99)
    keep = covering(shares, 0.01)[0]
    if int(found[0]) != int(keep.sum()) or not torch.equal(picked[0, :int(found[0])], table[0, keep]):
        print("picks by coverage 0.99: WRONG")
    else:
        t_pick = ms(lambda: page_pick(scores, total, table, n, coverage=0.99))
        t_threshold = ms(lambda: coverage_threshold(shares, 0.01))
        print(f"picks by coverage 0.99 ({int(found[0]):,} pages): {t_pick * 1e3:.0f} us, of it the threshold "
              f"(coverage_threshold, a bisection a row) {t_threshold * 1e3:.0f} us")
    int8_ms = ms(lambda: paged_decode_sets(q, [(pages, table, lens, n * S)])[0])
    print(f"{'INT4-key INT8-value' if int4 else 'INT8'} decode of the layer (keys and values): {int8_ms * 1e3:.0f} us; "
          f"the fastest key pass is "
          f"{best[0] / int8_ms:.2f}x of it")
