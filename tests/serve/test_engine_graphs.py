"""The serving engine's decode steps through a DecodeGraph per batch size, rebound to each
step's rows, give the tokens of its eager steps as requests join and leave, with and without
the K/V split.

Without a GPU the graphs' steps run eagerly through their fixed buffers on the kernel path
under Triton's interpreter, in a fresh interpreter (TRITON_INTERPRET is read when triton loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import tests.kernels.conftest  # compiled on a GPU, else TRITON_INTERPRET (set before triton loads)
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from kvguard.cache import CacheConfig, CacheManager
from kvguard.hf import register
from kvguard.hf.cache import shape_fields
from kvguard.serve.engine import Engine
from kvguard.serve.scheduler import Request, SamplingParams
from kvguard.types import Subject

register()
dev = "cuda" if torch.cuda.is_available() else "cpu"
cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(dev, torch.float16).eval()
model.set_attn_implementation("kvguard")

class Tok:
    eos_token_id = None
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

def run(graphs, codec, **extra):
    m = CacheManager(CacheConfig(**shape_fields(cfg), codec=codec, num_pages=64, device=dev, dtype=torch.float16,
                                 use_kernels=True, prefix_sharing=False, **extra))
    split = []  # the K/V split's pages after each step (rows past its window read values by score)
    e = Engine(model, Tok(), m, chunk=64, max_seqs=4, ignore_eos=True, use_graphs=graphs)
    reqs = [Request(str(i), Subject("t", "u", f"s{i}"), [(7 * i + j) % 96 for j in range(9 + 5 * i)],
                    SamplingParams(max_tokens=6 + 2 * i, temperature=0)) for i in range(3)]
    e.submit(reqs[0]); e.submit(reqs[1])
    for _ in range(3):
        e.step()
    e.submit(reqs[2])  # joins while the others decode: batch sizes 2, 3, then 2 and 1 as they leave
    while e.scheduler.active:
        e.step()
        split.append(m.pools["split"].used_count if "split" in m.pools else 0)
    assert m.sequences() == []
    assert ("kv_split" in extra) == (max(split) > 0), split
    return [r.output for r in reqs], sorted(e.graphs or {})

# int8 pages: the 16-bit window's pages and the codec's, both through the graph; then with the
# K/V split's pages as well (keys scored on the device, the values of two a row read)
for codec, extra in (("int8", {}), ("int8", {"page_size": 8, "kv_split": {"window": 8, "top_k": 2}})):
    eager, none = run(False, codec, **extra)
    replayed, sizes = run(True, codec, **extra)
    assert none == [] and sizes == [1, 2, 3], sizes
    assert replayed == eager, (codec, extra, replayed, eager)
    assert [len(o) for o in eager] == [6, 8, 10]
print("ok")
"""


@pytest.mark.slow
def test_decode_graphs_per_batch_size_give_the_eager_tokens():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
