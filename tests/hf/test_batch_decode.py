"""A decode step of a batch goes to the cache as one batch (CacheManager.append_step and
attend_step), and the padding mask is read to the host once per forward pass, not per layer
and row. A tiny random Llama in float32 keeps it fast; the 16-bit passthrough codec makes
every difference from DynamicCache kvguard's."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvguard.cache import CacheManager
from kvguard.eval.probe import ProbeCache
from kvguard.hf import CacheFullError, KVGuardCache
from kvguard.types import Subject

from .conftest import kv

PEOPLE = [Subject("acme", "alice", "s-1"), Subject("globex", "bob", "s-9")]


@pytest.fixture(scope="module")
def tiny():
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def calls(monkeypatch):
    seen = {"append_step": 0, "attend_step": 0}
    for name in seen:
        original = getattr(CacheManager, name)

        def spy(self, *a, _name=name, _original=original, **kw):
            seen[_name] += 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(CacheManager, name, spy)
    return seen


def test_left_padded_batch_decodes_as_one_step(tiny, calls):
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # row 1 is 15 tokens, left-padded
    tiny.set_attn_implementation("sdpa")
    want = tiny.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         **kv(tiny, DynamicCache(config=tiny.config)))
    tiny.set_attn_implementation("kvguard")
    cache = KVGuardCache(tiny.config, PEOPLE, num_pages=16, dtype=torch.float32)
    got = tiny.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **kv(tiny, cache))
    assert torch.equal(got, want)
    # 11 decode steps (the prompt is the 12th token's forward pass) x 2 layers, one call each
    assert calls == {"append_step": 22, "attend_step": 22}
    assert [cache.manager.length(s) for s in cache.seqs] == [24 + 11, 15 + 11]


def test_probe_reads_rows_one_at_a_time(tiny, calls):
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    tiny.set_attn_implementation("kvguard")
    probe = ProbeCache(tiny.config, PEOPLE[0], num_pages=8, dtype=torch.float32)
    tiny.generate(ids, max_new_tokens=4, do_sample=False, **kv(tiny, probe))
    assert calls == {"append_step": 0, "attend_step": 0}


def test_padding_mask_read_once_per_forward_pass(tiny):
    cache = KVGuardCache(tiny.config, PEOPLE, num_pages=8)
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    rows = cache._real_tokens(mask, 3)
    assert rows[0] is None and rows[1].tolist() == [1, 2]
    assert cache._real_tokens(mask, 3) is rows  # the next layer of the same pass
    mask[0, 0] = 0  # edited in place: read again
    again = cache._real_tokens(mask, 3)
    assert again is not rows and again[0].tolist() == [1, 2]
    assert cache._real_tokens(mask.clone(), 3) is not again  # another pass's mask


def test_a_forward_refused_for_want_of_pages_leaves_the_cache_as_it_was(tiny):
    """A CacheFullError writes nothing: the cache still counts only the tokens it holds, so the
    caller can free pages elsewhere and go on at the right positions."""
    ids = torch.randint(0, 96, (1, 45), generator=torch.Generator().manual_seed(3))
    tiny.set_attn_implementation("kvguard")
    full = KVGuardCache(tiny.config, PEOPLE[0], num_pages=2, dtype=torch.float32)  # 32 tokens
    roomy = KVGuardCache(tiny.config, PEOPLE[0], num_pages=4, dtype=torch.float32)
    with torch.no_grad():
        tiny(ids[:, :20], **kv(tiny, full))
        tiny(ids[:, :20], **kv(tiny, roomy))
        with pytest.raises(CacheFullError):
            tiny(ids[:, 20:45], **kv(tiny, full))
        assert full.get_seq_length() == 20 and [layer.seen for layer in full.layers] == [20, 20]
        got = tiny(ids[:, 20:30], **kv(tiny, full)).logits
        want = tiny(ids[:, 20:30], **kv(tiny, roomy)).logits
    torch.testing.assert_close(got, want)
