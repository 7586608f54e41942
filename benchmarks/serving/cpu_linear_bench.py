"""The linear layers of one serve-llm decode step on the CPU, apart from the rest of the step.

SmolLM2-135M's 211 linear layers (30 layers of q, k, v, o, gate, up, down, and the 49,152-row
head), random weights, packed for oneDNN as serve-llm packs them (kvguard/hf/cpu.py), each
multiplied once by a batch of --rows rows: what a decode step costs at the least, with the bytes
of weights read per second, for each dtype and torch thread count:

    python benchmarks/serving/cpu_linear_bench.py [--rows 8] [--threads 1,2] [--dtypes float32,bfloat16]

A dtype oneDNN cannot pack on this CPU runs unpacked (the row says so).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from kvguard.hf.cpu import pack_linears

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 576, 1536, 30, 49152, 192
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE),
          (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)] * LAYERS + [(HIDDEN, VOCAB)]


def step_ms(dtype: torch.dtype, rows: int, repeat: int, shapes=SHAPES) -> tuple[float, int]:
    """(ms a step, layers packed): the median of `repeat` steps after two warm-up steps."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in shapes).to(dtype).eval()
    packed = pack_linears(layers, rows)
    xs = {i: torch.randn(rows, i, dtype=dtype) for i in {i for i, _ in shapes}}
    times = []
    with torch.no_grad():
        for k in range(repeat + 2):
            t = time.perf_counter()
            for layer in layers:
                layer(xs[layer.in_features])
            if k >= 2:
                times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3, packed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", type=int, default=8, help="rows of a decode step (default 8)")
    p.add_argument("--threads", default="1,2", help="torch thread counts (comma-separated)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="weight dtypes (comma-separated)")
    p.add_argument("--repeat", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument("--small", action="store_true", help="two layers' shapes, two steps (the test's)")
    a = p.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",")]
        dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    except (ValueError, AttributeError) as e:
        p.error(f"bad --threads or --dtypes: {e}")
    if a.rows < 1 or a.repeat < 1 or min(threads) < 1 or not all(isinstance(d, torch.dtype) for d in dtypes):
        p.error("--rows, --repeat and --threads must be positive, --dtypes torch dtypes")
    shapes, repeat = (SHAPES[:14], 2) if a.small else (SHAPES, a.repeat)
    print(f"| dtype | threads | layers packed | ms a step ({a.rows} rows) | weights GB/s |")
    print("|---|---|---|---|---|")
    for dtype in dtypes:
        size = sum(i * o for i, o in shapes) * torch.finfo(dtype).bits // 8
        for n in threads:
            torch.set_num_threads(n)
            ms, packed = step_ms(dtype, a.rows, repeat, shapes)
            print(f"| {str(dtype).removeprefix('torch.')} | {n} | {packed} of {len(shapes)} | {ms:.1f} | "
                  f"{size / ms / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
