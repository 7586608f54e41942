"""KVGuardCache under `model.generate` on SmolLM2-135M against transformers' DynamicCache.

The model runs in float32 on the CPU and the cache holds its K/V unchanged (the
16-bit passthrough codec in the model's dtype), so every difference from
DynamicCache would be kvguard's: greedy tokens must agree one for one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvguard.errors import ConfigError
from kvguard.hf import KVGuardCache, cache_kwarg
from kvguard.policy import load_policy
from kvguard.types import Subject

from .conftest import attn, kv, stdlib_text

pytestmark = pytest.mark.xdist_group("hf-generate")  # its module fixtures run once, on one worker

NEW, PROMPT = 32, 160


def greedy(model, ids, cache=None, **kw):
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **kv(model, cache), **kw)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def prompts(code_ids):
    return torch.cat([code_ids[:, :PROMPT], code_ids[:, 200 : 200 + PROMPT]])


@pytest.fixture(scope="module")
def reference(model, prompts):
    """DynamicCache + SDPA greedy tokens: row 0 alone, and both rows as one batch."""
    with attn(model, "sdpa"):
        alone = greedy(model, prompts[:1], DynamicCache(config=model.config))
        batch = greedy(model, prompts, DynamicCache(config=model.config))
    return alone, batch


def test_greedy_matches_dynamic_cache_token_for_token(model, prompts, reference, alice):
    cache = KVGuardCache(model.config, alice, codec="fp16", num_pages=32)
    got = greedy(model, prompts[:1], cache)
    assert got.shape[1] == NEW
    assert torch.equal(got, reference[0])
    assert cache.get_seq_length() == PROMPT + NEW - 1  # the last token is returned, never fed
    assert cache.stats().tokens_held == PROMPT + NEW - 1


def test_batch_of_two_matches_dynamic_cache(model, prompts, reference):
    people = [Subject("acme", "alice", "s-1"), Subject("globex", "bob", "s-9")]
    cache = KVGuardCache(model.config, people, num_pages=64)
    assert torch.equal(greedy(model, prompts, cache), reference[1])
    assert [cache.manager.subject_of(s) for s in cache.seqs] == people


def test_prefill_logits_match_dynamic_cache(model, code_ids, alice):
    ids = code_ids[:, :300]
    with attn(model, "sdpa"), torch.no_grad():
        ref = model(ids, **kv(model, DynamicCache(config=model.config))).logits
    with torch.no_grad():
        got = model(ids, **kv(model, KVGuardCache(model.config, alice, num_pages=32))).logits
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)


def test_int8_runs_emits_quantize_events_and_stays_close(model, prompts, reference, alice):
    cache = KVGuardCache(model.config, alice, codec="int8", fp_sink=4, num_pages=32)
    got = greedy(model, prompts[:1], cache)
    events = cache.events.take_events()
    quantized = [e for e in events if e.op == "quantize"]
    assert quantized and all(e.codec == "int8" and e.subject == alice for e in quantized)
    fed = PROMPT + NEW - 1
    # every full page but the 16-bit sink page is int8; the partly filled tail stays 16-bit
    assert sum(e.n_tokens for e in quantized) == (fed // 16 - 1) * 16
    stats = cache.stats()
    assert stats.pages_used["main"] == fed // 16 - 1
    assert stats.bytes_held < 0.75 * stats.bytes_16bit_equivalent
    agree = (got == reference[0]).float().mean().item()
    assert agree >= 0.75, f"int8 greedy tokens agree with the reference on only {agree:.0%}"
    cache.free()
    assert [e.op for e in cache.events.take_events()] == ["free"]
    assert cache.manager.sequences() == []


def test_left_padded_batch_matches_dynamic_cache(model, tok):
    tok.padding_side = "left"
    texts = [stdlib_text("json.decoder")[:500], stdlib_text("textwrap")[:200]]
    enc = tok(texts, return_tensors="pt", padding=True)
    real = enc.attention_mask.sum(1).tolist()
    assert real[0] > real[1] + 20
    cache = KVGuardCache(model.config, Subject("acme", "alice", "s-1"), num_pages=64)
    got = model.generate(**enc, max_new_tokens=16, do_sample=False, **kv(model, cache))
    with attn(model, "sdpa"):
        want = model.generate(**enc, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, want)
    # padding is never written: each row holds its own tokens only
    assert [cache.manager.length(s) for s in cache.seqs] == [n + 15 for n in real]
    assert cache.get_seq_length() == enc.input_ids.shape[1] + 15


def test_needs_the_kvguard_attention_implementation(model, code_ids, alice):
    with attn(model, "sdpa"), pytest.raises(ConfigError, match="attn_implementation"):
        model(code_ids[:, :8], **kv(model, KVGuardCache(model.config, alice)))
    with pytest.raises(ConfigError, match=rf"pass {cache_kwarg(model)}=KVGuardCache"):
        model(code_ids[:, :8], **kv(model, DynamicCache(config=model.config)))


def test_cache_from_a_policy(model, code_ids, alice):
    policy = load_policy(Path(__file__).resolve().parents[2] / "policies" / "offline-batch.yaml")
    cache = KVGuardCache.from_policy(model.config, alice, policy, num_pages=16)
    with torch.no_grad():
        model(code_ids[:, :40], **kv(model, cache))
    cfg = cache.manager.cfg
    assert (cfg.codec, cfg.fp_sink, cfg.fp_window, cfg.evictor, cfg.page_size) == ("int4", 4, 128, "h2o", 16)
    assert cfg.evictor_options == {"budget": 1024, "sink": 4, "window": 128, "per_head": True}
    assert cfg.dtype == torch.float32 and cache.stats().tokens_held == 40  # the model's dtype, every token
