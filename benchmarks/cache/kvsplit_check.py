"""The K/V split's correctness on the device before it is timed (benchmarks/cache/kvsplit_bench.py).

On a short context of two rows and two layers at a model's head shape: the split's kernel path
with every page read against the cache without the split (INT8 keys on the device, and INT4 keys
there with the INT8 ones in host memory); with a fraction, against its reference path (dense
fp32); a 64-query chunk both ways; steps replayed from a CUDA graph (StaticStep) against eager
steps; with device slots against without (eager bit for bit); and the picks alone at the page
counts the benchmark times, with heavy pages, against torch's. On a GPU before timing; on
the CPU under Triton's interpreter (no CUDA graph there) in the tests, on a smaller shape, shorter
rows and picks of fewer pages.

    python benchmarks/cache/kvsplit_bench.py --check-only
"""

from __future__ import annotations

import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache import events as ev
from kvguard.cache.step import StaticStep
from kvguard.types import Subject

S = 16  # tokens a page
HOST_KEYS = {"keys": "int4", "host_keys": True}  # INT4 keys pick on the device, INT8 in host memory attend


TOL = 2e-2  # the split's paths against each other (fp16 scores on one side, fp32 on the other)
FULL_TOL = 2e-3  # every page read against the cache without the split
TIMED_PAGES = (15_031, 28_053)  # a row's pages at the contexts the benchmark times (240K and 448K tokens)


def picks_at_scale(hq: int, device: str, pages: tuple[int, ...] = TIMED_PAGES) -> tuple[int, int]:
    """The device's picks at the lengths the benchmark times (240K and 448K tokens of 16), where the
    steps above never go: page scores of two rows of `hq` query heads with 1 % of the pages heavy
    (12 nats), so that a coverage rule keeps few of them (on random keys it keeps nearly all, and a
    threshold that kept every page would pass unseen). Each row's pages picked by coverage 0.99 and
    by a top 1 % are compared with torch's (kvguard/cache/picks.py). Returns (rows that picked
    other pages, rows compared)."""
    from kvguard.kernels.page_pick import page_pick, page_total

    from kvguard.cache.picks import covering, top

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(5)
    wrong = rows = 0
    for n in pages:
        heavy = torch.rand(2, 1, n, generator=g, device=dev) < 0.01
        scores = (torch.randn(2, hq, n, generator=g, device=dev) + 12.0 * heavy).contiguous()
        total = page_total(scores)
        best = (scores - torch.logsumexp(scores, -1, keepdim=True)).exp().amax(1)  # [2, n]
        table = torch.arange(2 * n, device=dev, dtype=torch.int32).view(2, n)
        k = -(-n // 100)
        for want, coverage, ref in ((None, 0.99, covering(best, 0.01)),
                                    (torch.full((2,), k, device=dev, dtype=torch.int32), None, top(best, k))):
            chosen, count = page_pick(scores, total, table, n if want is None else k, want, 0.0, coverage)
            for r in range(2):
                got = set((chosen[r, : count[r]] - r * n).tolist())
                wrong += got != set(ref[r].nonzero().flatten().tolist())
                rows += 1
    return wrong, rows


def check(shape: tuple[int, int, int, int], device: str, n: int = 4096 + 300, window: int = 512,
          chunk_queries: int = 64, pick_pages: tuple[int, ...] = TIMED_PAGES) -> tuple[bool, bool]:
    """Print the comparisons; returns (whether the split's passed, whether its slots' did).
    shape: (layers, KV heads, head dim, query heads), of which 2 layers are built; n: the
    longer row's tokens (the other has a quarter fewer); window: the split's; chunk_queries: a
    chunk's queries; pick_pages: the rows' pages where the picks alone are compared.

    Two paths that score in different precisions can pick different pages where two pages'
    shares are within rounding of the cut (on random keys, many are): a step of a row is
    compared where both paths read the same pages (by the step's `fetch` event), and the steps
    that did not are counted; at most one in six may differ. A chunk's queries fetch as one, so
    there the query-layers beyond the tolerance are counted; at most one in 64 (and one)."""
    _, h, d, hq = shape
    dev = torch.device(device)
    lengths = (n, n - n // 4)
    graphs = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    ks = torch.randn(3, 2, 2, h, d, generator=g, device=dev, dtype=torch.float16)  # steps, layers, rows
    qs = torch.randn(3, 2, 2, hq, d, generator=g, device=dev, dtype=torch.float16)

    def run(split, kernels, graph=False):
        """Three decode steps of two rows over 2 layers, eager or (the first eager, then captured and
        replayed) through a StaticStep in a CUDA graph. Returns the outputs [3 x 2 layers, 2 rows,
        Hq, D] and the split pages each step of each row read (by its fetch events)."""
        m = CacheManager(CacheConfig(num_layers=2, num_kv_heads=h, head_dim=d, num_query_heads=hq, page_size=S,
                                     num_pages=512, num_hot_pages=512, dtype=torch.float16, device=dev,
                                     codec="int8", fp_sink=16, fp_window=128, kv_split=split,
                                     use_kernels=kernels))
        g = torch.Generator(device=dev).manual_seed(2)
        seqs = [m.open(Subject("bench", f"u{i}", f"s{i}")) for i in range(2)]
        for t, seq in zip(lengths, seqs):
            for layer in range(2):
                k = torch.randn(t, h, d, generator=g, device=dev, dtype=torch.float16)
                k[::97] *= 4  # pages that matter more
                m.append(seq, layer, k, torch.randn(t, h, d, generator=g, device=dev, dtype=torch.float16))
            if split:
                m.split_cold(seq)
        m.events.take_events()
        outs, picks = [], []

        def picked():  # the split pages each row read in the step just done
            if m.split is not None:
                m.split.drain()
            got = {e.seq: tuple(sorted(e.pages)) for e in m.events.take_events() if isinstance(e, ev.PagesFetched)}
            picks.append([got.get(seq, ()) for seq in seqs])
        if graph:  # the first step eagerly through the fixed buffers, then captured and replayed
            step, cuda_graph = StaticStep(m, seqs, n + 10), None
            kb, qb = ks[0].clone(), qs[0].clone()

            def body():
                for layer in range(2):
                    step.write(layer, kb[layer], kb[layer])
                    yield step.attend(layer, qb[layer])
            for i in range(3):
                kb.copy_(ks[i])
                qb.copy_(qs[i])
                with step:
                    if i == 0:
                        outs += [o.float() for o in body()]
                    else:
                        if cuda_graph is None:
                            cuda_graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(cuda_graph):
                                captured = list(body())
                        cuda_graph.replay()
                if i:
                    outs += [o.float() for o in captured]
                picked()
        else:
            for i in range(3):
                for layer in range(2):
                    m.append_step(seqs, layer, ks[i, layer], ks[i, layer])
                    outs.append(m.attend_step(seqs, layer, qs[i, layer]).float())
                picked()
        if m.split is not None:
            assert m.pools["split"].used_count > 0
        return torch.stack(outs), picks

    def steps(a, b) -> tuple[float, int]:
        """Two runs' outputs where they read the same pages (max |diff|), and the row-steps that did not."""
        (oa, pa), (ob, pb) = a, b
        worst, differ = 0.0, 0
        for i in range(3):
            for r in range(2):
                if pa[i][r] != pb[i][r]:
                    differ += 1
                    continue
                worst = max(worst, (oa[2 * i:2 * i + 2, r] - ob[2 * i:2 * i + 2, r]).abs().max().item())
        return worst, differ

    def chunk(split, kernels):
        """A chunk of queries after the split moved the older pages, each layer."""
        m = CacheManager(CacheConfig(num_layers=2, num_kv_heads=h, head_dim=d, num_query_heads=hq, page_size=S,
                                     num_pages=512, num_hot_pages=512, dtype=torch.float16, device=dev,
                                     codec="int8", fp_sink=16, fp_window=128, kv_split=split,
                                     use_kernels=kernels))
        g = torch.Generator(device=dev).manual_seed(4)
        seq = m.open(Subject("bench", "u", "s"))
        for t in (n, chunk_queries):  # the chunk after the split moved the older pages
            for layer in range(2):
                k = torch.randn(t, h, d, generator=g, device=dev, dtype=torch.float16)
                k[::97] *= 4
                m.append(seq, layer, k, torch.randn(t, h, d, generator=g, device=dev, dtype=torch.float16))
        q = torch.randn(2, chunk_queries, hq, d, generator=g, device=dev, dtype=torch.float16)
        return torch.stack([m.attend(seq, layer, q[layer]).float() for layer in range(2)])

    def queries(a, b) -> tuple[float, int]:
        """Two chunks' outputs [2 layers, T, Hq, D]: the largest |diff| of a query within TOL, and
        how many query-layers were beyond it."""
        diff = (a - b).abs().amax(dim=(2, 3))
        return diff[diff <= TOL].max().item() if (diff <= TOL).any() else float("inf"), int((diff > TOL).sum())

    rule = {"window": window}
    fractions = [{"fraction": 0.25}, {"fraction": 0.25, "keys": "int4"}, {"fraction": 0.25, **HOST_KEYS}]
    # the coverage rule (its threshold a bisection a row on the device; tests/cache cover it
    # interpreted): compiled only
    covered = [{"coverage": 0.99}] if graphs else []
    # every page read: the cache without the split, the keys INT8 on the device or in host memory
    full = max((run(None, True)[0] - run({**rule, "fraction": 1.0, **x}, True)[0]).abs().max().item()
               for x in ({}, HOST_KEYS))
    chunk_full = (chunk(None, True) - chunk({**rule, "fraction": 1.0}, True)).abs().max().item()
    part, part_differ = 0.0, []  # a fraction, the kernel path against the reference path
    for r in fractions + covered:
        worst, differ = steps(run({**rule, **r}, True), run({**rule, **r}, False))
        part, part_differ = max(part, worst), part_differ + [differ]
    chunks, chunk_beyond = 0.0, 0
    for r in fractions[:2] + [{"fraction": 0.25, "normalize": "all"}, {"mass": 1e-3}, fractions[2]] + covered:
        worst, beyond = queries(chunk({**rule, **r}, True), chunk({**rule, **r}, False))
        chunks, chunk_beyond = max(chunks, worst), max(chunk_beyond, beyond)
    graph, graph_differ = 0.0, []
    for r in (fractions + [{"mass": 1e-3}] + covered) if graphs else ():  # replayed against eager
        worst, differ = steps(run({**rule, **r}, True, graph=True), run({**rule, **r}, True))
        graph, graph_differ = max(graph, worst), graph_differ + [differ]
    # the pages read last kept in device slots (kv_split.slots): the same answer, eager bit for bit,
    # with INT8 keys on the device and in host memory
    kept = kept_graph = 0.0
    try:
        for x in ({}, HOST_KEYS):
            plain, slots = {**rule, "fraction": 0.25, **x}, {**rule, "fraction": 0.25, "slots": 512, **x}
            kept = max(kept, (run(slots, True)[0] - run(plain, True)[0]).abs().max().item())
            if graphs:  # replayed, against replayed without slots (a fetch names the pages copied, not
                # those a slot served, so the pages read are not compared: the outputs are, all of them)
                got = (run(slots, True, graph=True)[0] - run(plain, True, graph=True)[0]).abs().max().item()
                kept_graph = max(kept_graph, got)
    except Exception as e:  # noqa: BLE001 (reported: the caller drops the slots' rows)
        print(f"check: the split with slots failed: {type(e).__name__}: {e}")
        kept = kept_graph = float("inf")
    slots_ok = kept == 0 and kept_graph == 0
    wrong, rows = picks_at_scale(hq, device, pick_pages)
    ok = (wrong == 0 and full < FULL_TOL and chunk_full < FULL_TOL and part < TOL and max(part_differ) <= 1 and chunks < TOL
          and chunk_beyond <= max(1, chunk_queries // 32) and graph < TOL and max(graph_differ, default=0) <= 1)
    print(f"check: every page read vs no split (INT8 keys on the device or in host memory) max|diff| {full:.2e}, "
          f"a {chunk_queries}-query chunk {chunk_full:.2e}; fraction 0.25 (INT8 keys, INT4, INT4 with INT8 in host memory) kernel "
          f"(and coverage 0.99 on a GPU) vs reference path {part:.2e} where they read the same pages (row-steps of 6 that read others: "
          f"{part_differ}), a chunk (also read and all, mass 1e-3) {chunks:.2e} ({chunk_beyond} query-layers of {2 * chunk_queries} "
          f"beyond {TOL:g}); replayed from a CUDA graph vs eager (also mass 1e-3) "
          + (f"{graph:.2e} (row-steps that read others: {graph_differ})" if graphs else "not run (no CUDA here)")
          + f"; picks of {' and '.join(f'{p:,}' for p in pick_pages)} pages, 1 % heavy, by coverage 0.99 and a top 1 % vs torch's: {wrong} "
          f"rows of {rows} picked others: {'PASSED' if ok else 'FAILED'}; with slots vs without, eager {kept:.2e}, replayed {kept_graph:.2e}: "
          f"{'PASSED' if slots_ok else 'FAILED'}")
    return ok, slots_ok
