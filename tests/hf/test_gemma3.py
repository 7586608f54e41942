"""Gemma 3 270M through kvguard.hf against transformers' own cache: sliding-window layers.

Its sliding window (512) is cut to 32 tokens on the loaded model (the config and every window
layer's attention, as transformers reads them) for these tests, so that a short generation
crosses it several times; the reference, DynamicCache with SDPA, runs under the same window, and
the full window's output differs on this slice, so the window is what is compared."""

from __future__ import annotations

import contextlib
import inspect
import json

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria

from kvguard.errors import ConfigError
from kvguard.hf import DecodeGraph, KVGuardCache, layer_windows

from .conftest import attn, kv

pytestmark = pytest.mark.xdist_group("gemma3")  # one worker loads Gemma 3, for tests/serve/test_gemma3_serve.py too

W, PROMPT, NEW, PAGE = 32, 40, 40, 16


@contextlib.contextmanager
def windowed(model, w: int):
    """The model's sliding-window layers attend over `w` tokens, then their own window again."""
    mods = [layer.self_attn for layer in model.model.layers if layer.self_attn.is_sliding]
    old = model.config.sliding_window
    model.config.sliding_window = w
    for m in mods:
        m.sliding_window = w
    try:
        yield
    finally:
        model.config.sliding_window = old
        for m in mods:
            m.sliding_window = old


class Record(StoppingCriteria):
    """After every step: the tokens a window layer holds and the window layers' pages in use."""

    def __init__(self, cache: KVGuardCache):
        self.cache, self.held, self.pages = cache, [], []

    def __call__(self, input_ids, scores, **kwargs):
        m = self.cache.manager
        self.held.append(m.length(self.cache.seqs[0], 0))
        self.pages.append(sum(m.parts[W].stats().pages_used.values()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def greedy(model, ids, cache, **kw):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **kv(model, cache), **kw)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def gemma(gemma3):
    model, tok = gemma3
    ids = tok(inspect.getsource(json.decoder), return_tensors="pt").input_ids[:, 200:200 + PROMPT]
    with windowed(model, W), attn(model, "sdpa"):
        ref = greedy(model, ids, DynamicCache(config=model.config))
    return model, ids, ref


def test_layer_windows_read_from_the_config(gemma3):
    windows = layer_windows(gemma3[0].config)
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    assert {w for w in windows if w is not None} == {512}


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_greedy_matches_dynamic_cache_and_window_pages_stay_bounded(gemma, alice, codec):
    model, ids, ref = gemma
    with windowed(model, W):
        cache = KVGuardCache(model.config, alice, codec=codec, num_pages=32)
        rec = Record(cache)
        got = greedy(model, ids, cache, stopping_criteria=[rec])
    events = cache.events.take_events()
    if codec == "fp16":
        assert torch.equal(got, ref)
    else:  # int8 pages: the same text but for a rare token
        assert (got == ref).float().mean() >= 0.9
        assert {e.pages[0].split(":")[0] for e in events if e.op == "quantize"} == {"main", f"window{W}-main"}
    # a window layer holds at most the window and a page, in as many pages, at every step
    assert max(rec.held) <= W + PAGE and max(rec.pages) <= (W + PAGE) // PAGE + 1
    m = cache.manager
    fed = PROMPT + NEW - 1
    assert m.length(cache.seqs[0], 5) == fed  # a global layer holds everything
    evicts = [e for e in events if e.op == "evict"]
    assert evicts and all(e.reason == "window" and e.pages[0].startswith(f"window{W}-") for e in evicts)
    assert sum(e.n_tokens for e in evicts) == fed - m.length(cache.seqs[0], 0)


def test_a_cache_that_does_not_know_the_window_is_refused(gemma, alice):
    model, ids, _ = gemma
    cache = KVGuardCache(model.config, alice, num_pages=8)  # made for the 512-token window
    with windowed(model, W), pytest.raises(ConfigError, match="sliding window 32"):
        greedy(model, ids[:, :4], cache)


def test_no_decode_graph_over_window_layers(gemma, alice):
    model, ids, _ = gemma
    cache = KVGuardCache(model.config, alice, num_pages=8)
    with torch.no_grad():
        model(ids[:, :4], **kv(model, cache))
    with pytest.raises(ConfigError, match="sliding window"):
        DecodeGraph(model, cache, 16, capture=False)
