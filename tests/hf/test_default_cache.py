"""A generate call that passes no cache (a text-generation pipeline's) gets a fresh
KVGuardCache from `use_default_cache`, for the subject configured there, and its rows are
freed when the call returns, or fails. A tiny random Llama in float32 keeps it fast; the
pipeline runs on SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, pipeline

from kvguard.cache import CacheConfig, CacheManager, EventQueue
from kvguard.errors import ConfigError, InputError
from kvguard.hf import DEFAULT_SUBJECT, CacheFullError, KVGuardCache, use_default_cache
from kvguard.hf.cache import shape_fields
from kvguard.types import Subject

from .conftest import kv

ALICE = Subject("acme", "alice", "s-1")


def tiny_model():
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("kvguard")
    return model


@pytest.fixture
def tiny():
    return tiny_model()  # a model of its own: use_default_cache changes it


@pytest.fixture
def ids():
    return torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))


def shared_manager(model, num_pages: int = 16) -> CacheManager:
    return CacheManager(CacheConfig(**shape_fields(model.config), num_pages=num_pages, dtype=torch.float32))


def test_without_a_default_generate_names_both_ways_to_pass_a_cache(tiny, ids):
    with pytest.raises(ConfigError, match=r"pass cache=KVGuardCache.*use_default_cache"):
        tiny.generate(ids, max_new_tokens=2, do_sample=False)


def test_each_call_gets_a_fresh_cache_whose_rows_are_freed(tiny, ids):
    want = tiny.generate(ids, max_new_tokens=6, do_sample=False,
                         **kv(tiny, KVGuardCache(tiny.config, ALICE, num_pages=16, dtype=torch.float32)))
    manager = shared_manager(tiny)
    default = use_default_cache(tiny, ALICE, manager=manager)
    assert tiny.kvguard_default_cache is default and default.subject == ALICE
    for none in ({}, kv(tiny, None)):  # no cache, or None for it
        assert torch.equal(tiny.generate(ids, max_new_tokens=6, do_sample=False, **none), want)
        assert manager.sequences() == [] and sum(manager.stats().pages_used.values()) == 0
        freed = [e for e in manager.events.take_events() if e.op == "free"]
        assert len(freed) == 2 and all(e.subject == ALICE for e in freed)  # one per row, this call's


def test_the_default_subject_and_options(tiny, ids):
    events = EventQueue()
    use_default_cache(tiny, events=events, codec="int8", fp_sink=4, num_pages=16, dtype=torch.float32)
    tiny.generate(ids, max_new_tokens=14, do_sample=False)  # 20 + 13 tokens fed: pages fill
    got = events.take_events()
    assert {e.op for e in got} == {"quantize", "free"}
    assert {e.subject for e in got} == {DEFAULT_SUBJECT} and DEFAULT_SUBJECT != ALICE


def test_a_cache_the_call_passes_is_used_and_kept(tiny, ids):
    manager = shared_manager(tiny)
    use_default_cache(tiny, manager=manager)
    mine = KVGuardCache(tiny.config, ALICE, num_pages=16, dtype=torch.float32)
    tiny.generate(ids, max_new_tokens=3, do_sample=False, **kv(tiny, mine))
    assert manager.events.take_events() == [] and len(mine.manager.sequences()) == 2
    tiny.set_attn_implementation("sdpa")  # another attention: transformers' own cache, untouched
    tiny.generate(ids, max_new_tokens=3, do_sample=False)
    assert manager.events.take_events() == []


def test_a_call_that_fails_frees_its_rows(tiny, ids):
    manager = shared_manager(tiny, num_pages=2)  # 32 tokens: not enough for 2 rows of 20
    use_default_cache(tiny, ALICE, manager=manager)
    with pytest.raises(CacheFullError):
        tiny.generate(ids, max_new_tokens=3, do_sample=False)
    assert manager.sequences() == []
    assert [e.op for e in manager.events.take_events()] == ["free", "free"]


def test_use_default_cache_refuses_bad_settings(tiny):
    with pytest.raises(InputError, match="Subject"):
        use_default_cache(tiny, "alice")
    with pytest.raises(ConfigError, match="shape"):
        use_default_cache(tiny, manager=CacheManager(CacheConfig(num_layers=3, num_kv_heads=2, head_dim=16)))
    assert "generate" not in vars(tiny)  # nothing installed


@pytest.mark.slow
def test_text_generation_pipeline_without_a_cache(model, tok):
    events = EventQueue()
    before = model.kvguard_default_cache
    use_default_cache(model, events=events)
    try:
        generate = pipeline("text-generation", model=model, tokenizer=tok)
        texts = [generate("def add(a, b):", max_new_tokens=4, do_sample=False)[0]["generated_text"]
                 for _ in range(2)]
    finally:
        use_default_cache(model, before.subject, manager=before.manager, events=before.events,
                          **before.options)
    enc = tok("def add(a, b):", return_tensors="pt")
    with KVGuardCache(model.config, ALICE) as cache:
        want = tok.decode(model.generate(**enc, max_new_tokens=4, do_sample=False, **kv(model, cache))[0],
                          skip_special_tokens=True)
    assert texts == [want, want]
    got = events.take_events()
    assert [e.op for e in got] == ["free", "free"]  # one row a call, each freed
    assert {e.subject for e in got} == {DEFAULT_SUBJECT}
