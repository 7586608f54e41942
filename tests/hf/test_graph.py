"""Decode steps replayed from a CUDA graph (kvguard.hf.DecodeGraph, greedy) do what eager steps do,
and a batch's prompt in one pass of the prefill kernel (left padding included) what its rows do
one by one.

Without a GPU the same steps run eagerly through the fixed buffers, on the kernel path under
Triton's interpreter, in a fresh interpreter (TRITON_INTERPRET must be set before triton
loads); with one, the graph is captured and replayed as well."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvguard.errors import ConfigError, InputError
from kvguard.types import Subject

ROOT = Path(__file__).resolve().parents[2]
GPU = torch.cuda.is_available()

GENERATE = r"""
import tests.kernels.conftest  # compiled on a GPU, else TRITON_INTERPRET (set before triton loads)
import warnings
warnings.filterwarnings("error", ".*is deprecated", FutureWarning)  # as the tests of kvguard.hf do
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from kvguard.hf import KVGuardCache, cache_kwarg, greedy
from kvguard.types import Subject

dev = "cuda" if torch.cuda.is_available() else "cpu"
cfg = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(dev, torch.float16).eval()
model.set_attn_implementation("kvguard")
ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1)).to(dev)
mask = torch.ones_like(ids)
mask[1, :5] = 0  # row 1 is left-padded
who = [Subject("acme", "alice", "s1"), Subject("globex", "bob", "s2")]
opts = {opts}

def events(cache):
    return sorted(type(e).__name__ for e in cache.events.take_events())

eager = KVGuardCache(cfg, who, **opts)
want = model.generate(ids, attention_mask=mask, max_new_tokens={new}, do_sample=False, pad_token_id=0,
                      **{cache_kwarg(model): eager})
want_events = events(eager)

class RowByRow(KVGuardCache):  # the prompt and the decode steps row by row
    batched_decode = False

rows = RowByRow(cfg, who, **opts)
assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens={new}, do_sample=False, pad_token_id=0,
                                  **{cache_kwarg(model): rows}), want)
assert events(rows) == want_events
runs = [False] + ([True] if dev == "cuda" else [])
for capture in runs:
    cache = KVGuardCache(cfg, who, **opts)
    got = greedy(model, cache, ids, attention_mask=mask, max_new_tokens={new}, capture=capture)
    assert torch.equal(got, want), (capture, got[:, 24:], want[:, 24:])
    assert [cache.manager.length(s) for s in cache.seqs] == [eager.manager.length(s) for s in eager.seqs]
    assert [layer.seen for layer in cache.layers] == [layer.seen for layer in eager.layers]
    assert cache.stats().tokens_evicted == eager.stats().tokens_evicted
    assert events(cache) == want_events, (events(cache), want_events)
    if "evictor" in opts:
        assert cache.stats().tokens_evicted > 0 and "PagesQuantized" in want_events
    if "kv_split" in opts:  # values went to host memory and were read back by score
        assert "PagesOffloaded" in want_events and "PagesFetched" in want_events
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("opts", [
    {"codec": "fp16", "num_pages": 32},
    {"codec": "int8", "num_pages": 32, "fp_sink": 4, "evictor": "h2o",
     "evictor_options": {"budget": 16, "sink": 4, "window": 8}},
    {"codec": "int8", "num_pages": 32, "fp_sink": 4, "page_size": 8, "kv_split": {"window": 8, "top_k": 2}},
], ids=["fp16", "int8-h2o", "int8-kv-split"])
def test_greedy_through_static_steps_equals_generate(opts):
    # 16 new tokens: pages fill and get quantized; with H2O the rows are compacted on the way
    # (their mass buffers replaced, their positions no longer token indices); with the K/V
    # split, pages move to it between steps and each step reads the values of two of them
    env = dict(os.environ)
    if not GPU:
        env["TRITON_INTERPRET"] = "1"
    script = GENERATE.replace("{opts}", repr({**opts, "use_kernels": True})).replace("{new}", "16")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_decode_graph_refuses_bad_input():
    from transformers import LlamaConfig

    from kvguard.hf import DecodeGraph, KVGuardCache, greedy

    cfg = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    who = Subject("acme", "alice", "s1")
    with pytest.raises(InputError, match="KVGuardCache"):
        DecodeGraph(None, object(), 64)
    with pytest.raises(InputError, match="no rows yet"):
        DecodeGraph(None, KVGuardCache(cfg, who), 64)
    with pytest.raises(InputError, match="max_new_tokens"):
        greedy(None, KVGuardCache(cfg, who), torch.zeros(1, 4, dtype=torch.long), max_new_tokens=0)
    with pytest.raises(InputError, match="pad on the left"):
        greedy(None, KVGuardCache(cfg, who), torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2,
               attention_mask=torch.tensor([[1, 1, 1, 0]]))


def test_greedy_refuses_a_cache_that_already_holds_tokens():
    """greedy numbers the prompt's positions from 0: through a cache that holds tokens already,
    it would write them at positions those tokens hold."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvguard.hf import KVGuardCache, cache_kwarg, greedy

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("kvguard")
    cache = KVGuardCache(cfg, Subject("acme", "alice", "s1"), num_pages=8, dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    with pytest.raises(InputError, match="holds 10 tokens"):
        greedy(model, cache, ids, max_new_tokens=4)
    assert cache.get_seq_length() == 10 and cache.manager.length(cache.seqs[0]) == 10


@pytest.mark.parametrize("eos", [False, True], ids=["max-tokens", "eos"])
def test_greedy_off_the_kernel_path_steps_eagerly_as_generate(monkeypatch, eos):
    """On the CPU (float32 K/V, no kernels) greedy's decode steps are the model's eager
    forward passes, each row's token in one append_step and one attend_step per layer, and give
    generate's tokens and events."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvguard.cache import CacheManager
    from kvguard.hf import KVGuardCache, cache_kwarg, greedy

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)  # eos: as greedy's
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("kvguard")
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 is left-padded
    who = [Subject("acme", "alice", "s1"), Subject("globex", "bob", "s2")]
    opts = {"codec": "int8", "fp_sink": 4, "num_pages": 16}
    eager = KVGuardCache(cfg, who, **opts)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          **{cache_kwarg(model): eager})
    stop = {}
    if eos:  # row 0 stops at its 4th new token, row 1 runs on
        stop = {"eos_token_id": int(want[0, 27])}
        eager = KVGuardCache(cfg, who, **opts)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              **stop, **{cache_kwarg(model): eager})
        assert (want[0, 28:] == 0).all() and want.shape[1] == 36
    steps = []
    original = CacheManager.append_step
    monkeypatch.setattr(CacheManager, "append_step",
                        lambda self, *a, **kw: steps.append(1) or original(self, *a, **kw))
    cache = KVGuardCache(cfg, who, **opts)
    got = greedy(model, cache, ids, attention_mask=mask, max_new_tokens=12, **stop)
    assert cache.manager.cfg.device.type == "cpu" and not cache.manager.cfg.use_kernels
    assert torch.equal(got, want)
    assert len(steps) == 11 * 2  # every decode step of every layer: one batch write
    assert [cache.manager.length(s) for s in cache.seqs] == [eager.manager.length(s) for s in eager.seqs]
    assert [type(e).__name__ for e in cache.events.take_events()] == \
        [type(e).__name__ for e in eager.events.take_events()]
    with pytest.raises(ConfigError, match="kernel path"):  # a CUDA graph asked for off it is refused
        greedy(model, KVGuardCache(cfg, who, **opts), ids, attention_mask=mask, max_new_tokens=2,
               capture=True)
