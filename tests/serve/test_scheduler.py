"""The scheduler alone, over page counts (no model): a bounded queue, admission as pages free,
preemption of the youngest when a decode finds no page, prompt chunks within the token budget."""

from __future__ import annotations

import math
import random

import pytest

from kvguard.serve.scheduler import PoolFull, Request, SamplingParams, Scheduler, Status
from kvguard.types import Subject

PAGE = 16


def need(tokens: int) -> dict[str, int]:
    return {"hot": math.ceil(tokens / PAGE)}


def req(i: int, prompt: int, out: int) -> Request:
    return Request(str(i), Subject("t", "u", f"s{i}"), list(range(prompt)), SamplingParams(out, temperature=0))


def step(s: Scheduler, shared: int = 0) -> None:
    """One engine step without a model: open (sharing `shared` tokens), free the preempted, feed
    the chunks and the decodes, each token sampled being the count of tokens before it."""
    for r in s.to_open():
        r.seq, r.fed = f"seq-{r.id}-{r.preemptions}", min(shared, len(r.prompt) - 1)
        s.opened(r)
    plan = s.schedule()
    assert all(r.seq is not None for r, _ in plan.prefill) and all(r.status is Status.RUNNING for r in plan.decode)
    assert not {r for r, _ in plan.prefill} & set(plan.decode) and not set(plan.preempted) & set(plan.decode)
    for r in plan.preempted:
        assert r.fed == 0 and r.pages == {} and s.waiting[0] is plan.preempted[-1]
        r.seq = None
    for r, n in plan.prefill:
        assert n >= 1 and r.fed + n <= r.target
        r.fed += n
        if r.fed == r.target:
            s.started(r)
            sample(s, r)
    for r in plan.decode:
        if not r.finished:
            r.fed += 1
            sample(s, r)
    for r in s.active:  # what each holds is within what it reserved, and all of it within the pool
        if r.seq is not None:
            assert need(r.fed)["hot"] <= r.pages.get("hot", 0)
    assert s.reserved["hot"] == sum(r.pages.get("hot", 0) for r in s.active) <= s.capacity["hot"]


def sample(s: Scheduler, r: Request) -> None:
    r.output.append(r.fed)
    if len(r.output) >= r.params.max_tokens:
        s.release(r)


def test_the_queue_is_bounded_and_a_running_request_is_not_in_it():
    s = Scheduler({"hot": 100}, max_seqs=2, need=need, chunk=64, max_waiting=2)
    a, b, c = req(1, 10, 5), req(2, 10, 5), req(3, 10, 5)
    s.add(a)
    s.add(b)
    with pytest.raises(PoolFull, match="wait"):
        s.add(c)
    step(s)  # both prefill in one chunk and leave the queue
    assert [r.status for r in (a, b)] == [Status.RUNNING] * 2 and not s.waiting
    s.add(c)  # queued: two rows run already, the most at once
    step(s)
    assert c.seq is None and c.status is Status.WAITING and len(a.output) == 2


def test_a_request_waits_for_pages_and_runs_when_they_free():
    s = Scheduler({"hot": 4}, max_seqs=8, need=need, chunk=256)
    a, b = req(1, 40, 8), req(2, 40, 8)  # 3 pages each: both cannot hold their prompt at once
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is Status.RUNNING and b.status is Status.WAITING and b.fed == 0
    while not a.finished:
        step(s)
        assert b.fed == 0 and b.pages.get("hot", 0) == 0  # opened, holding nothing: no page for its prompt
    step(s)
    assert b.status is Status.RUNNING  # it prefilled at the first step after a's pages were freed
    while not b.finished:
        step(s)
    assert a.output == list(range(40, 48)) and b.output == list(range(40, 48)) and s.reserved == {"hot": 0}


def test_the_youngest_gives_way_and_recomputes_prompt_and_output():
    s = Scheduler({"hot": 6}, max_seqs=8, need=need, chunk=256)
    a, b = req(1, 30, 40), req(2, 30, 40)  # 2 pages each to start, 5 each at the end
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is b.status is Status.RUNNING
    while b.preemptions == 0:
        step(s)
    assert a.status is Status.RUNNING and b.status is Status.WAITING and s.waiting[0] is b
    assert s.preemptions == 1 and b.seq is None and len(b.output) >= 3
    while not (a.finished and b.finished):
        step(s)
    # b prefilled its prompt and its output again: the tokens it sampled are where they were
    assert a.output == list(range(30, 70)) and b.output == list(range(30, 70))


def test_prompt_chunks_fill_the_token_budget_oldest_first():
    s = Scheduler({"hot": 1000}, max_seqs=8, need=need, chunk=64)
    reqs = [req(i, 50, 2) for i in range(3)]
    for r in reqs:
        s.add(r)
    for r in s.to_open():
        r.seq = r.id
        s.opened(r)
    plan = s.schedule()
    assert [(r.id, n) for r, n in plan.prefill] == [("0", 50), ("1", 14)]  # request 2 is not opened yet
    assert reqs[2].seq is None and s.peak == 2


@pytest.mark.parametrize("seed", range(6))
def test_random_loads_finish_within_the_pool(seed):
    rnd = random.Random(seed)
    s = Scheduler({"hot": rnd.randint(12, 40)}, max_seqs=rnd.randint(1, 6), need=need,
                  chunk=rnd.choice([16, 64, 256]), max_waiting=100)
    reqs = []
    for i in range(30):
        r = req(i, rnd.randint(1, 120), rnd.randint(1, 60))
        if need(r.target + r.params.max_tokens)["hot"] <= s.capacity["hot"]:  # the engine refuses the others
            reqs.append(r)
    for _ in range(10_000):
        if reqs and rnd.random() < 0.3:
            s.add(reqs.pop())
        if not s.active and not reqs:
            break
        step(s, shared=rnd.choice([0, 16]))
    else:
        raise AssertionError("the load never finished")
    assert s.reserved == {"hot": 0} and not s.running and not s.waiting


def test_a_step_ahead_reserves_for_every_row_or_none_and_waits_for_requests_that_could_start():
    s = Scheduler({"hot": 6}, max_seqs=3, need=need, chunk=64)
    a, b = req(1, 32, 64), req(2, 32, 64)
    for r in (a, b):  # both running with 32 tokens in 2 pages each
        s.add(r)
        r.seq, r.fed = f"seq-{r.id}", 32
        s.opened(r)
        s.started(r)
    assert s.reserved["hot"] == 4
    assert s.extend([a, b]) and s.reserved["hot"] == 6 and a.pages == b.pages == {"hot": 3}  # token 33: a page each
    a.fed = b.fed = 48
    assert not s.extend([a, b]) and s.reserved["hot"] == 6 and a.pages == {"hot": 3}  # no room for both: for none
    s.capacity["hot"] = 10
    c = req(3, 40, 4)
    s.add(c)  # waits, and could open its sequence now (a row is free): admissions first
    assert not s.extend([a, b])
    c.seq, c.fed = "seq-3", 0
    s.opened(c)  # opened; its prompt's 3 pages fit: its prompt first
    assert not s.extend([a, b])
    s.capacity["hot"] = 8  # now it cannot start before pages free: the step runs ahead...
    assert s.extend([a, b]) and s.reserved["hot"] == 8
    assert s.extend([a, b])  # (the pages are held: nothing more to reserve)
    assert not s.extend([a, b], ending=True)  # ...but not when this step ends a row, whose place it may take
