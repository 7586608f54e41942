"""A prompt fed in chunks through a model whose cache splits K/V: once the older pages' values
are in host memory, each later chunk takes the kernel path (under Triton's interpreter here)
and gives the logits of the reference path, with the same `fetch` records."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvguard.cache import events as ev
from kvguard.hf import KVGuardCache, cache_kwarg
from kvguard.types import Subject

CFG = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def test_prompt_chunks_over_split_pages_take_the_kernels_and_match_the_reference_path(monkeypatch):
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG).to(torch.float16).eval()
    model.set_attn_implementation("kvguard")
    ids = torch.randint(0, 96, (1, 56), generator=torch.Generator().manual_seed(1))
    who = Subject("acme", "alice", "s1")
    opts = {"codec": "int8", "num_pages": 32, "page_size": 8, "kv_split": {"window": 8, "top_k": 2}}
    from kvguard.cache.split import ValueSplit

    chunks = []
    real = ValueSplit.attend_chunk
    monkeypatch.setattr(ValueSplit, "attend_chunk",
                        lambda self, seq, layer, q, scale: chunks.append(q.shape[0]) or real(self, seq, layer, q, scale))
    logits, fetched = {}, {}
    for kernels in (True, False):
        cache = KVGuardCache(CFG, who, use_kernels=kernels, **opts)
        out = []
        with torch.no_grad():
            for lo in range(0, ids.shape[1], 8):
                out.append(model(ids[:, lo:lo + 8], **{cache_kwarg(model): cache}).logits.float())
        logits[kernels] = torch.cat(out, dim=1)
        cache.manager.split.drain()
        fetched[kernels] = [(sorted(e.pages), e.bytes) for e in cache.events.take_events()
                            if isinstance(e, ev.PagesFetched)]
        if kernels:
            assert chunks and set(chunks) == {8}  # every chunk after the first pages moved: the kernel path
            chunks.clear()
    assert not chunks  # the reference cache never took it
    assert fetched[True] == fetched[False] and len(fetched[True]) >= 4  # one per chunk that read split pages
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=3e-2)
