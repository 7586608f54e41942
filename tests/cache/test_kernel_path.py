"""The cache's kernel path (quantize-on-write, paged decode and prefill) against its reference path,
run under Triton's interpreter in a fresh interpreter (it must be set before triton loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import tests.kernels.conftest  # sets TRITON_INTERPRET and mends the interpreter for this numpy
import torch
from kvguard.cache import CacheConfig, CacheManager
from kvguard.types import Subject
from tests.conftest import outlier_kv

codec, evictor, per_head, tol = "{codec}", {evictor!r}, {per_head!r}, {tol!r}
def run(use_kernels):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, num_query_heads=8, head_dim=64, num_pages=32, codec=codec,
                      codec_options={{"rotate": True}} if {rotate!r} else {{}},
                      fp_sink=4, fp_window=16, use_kernels=use_kernels, evictor=evictor,
                      evictor_options={{"budget": 48, "sink": 4, "window": 16, "per_head": per_head}} if evictor else {{}})
    m = CacheManager(cfg)
    seq = m.open(Subject("t", "u", "s"))
    k, v = outlier_kv(100, 2, 64, seed=3)
    q = torch.randn(100, 8, 64, generator=torch.Generator().manual_seed(4)).half()
    outs = []
    # a prompt, decode steps, a chunk after quantized pages (part of it quantized before the last
    # layer reads it), decode steps
    steps = [(0, 50)] + [(i, i + 1) for i in range(50, 60)] + [(60, 90)] + [(i, i + 1) for i in range(90, 100)]
    for lo, hi in steps:
        for layer in range(2):
            m.append(seq, layer, k[lo:hi], v[lo:hi])
            outs.append(m.attend(seq, layer, q[lo:hi]).float())
    fields = {{n: [t.clone() for t in p.fields[1].values()] for n, p in m.pools.items()}}
    return torch.cat([o.flatten() for o in outs]), fields, m._seq(seq).mass.clone(), m.length(seq)

ref_out, ref_fields, ref_mass, ref_len = run(False)
out, fields, mass, length = run(True)
rel = ((out - ref_out).norm() / ref_out.norm()).item()
assert rel < tol, rel
assert length == ref_len
for name in ref_fields:
    for a, b in zip(ref_fields[name], fields[name]):
        if a.dtype in (torch.int8, torch.uint8):
            assert (a.to(torch.int16) - b.to(torch.int16)).abs().max() <= 1  # ties may round either way
        else:
            assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)
if evictor:
    assert ((mass - ref_mass).norm() / ref_mass.norm()).item() < {mass_tol!r}
print("ok", rel)
"""


# Both pools (16-bit and codec pages) are read in one pass, so each key's mass is its
# probability under the softmax over all of them, as on the reference path, and the
# evictor keeps the same tokens, per head too (the pages after compaction are compared). The
# prompt and the chunk's mass come from the prefill mass kernel (SnapKV: the last 32 queries').
# A rotating codec (rotation.py) stores every page rotated and rotates q and the output around
# the same kernels.
@pytest.mark.parametrize("codec, evictor, per_head, tol, mass_tol, rotate", [
    ("fp16", None, False, 2e-3, 0, False), ("int8", None, False, 2e-3, 0, False), ("int4", None, False, 2e-3, 0, False),
    ("int4", None, False, 2e-3, 0, True), ("int8", "h2o", True, 2e-3, 1e-3, True),
    ("int8", "h2o", False, 2e-3, 1e-3, False), ("int8", "h2o", True, 2e-3, 1e-3, False),
    ("int8", "snapkv", False, 2e-3, 1e-3, False)])
def test_kernel_path_matches_reference_path(codec, evictor, per_head, tol, mass_tol, rotate):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = SCRIPT.format(codec=codec, evictor=evictor, per_head=per_head, tol=tol, mass_tol=mass_tol, rotate=rotate)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


BATCH_SCRIPT = r"""
import tests.kernels.conftest
import torch
from kvguard.cache import CacheConfig, CacheManager
from kvguard.types import Subject
from tests.conftest import outlier_kv

def run(use_kernels):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, num_query_heads=8, head_dim=64, num_pages=48, codec="{codec}",
                      codec_options={codec_options!r},
                      fp_sink=4, fp_window=16, use_kernels=use_kernels, evictor="h2o",
                      evictor_options={{"budget": {budget}, "sink": 4, "window": 16}})
    m = CacheManager(cfg)
    seqs = [m.open(Subject("t", f"u{{i}}", f"s{{i}}")) for i in range(3)]
    for i, (seq, n) in enumerate(zip(seqs, (70, 16, 33))):  # rows of different lengths and pools
        k, v = outlier_kv(n, 2, 64, seed=i)
        for layer in range(2):
            m.append(seq, layer, k, v)
    g = torch.Generator().manual_seed(5)
    outs = []
    for _ in range({steps}):
        k = torch.randn(3, 2, 64, generator=g).half()
        q = torch.randn(3, 8, 64, generator=g).half()
        for layer in range(2):
            assert m.append_step(seqs, layer, k, k)
            outs.append(m.attend_step(seqs, layer, q).float())
    return torch.stack(outs), torch.cat([m._seq(s).mass.flatten() for s in seqs]), m.stats().tokens_evicted

ref_out, ref_mass, ref_evicted = run(False)
out, mass, evicted = run(True)
assert evicted == ref_evicted and (evicted > 0) == ({budget} < 100), (evicted, ref_evicted)
rel = ((out - ref_out).norm() / ref_out.norm()).item()
mrel = ((mass - ref_mass).norm() / ref_mass.norm()).item()
assert rel < 2e-3 and mrel < 1e-3, (rel, mrel)
print("ok", rel, mrel)
"""


@pytest.mark.parametrize("codec, budget, steps, rotate", [("int8", 4096, 3, False), ("int4", 4096, 3, False),
                                                          ("int4", 48, 20, True), ("int8", 48, 20, False)])
def test_batch_step_kernel_path_matches_reference_path(codec, budget, steps, rotate):
    # one pass of the kernels over three rows' 16-bit and quantized pages, with H2O's mass
    # added into each row's totals at its keys' positions; with budget 48 rows are compacted
    # on the way (positions no longer equal token indices) and pages fill and get quantized
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = BATCH_SCRIPT.format(codec=codec, budget=budget, steps=steps,
                                 codec_options={"rotate": True} if rotate else {})
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


CHUNK_SCRIPT = r"""
import tests.kernels.conftest
import torch
from kvguard.cache import CacheConfig, CacheManager
from kvguard.types import Subject
from tests.cache.test_batch_step import chunks, opened

def make():
    return CacheManager(CacheConfig(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=64, num_pages=48,
                                    codec="{codec}", fp_sink=4, fp_window=16, use_kernels=True))

a, b = make(), make()
sa, sb = opened(a, (37, 16, 5)), opened(b, (37, 16, 5))
got, want = chunks(a, sa, batched=True).float(), chunks(b, sb, batched=False).float()
rel = ((got - want).norm() / want.norm()).item()
# a row of the batch's launch computes what its own launch does, to the last bit of the 16-bit
# output: the interpreter's matmuls (the CPU's BLAS) may sum a tile's rows in another order when
# the rows sit elsewhere in the tile, which flips a rounding here and there (1 ulp, a few in 10^4)
torch.testing.assert_close(got, want, rtol=2 ** -10, atol=2 ** -24)
assert (got != want).float().mean().item() < 1e-3, rel
for x, y in zip(sa, sb):
    assert a.length(x) == b.length(y)
for name, pool in a.pools.items():
    for f, g in zip(pool.fields[1].values(), b.pools[name].fields[1].values()):
        assert torch.equal(f, g), name
print("ok", rel)
"""


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_batch_chunk_kernel_path_is_its_rows(codec):
    # a batch's chunk in one launch of the prefill kernel per pool (rows of different lengths,
    # pages quantized on the way, padding on the left) against its rows' own prefill calls
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CHUNK_SCRIPT.replace("{codec}", codec)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
