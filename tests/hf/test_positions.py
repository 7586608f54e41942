"""RoPE positions after eviction: a decode step over a compacted cache must equal
full attention restricted to the kept positions, at their original positions."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvguard.hf import KVGuardCache

from .conftest import attn, kv

P, BUDGET, SINK = 150, 64, 4


def test_decode_after_eviction_keeps_original_positions(model, code_ids, alice):
    ids = code_ids[:, : P + 1]
    cache = KVGuardCache(model.config, alice, evictor="streamingllm",
                         evictor_options={"budget": BUDGET, "sink": SINK, "window": BUDGET - SINK},
                         num_pages=32)
    with torch.no_grad():
        model(ids[:, :P], **kv(model, cache))
        got = model(ids[:, P:], **kv(model, cache)).logits[0, -1]
    assert [e.op for e in cache.events.take_events()] == ["evict"]
    assert cache.stats().tokens_held == BUDGET + 1
    assert cache.get_seq_length() == P + 1

    # Oracle: the full sequence, the last query masked to the sinks and the recent window.
    kept = list(range(SINK)) + list(range(P - (BUDGET - SINK), P + 1))
    mask = torch.full((1, 1, P + 1, P + 1), float("-inf")).triu(1)
    mask[0, 0, P] = float("-inf")
    mask[0, 0, P, kept] = 0.0
    with attn(model, "sdpa"), torch.no_grad():
        want = model(ids, attention_mask=mask, **kv(model, DynamicCache(config=model.config))).logits[0, -1]
        # What renumbering the kept tokens 0..BUDGET would give instead.
        wrong = model(ids[:, kept], **kv(model, DynamicCache(config=model.config))).logits[0, -1]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert (got - wrong).abs().max() > 0.1
