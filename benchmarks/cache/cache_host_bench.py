"""The host's side of the cache's decode steps, without a GPU: CacheManager on the kernel path
(use_kernels, CPU tensors under Triton's interpreter) with every kernel launch replaced by a
no-op, so what is timed is the Python and torch work of a step (the cache's bookkeeping, the
kernel wrappers' checks and tile choice, the index copies and token writes), not the kernels
and not Triton's own launch path, which a GPU run measures (gpu_cache_bench.py --launch).

    python3 benchmarks/cache/cache_host_bench.py [--shapes smollm2-int8-1,...] [--steps 20] [--context 1024]
        [--chunk 512]

Prints µs of host time per layer of a batch step (append_step + attend_step), the fastest of
five runs, and the launches a layer makes. With --chunk T, of a prompt chunk of T tokens instead
(append + attend for one row, append_chunk + attend_chunk for several); each run's chunks add to
the rows' context, so keep --steps small there. The outputs are meaningless (nothing runs); only the
time counts. Use it to compare two versions of the host code on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels become interpreted functions

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH: an older copy may go first

from kvguard.cache import CacheConfig, CacheManager  # noqa: E402
from kvguard.types import Subject  # noqa: E402

MODELS = {"smollm2": (30, 9, 3, 64), "llama3": (32, 32, 8, 128)}  # layers, Hq, H, D
LAUNCHES = [0]


def _no_launch(self, *args, **kwargs):
    LAUNCHES[0] += 1


def step_host_time(model: str, codec: str, rows: int, context: int, steps: int,
                   evictor: str | None = None, chunk: int = 0) -> tuple[float, float]:
    """(µs of host time per layer of a batch step, or of a chunk of `chunk` tokens, launches per layer)."""
    layers, hq, h, d = MODELS[model]
    grow = (3 + 5 * steps) * chunk  # tokens each row gains over the runs of chunks
    cfg = CacheConfig(num_layers=layers, num_kv_heads=h, num_query_heads=hq, head_dim=d,
                      num_pages=rows * ((context + grow) // 16 + 64), dtype=torch.bfloat16, device=torch.device("cpu"),
                      codec=codec, fp_sink=4 if codec != "fp16" else 0, fp_window=128 if codec != "fp16" else 0,
                      use_kernels=True, evictor=evictor,
                      evictor_options={"budget": context + grow + 4096} if evictor else {})
    m = CacheManager(cfg)
    seqs = [m.open(Subject("bench", f"user-{i}", f"session-{i}")) for i in range(rows)]
    for seq in seqs:
        kv = torch.zeros(context, h, d, dtype=torch.bfloat16)
        for layer in range(layers):
            assert m.append(seq, layer, kv, kv)
    q = torch.zeros(rows, hq, d, dtype=torch.bfloat16)
    kv = torch.zeros(rows, h, d, dtype=torch.bfloat16)
    qc = torch.zeros(rows, chunk, hq, d, dtype=torch.bfloat16)
    kc = torch.zeros(rows, chunk, h, d, dtype=torch.bfloat16)

    def run(n):
        for _ in range(n):
            for layer in range(layers):
                if not chunk:
                    assert m.append_step(seqs, layer, kv, kv)
                    m.attend_step(seqs, layer, q)
                elif rows == 1:
                    assert m.append(seqs[0], layer, kc[0], kc[0])
                    m.attend(seqs[0], layer, qc[0])
                else:
                    assert m.append_chunk(seqs, layer, kc, kc)
                    m.attend_chunk(seqs, layer, qc)

    run(3)
    best, launches = float("inf"), 0.0
    for _ in range(5):
        LAUNCHES[0] = 0
        t0 = time.perf_counter()
        run(steps)
        best = min(best, (time.perf_counter() - t0) / (steps * layers))
        launches = LAUNCHES[0] / (steps * layers)
    return best * 1e6, launches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-fp16-1,smollm2-int8-1,smollm2-int8-8,llama3-int8-8,smollm2-int8+h2o-1,"
                    "smollm2-int8+h2o-8", help="MODEL-CODEC[+h2o]-ROWS, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timed run")
    ap.add_argument("--context", type=int, default=1024, help="tokens each row holds before the steps")
    ap.add_argument("--chunk", type=int, default=0, help="time prompt chunks of this many tokens instead of steps")
    a = ap.parse_args()
    if a.steps < 1 or a.context < 1 or a.chunk < 0:
        ap.error("--steps and --context must be positive, --chunk not negative")
    interpreter.InterpretedFunction.run = _no_launch
    print(f"{'shape':22} {'us/layer':>9} {'launches':>9}")
    for shape in a.shapes.split(","):
        try:
            model, codec, rows = shape.rsplit("-", 2)
            rows = int(rows)
            if model not in MODELS:
                raise ValueError
        except ValueError:
            ap.error(f"bad shape {shape!r}: want MODEL-CODEC[+h2o]-ROWS with MODEL in {sorted(MODELS)}")
        evictor = None
        if codec.endswith("+h2o"):
            codec, evictor = codec[:-4], "h2o"
        us, launches = step_host_time(model, codec, rows, a.context, a.steps, evictor, a.chunk)
        print(f"{shape:22} {us:9.1f} {launches:9.1f}", flush=True)


if __name__ == "__main__":
    main()
