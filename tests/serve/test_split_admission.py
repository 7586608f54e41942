"""The serving engine admits what the K/V split can hold: a request reserves in the codec's pool
only what stays there (the split's window, a prompt chunk, two partial pages) and the rest in the
split's pool, and runs to the end within that."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvguard.cache import CacheConfig, CacheManager
from kvguard.errors import InputError
from kvguard.hf import register
from kvguard.hf.cache import shape_fields
from kvguard.serve.engine import Engine
from kvguard.serve.scheduler import Request, SamplingParams, pages_needed
from kvguard.types import Subject

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


class Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def manager(**extra) -> CacheManager:
    opts = dict(codec="int8", num_pages=12, num_hot_pages=32, page_size=8, fp_window=8, prefix_sharing=False,
                kv_split={"window": 16, "top_k": 4, "capacity": 40}) | extra
    return CacheManager(CacheConfig(**shape_fields(CFG), dtype=torch.float32, **opts))


def test_a_request_longer_than_the_codec_pool_runs_through_the_split():
    register()
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG).eval()
    model.set_attn_implementation("kvguard")
    m = manager()
    e = Engine(model, Tok(), m, chunk=16, max_seqs=2, ignore_eos=True, use_graphs=False)
    assert e.pages_needed(160) == {"hot": 3, "main": 6, "split": 20}  # 20 pages; 12 in the codec's pool
    req = Request("a", Subject("t", "u", "s"), [(5 * j) % 96 for j in range(150)],
                  SamplingParams(max_tokens=10, temperature=0))
    e.submit(req)  # refused before: 20 pages > the codec pool's 12
    peak = 0
    while e.scheduler.active:
        e.step()
        peak = max(peak, m.pools["main"].used_count)
        if req.seq is not None and req.seq in m.sequences():
            assert m.pools["split"].used_count <= 20
    assert len(req.output) == 10 and peak <= 6  # within what it reserved there
    assert m.sequences() == [] and m.pools["split"].used_count == 0
    with pytest.raises(InputError, match="more KV pages"):
        e.check_length(40 * 8 + 1, 1)  # beyond the split's 40 pages


def test_what_a_request_reserves_with_and_without_the_split():
    plain = manager(kv_split=None).cfg
    split = manager().cfg
    assert pages_needed(plain, True, 160, 16) == {"hot": 3, "main": 20}
    assert pages_needed(split, True, 160, 16) == {"hot": 3, "main": 6, "split": 20}
    assert pages_needed(split, True, 24, 16) == {"hot": 3, "main": 3, "split": 3}  # never more than its pages
    shared = manager(prefix_sharing=True).cfg  # a page shared while in the codec's pool stays there
    assert pages_needed(shared, True, 160, 16)["main"] == 12
    h2o = manager(evictor="h2o", evictor_options={"budget": 64, "sink": 4, "window": 16}).cfg
    # its compaction brings split pages home: all reserved in the codec's pool, as without the split
    # (a split pool with no room left leaves pages there)
    assert pages_needed(h2o, True, 160, 16) == {"hot": 3, "main": 20}
    fp16 = manager(codec="fp16").cfg  # the 16-bit pool is the split's home
    assert pages_needed(fp16, False, 160, 16) == {"hot": 6, "split": 20}
