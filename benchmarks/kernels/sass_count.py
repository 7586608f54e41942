"""Instructions in paged_decode's (or paged_prefill's) hot loop, counted in its sm_90 SASS:
compiled without a GPU.

    python3 benchmarks/kernels/sass_count.py --codec int4 [--head-dim 128] [--config '{"maxnreg": 128}'] [--mass]
        [--kernel decode|prefill] [--dump FILE]

The decode kernels are bound by latency and issue more than by bandwidth at short contexts, so
the instructions a loop step spends per token are what a change to the loader is judged by first
(docs/benchmarks.md), before any device time. The kernel and its compile-time arguments are those
paged_decode would launch for a batch of 8 sequences at the given head_dim (llama3's 32/8 heads
at 128, smollm2's 9/3 at 64; `--config` overrides the tile as paged_decode's `config` does);
every pointer is taken as 16-byte aligned, as a launch with whole page tensors specializes it.
`--kernel prefill`: paged_prefill's kernel for a chunk of one sequence, its tile (prefill_config) with
`--config` over it.
Triton compiles for sm_90 with its own ptxas; cuobjdump (shipped beside it) disassembles. A loop
is a backward branch's span; its instructions are listed by opcode.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET"):  # read when kernels are defined: this needs the compiler
    sys.exit("unset TRITON_INTERPRET: sass_count compiles the kernels")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvguard.kernels import paged_decode as pd  # noqa: E402
from kvguard.kernels import paged_prefill as pp  # noqa: E402
from kvguard.kernels import quantize as ref  # noqa: E402
from kvguard.kernels._checks import KIND, field_args  # noqa: E402

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
SHAPES = {128: (32, 8), 64: (9, 3)}  # head_dim -> (query heads, KV heads)
PAGE = 16


def pages_of(codec: str, h: int, d: int, n: int) -> dict[str, torch.Tensor]:
    k = torch.randn(n, h, PAGE, d)
    v = torch.randn(n, h, PAGE, d)
    if codec == "16bit":
        return {"k": k.half(), "v": v.half()}
    if codec == "int4":
        return ref.encode_int4(k, v)
    return ref.encode_int8(k, v, torch.int8 if codec == "int8" else torch.float8_e4m3fn)


def compile_decode(codec: str, d: int, config: dict | None, mass: bool):
    """The compiled kernel paged_decode would launch (batch 8, 4 pages each), its tile's config
    and the tokens a loop step takes."""
    hq, h = SHAPES[d]
    b, per = 8, 4
    q = torch.randn(b, hq, d, dtype=torch.float16)
    pages = pages_of(codec, h, d, b * per)
    table = torch.arange(b * per, dtype=torch.int32).reshape(b, per)
    lens = torch.full((b,), per * PAGE, dtype=torch.int32)
    # the checks take CPU tensors only under the interpreter (read per call); the loader's
    # ON_GPU is then chosen again for the compiler
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        tile = pd._choose_tile(q, pages, table, lens, config)
    finally:
        del os.environ["TRITON_INTERPRET"]
    f32 = torch.empty(1)
    # the runtime arguments in paged_decode_sets' order; the split, mass and merge flags as a
    # split decode with its own merge pass takes them
    args = (q, *field_args(pages), table, lens, f32, f32, f32, q, f32, lens, 1.0, per, 64, 64, 2, 0)
    consts = {**tile.consts, "SPLIT": True, "MASS": mass, "FUSED": False,
              "ON_GPU": pd._on_gpu(codec, tile.cfg, tile.words)}
    if "PDL" in [p.name for p in tile.kernel.params]:
        consts["PDL"] = bool(tile.cfg.get("pdl"))
    return _compile(tile.kernel, args, consts), tile.cfg, tile.bn


def compile_prefill(codec: str, d: int, config: dict | None):
    """The compiled kernel paged_prefill would launch for a 64-token chunk at the end of 256 tokens."""
    hq, h = SHAPES[d]
    per, t = 16, 64
    q = torch.randn(t, hq, d, dtype=torch.float16)
    pages = pages_of(codec, h, d, per)
    table = torch.arange(per, dtype=torch.int32)
    cfg = pp.prefill_config(d, config, codec, PAGE)
    f32 = torch.empty(1)
    # _prefill_kernel's runtime arguments as paged_prefill's _launch passes them (one split)
    args = (q, *field_args(pages), table, q, f32, 1.0, t, per * PAGE, f32, f32, 0, per * PAGE, 1)
    consts = dict(H=h, G=hq // h, S=PAGE, D=d, KIND=KIND[codec], GROUP=ref.INT4_GROUP, BLOCK_M=cfg["block_m"],
                  PAGES=cfg["pages"], ON_GPU=True, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  LIMITS=False, LENS=False, SPLIT=False, PEEL=bool(cfg.get("peel")))
    return _compile(pp._prefill_kernel, args, consts), cfg, cfg["pages"] * PAGE


def _compile(fn, args: tuple, consts: dict):
    names = [p.name for p in fn.params]
    consts = dict(consts)
    opts = {k: consts.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in consts}
    sig, attrs = {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + TYPES[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if isinstance(a, float) else "i32"
    for name in names[len(args):]:
        sig[name] = "constexpr"
    cexpr = {(names.index(k),): v for k, v in consts.items() if k in names}
    src = ASTSource(fn, sig, constexprs=cexpr, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def disassemble(compiled) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """(first address, branch address, instructions) of each backward branch's span."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    found = []
    for at, ins in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < at:
            start = int(m.group(1), 16)
            found.append((start, at, [x for a, x in code if start <= a <= at]))
    return found


def opcode(ins: str) -> str:
    words = ins.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="int4", choices=("16bit", "int8", "fp8", "int4"))
    ap.add_argument("--head-dim", type=int, default=128, choices=sorted(SHAPES))
    ap.add_argument("--config", default=None, help="tile overrides, JSON (paged_decode's config)")
    ap.add_argument("--mass", action="store_true", help="the decode variant that also writes H2O's logits")
    ap.add_argument("--kernel", default="decode", choices=("decode", "prefill"))
    ap.add_argument("--dump", default=None, help="write the whole SASS here")
    a = ap.parse_args(argv)
    try:
        config = json.loads(a.config) if a.config else None
    except json.JSONDecodeError as e:
        ap.error(f"--config is not JSON: {e}")
    if config is not None and not isinstance(config, dict):
        ap.error("--config must be a JSON object")
    if a.kernel == "prefill":
        if a.mass:
            ap.error("--mass is for the decode kernel")
        compiled, cfg, step = compile_prefill(a.codec, a.head_dim, config)
        name = "_prefill_kernel"
    else:
        compiled, cfg, step = compile_decode(a.codec, a.head_dim, config, a.mass)
        name = compiled.name
    sass = disassemble(compiled)
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(sass)
    total = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))
    print(f"{a.codec} head_dim {a.head_dim} {name} {json.dumps(cfg, sort_keys=True)}")
    print(f"  {total} instructions, {compiled.metadata.shared} bytes of shared memory a program")
    for start, end, body in loops(sass):
        ops = collections.Counter(opcode(x) for x in body)
        top = ", ".join(f"{k} {n}" for k, n in ops.most_common(12))
        print(f"  loop {start:#x}-{end:#x}: {len(body)} instructions per step of {step} tokens: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
