"""The engine with a pool too small for its requests at once: they queue, the youngest gives way
when a decode finds no page (its sequence freed, prompt and output prefilled again), and every
greedy output is token for token what the request gives alone. A small random Llama: fast."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvguard.cache import CacheConfig, CacheManager
from kvguard.hf import register
from kvguard.hf.cache import shape_fields
from kvguard.serve.engine import Engine
from kvguard.serve.scheduler import Request, SamplingParams
from kvguard.types import Subject

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
OUT = 24


class Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def model():
    register()
    torch.manual_seed(0)
    m = LlamaForCausalLM(CFG).eval()
    m.set_attn_implementation("kvguard")
    return m


def engine(m, pages: int) -> Engine:
    manager = CacheManager(CacheConfig(**shape_fields(CFG), num_pages=pages, page_size=8, dtype=torch.float32))
    return Engine(m, Tok(), manager, chunk=32, max_seqs=4, ignore_eos=True)


def requests() -> list[Request]:
    return [Request(str(i), Subject("t", f"u{i}", f"s{i}"), [(7 * i + 3 * j) % 96 for j in range(5 + 4 * i)],
                    SamplingParams(OUT, temperature=0)) for i in range(4)]


def drain(e: Engine) -> None:
    for _ in range(1000):
        if not e.scheduler.active:
            return
        e.step()
        assert all(n <= e.scheduler.capacity[p] for p, n in e.scheduler.reserved.items())
        assert e.manager.pools["hot"].used_count <= e.scheduler.capacity["hot"]
    raise AssertionError("the engine never finished its requests")


def test_a_small_pool_queues_and_preempts_and_greedy_outputs_stay_those_of_sequential_runs():
    m = model()
    alone = engine(m, 64)
    expected = []
    for r in requests():
        alone.submit(r)
        drain(alone)
        expected.append(r.output)
    e = engine(m, 12)  # 96 tokens; the four requests end at 4 + 5 + 5 + 6 pages
    reqs = requests()
    for r in reqs:
        e.submit(r)  # all queued: none is refused for want of pages
    drain(e)
    assert e.scheduler.preemptions >= 1
    assert [r.output for r in reqs] == expected
    assert e.manager.sequences() == [] and e.scheduler.reserved == {"hot": 0}


def test_warmup_runs_every_batch_size_then_leaves_nothing_behind():
    """Engine.warmup before start: one step at each batch size from its rows down to 1, the
    warm-up subject erased after (every page free again, one erase event for it), counters at
    zero; a request after it gives what it gives without a warm-up."""
    from kvguard.cache import events as ev
    from kvguard.serve.engine import WARMUP

    m = model()
    cold = engine(m, 64)
    r = requests()[2]
    cold.submit(r)
    drain(cold)
    e = engine(m, 64)
    sizes = []
    decode = e._decode
    e._decode = lambda rows: (sizes.append(len(rows)), decode(rows))[1]
    lens, submit = [], e.submit
    e.submit = lambda req: (lens.append(len(req.prompt)), submit(req))[1]
    seconds = e.warmup(20, rows=4)
    e._decode, e.submit = decode, submit
    assert seconds > 0 and set(sizes) == {1, 2, 3, 4}, sizes  # every batch size decoded
    # the first prompts fill their last page, the others do not: the prompt kernels' variants of both
    page = e.manager.cfg.page_size
    assert [n % page == 0 for n in lens] == [True, True, False, False] and max(lens) <= 20, (lens, page)
    assert e.manager.sequences() == [] and e.manager.pools["hot"].used_count == 0
    assert (e.steps, e.decode_steps, e.tokens_out, e.prefill_tokens, e.scheduler.peak) == (0, 0, 0, 0, 0)
    erased = [x for x in e.manager.events.take_events() if isinstance(x, ev.SubjectErased)]
    assert len(erased) == 1 and erased[0].subject == WARMUP.__class__(WARMUP.tenant, WARMUP.user, "*")
    again = requests()[2]
    e.submit(again)
    drain(e)
    assert again.output == r.output and len(again.output) == OUT
