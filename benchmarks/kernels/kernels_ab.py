"""paged_decode (or paged_prefill) of two versions of kernels/ timed in one process, taking turns:
a code change's effect on speed without the difference between lent GPUs (a few percent) in the way.

    mkdir -p base && git archive REV kernels | tar -x -C base && mv base/kernels base/kernels_base
    PYTHONPATH=. python3 benchmarks/kernels/kernels_ab.py base/kernels_base [--codecs int8,fp8] [--rounds 2]
        [--shapes llama3-8b:16384:8,llama3-8b:32768:8,...]
    PYTHONPATH=. python3 benchmarks/kernels/kernels_ab.py base/kernels_base --kernel prefill --shapes llama3-8b:16384:2048

The other version is imported as a package of its directory's name (anything but `kernels`), so
its Triton kernels compile and cache apart from this tree's. Each round times every shape with
the other version, then with this tree's, through benchmarks/kernels/gpu_bench.py's `bench_decode` or
`bench_prefill` (CUDA-graph replays over data larger than L2; see that file). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

DEFAULT_SHAPES = ("llama3-8b:16384:8,llama3-8b:32768:8,llama3-8b:16384:1,llama3-8b:131072:8,"
                  "smollm2-135m:16384:8")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", help="a directory holding another version of kernels/, not named 'kernels'")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="model:context:batch, comma-separated (prefill: "
                    "model:context:chunk)")
    ap.add_argument("--kernel", default="decode", choices=("decode", "prefill"))
    ap.add_argument("--codecs", default="int8,fp8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--token-major-int4-scales", action="store_true",
                    help="the other version reads int4 value scales and zeros token-major, [P, H, S, D//G] (before "
                         "they were group-major): it gets the same bytes viewed in that shape, the same traffic "
                         "with values not checked")
    a = ap.parse_args()
    path = os.path.abspath(a.other.rstrip("/"))
    name = os.path.basename(path)
    if name == "kernels" or not name.isidentifier() or not os.path.isfile(os.path.join(path, "paged_decode.py")):
        sys.exit(f"{a.other}: expected a copy of kernels/ under another name (e.g. kernels_base)")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    sys.path.append(os.path.dirname(path))
    mod_name = "paged_" + a.kernel
    other = importlib.import_module(f"{name}.{mod_name}")
    import benchmarks.kernels.gpu_bench as gb
    this = importlib.import_module(f"kvguard.kernels.{mod_name}")

    codecs = tuple(a.codecs.split(","))
    shapes = gb.parse_shapes(a.shapes)
    what = "decode step" if a.kernel == "decode" else "prompt chunk"
    print(f"{torch.cuda.get_device_name()}: {name} against this tree, µs per {what}", flush=True)

    def token_major(fn):
        def call(q, pages, *args, **kw):
            if pages["k"].dtype == torch.uint8:
                pages = {**pages, **{f: pages[f].view(*pages[f].shape[:2], pages[f].shape[3], pages[f].shape[2])
                                     for f in ("v_scale", "v_zero")}}
            return fn(q, pages, *args, **kw)
        return call

    for rnd in range(a.rounds):
        for tag, mod in ((name, other), ("this", this)):
            fn = getattr(mod, mod_name)
            setattr(gb, mod_name, token_major(fn) if mod is other and a.token_major_int4_scales else fn)
            for model, length, n in shapes:
                if a.kernel == "decode":
                    r = gb.bench_decode(model, length, n, 1.0, with_baselines=False, codecs=codecs)  # no floors
                else:
                    r = gb.bench_prefill(model, length, n, with_baselines=False, codecs=codecs)
                times = "  ".join(f"{c} {r[c] * 1e6:8.1f}" for c in codecs)
                print(f"round {rnd} {tag:>12} {model:13} {length:6d} x {n:4d}  {times}", flush=True)


if __name__ == "__main__":
    main()
