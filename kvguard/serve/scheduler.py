"""Requests and the scheduler: who waits, who runs this step, and the pages they hold.

A request enters a bounded waiting queue (past its bound: `PoolFull`, a 429 with Retry-After).
Each step the scheduler, alone, decides what runs, over page counts only (no tensors, no model):

1. open: the oldest waiting requests get a sequence (the engine opens it, sharing cached prompt
   pages) while their prompts fit the step's token budget and the rows `max_seqs`;
2. decode: every running request reserves the pages of one more token; when a pool runs out,
   the youngest request holding pages gives way (preemption by recompute: its sequence is freed
   and it goes back to the front of the queue, to prefill its prompt and its output again);
3. prompt chunks: opened waiting requests, oldest first, get their next tokens within the
   budget (`chunk` tokens a step) and the pages left; a prompt never preempts anyone.

A request reserves what `pages_needed` says its tokens so far can take at most in each pool
(worst case, before eviction; shared prefix pages counted by each sharer), so the pool never
runs out mid-step, and a request that fits the pool alone always runs in the end.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import CacheConfig
from ..compress.evictors import EVICTORS
from ..errors import InputError
from ..types import SeqId, Subject


class PoolFull(Exception):
    """No room for one more request now (the waiting queue is full): the client should retry later."""


GREEDY_BELOW = 1e-5  # a temperature under this is greedy: dividing logits by it overflows them


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError("temperature must be a finite number of 0 or more")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InputError("top_p must be a number over 0 and at most 1")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or prefilling its prompt (again, after a preemption)
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    id: str
    subject: Subject
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    seq: SeqId | None = None  # open while it holds pages; None while queued
    cached: int = 0  # prompt tokens found in the prefix cache at its first opening, not prefilled
    fed: int = 0  # tokens written to the cache (prompt and output)
    output: list[int] = field(default_factory=list)
    text: str = ""  # the output's text sent so far
    pages: dict[str, int] = field(default_factory=dict)  # reserved per pool
    generator: torch.Generator | None = None
    cancel: str | None = None  # why the engine must stop it at its next step
    request_id: str | None = None  # the HTTP request's id, named in the log lines about it
    status: Status = Status.WAITING
    arrival: int = 0  # admission order: the youngest (highest) gives way first
    preemptions: int = 0
    detok: object | None = None  # the engine's incremental detokenizer state

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def target(self) -> int:
        """Tokens to prefill before it decodes: its prompt, and after a preemption its output too
        (the last output token's logits give the next one, as its decode step would have)."""
        return len(self.prompt) + len(self.output)

    def tokens(self, a: int, b: int) -> list[int]:
        """Its tokens a..b-1 of prompt + output."""
        n = len(self.prompt)
        return self.prompt[a:b] if b <= n else [*self.prompt[a:b], *self.output[max(0, a - n): b - n]]


def pages_needed(cfg: CacheConfig, quantized: bool, tokens: int, chunk: int = 0) -> dict[str, int]:
    """The pages a sequence of `tokens` tokens can take in each pool at most: all in the 16-bit
    pool without a codec; with one, all in the codec's pool and in the 16-bit pool its sinks,
    its window, the page being filled and the page waiting to be quantized.

    With the K/V split, pages older than its window move to the split's pool between steps, so
    the codec's pool (the 16-bit one without a codec) holds at most the window, one prompt
    chunk (`chunk` tokens, written before the next step moves them) and two partly filled
    pages; twice that where prompt pages are shared, since a page shared with another request
    while still in the codec's pool stays there until one of them ends. The split's pool may
    take every page. Not with an evictor that regroups tokens from every page (H2O, SnapKV):
    its compaction brings split pages home, so they reserve as without the split (the split
    moves pages while its pool has room, and leaves the others in the codec's)."""
    ps = cfg.page_size
    n = math.ceil(tokens / ps)
    home = "main" if quantized else "hot"
    need = {"hot": n} if not quantized else {
        "hot": min(n, math.ceil(cfg.fp_sink / ps) + math.ceil(cfg.fp_window / ps) + 2), "main": n}
    if cfg.kv_split is not None and not (cfg.evictor and EVICTORS[cfg.evictor].needs_mass):
        resident = (math.ceil(cfg.kv_split.window / ps) + math.ceil(chunk / ps) + 2) * (2 if cfg.prefix_sharing else 1)
        if quantized:
            need[home] = min(n, resident)
        else:  # the 16-bit pool is the split's home: its sinks stay there as well
            need[home] = min(n, resident + math.ceil(cfg.fp_sink / ps))
        need["split"] = n
    return need


@dataclass
class Plan:
    """What one step runs: prompt chunks (a request and its token count), the decodes, and the
    requests that gave way (their sequences to free before the forward pass)."""
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """The waiting and running requests and the pages they reserve. need(tokens) says what a
    sequence of that many tokens reserves per pool (`pages_needed` bound to the cache)."""

    def __init__(self, capacity: dict[str, int], max_seqs: int, *, need: Callable[[int], dict[str, int]],
                 chunk: int = 256, max_waiting: int | None = None):
        self.capacity = capacity
        self.max_seqs = max_seqs
        self.max_waiting = 3 * max_seqs if max_waiting is None else max_waiting
        self.need, self.chunk = need, chunk
        self.reserved = {pool: 0 for pool in capacity}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Lock()
        self.peak = 0  # the most requests running or prefilling at once
        self.preemptions = 0
        self._arrivals = itertools.count(1)

    # --- the handlers' side -------------------------------------------------------------------

    def fits_ever(self, pages: dict[str, int]) -> bool:
        return all(n <= self.capacity[pool] for pool, n in pages.items())

    def add(self, req: Request) -> None:
        """Queue a request, or PoolFull when the queue holds `max_waiting` already."""
        with self.lock:
            if len(self.waiting) >= self.max_waiting:
                raise PoolFull(f"{len(self.waiting)} requests wait for a place, the most this server queues")
            req.arrival = next(self._arrivals)
            req.status = Status.WAITING
            self.waiting.append(req)

    @property
    def active(self) -> list[Request]:
        with self.lock:
            return [*self.waiting, *self.running]

    # --- the engine's side, under the manager's lock, between steps ---------------------------

    def to_open(self) -> list[Request]:
        """The waiting requests to open a sequence for now: the oldest, while the prompts of the
        opened ones fit one step's budget and the rows `max_seqs`."""
        with self.lock:
            rows = len(self.running) + sum(r.seq is not None for r in self.waiting)
            ahead = sum(r.target - r.fed for r in self.waiting if r.seq is not None)
            out = []
            for r in self.waiting:
                if r.seq is not None:
                    continue
                if rows >= self.max_seqs or ahead >= self.chunk:
                    break
                out.append(r)
                rows += 1
                ahead += r.target
            return out

    def opened(self, req: Request) -> None:
        """Its sequence is open with `fed` tokens (shared prompt pages): it holds them now."""
        with self.lock:
            self._reserve(req, self.need(req.fed), force=True)

    def schedule(self) -> Plan:
        plan = Plan()
        with self.lock:
            # 1. decodes, oldest first; the youngest holder of pages gives way when one runs out
            for r in sorted(self.running, key=lambda r: r.arrival):
                while r.status is Status.RUNNING and not self._reserve(r, self.need(r.fed + 1)):
                    holders = [x for x in [*self.running, *self.waiting] if any(x.pages.values())]
                    victim = max(holders, key=lambda x: x.arrival, default=r)
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim in plan.decode:
                        plan.decode.remove(victim)
                if r.status is Status.RUNNING:
                    plan.decode.append(r)
            # 2. prompt chunks of the opened waiting requests, oldest first, within the budget
            budget, rows = self.chunk, len(plan.decode)
            for r in self.waiting:
                if r.seq is None or r in plan.preempted:
                    continue
                if budget < 1 or rows >= self.max_seqs:
                    break
                n = min(r.target - r.fed, budget)
                if not self._reserve(r, self.need(r.fed + n)):
                    break  # no pages for it now: the requests behind it wait too (first come, first served)
                plan.prefill.append((r, n))
                budget -= n
                rows += 1
            self.peak = max(self.peak, rows)
        return plan

    def extend(self, reqs: list[Request], ending: bool = False) -> bool:
        """Reserve the pages of one more token for each running request, all or none (the engine
        queues a decode step before the last one's tokens are read), unless a waiting request
        could start now, or could once the requests this step ends (`ending`) free their place:
        admissions and prompts come first."""
        with self.lock:
            if self.waiting and (ending or self._could_start(self.waiting[0])):
                return False
            wants = [(r, self.need(r.fed + 1)) for r in reqs]
            grow = dict.fromkeys(self.capacity, 0)
            for r, want in wants:
                for pool, n in _growth(r, want).items():
                    grow[pool] += n
            if not self._fits(grow):
                return False
            for r, want in wants:
                self._reserve(r, want, force=True)
            return True

    def _could_start(self, req: Request) -> bool:
        """Whether the first waiting request could open its sequence, or prefill its next chunk,
        at the next step (the requests behind it wait for it)."""
        if req.seq is None:
            return len(self.running) + sum(r.seq is not None for r in self.waiting) < self.max_seqs
        return self._fits(_growth(req, self.need(req.fed + min(req.target - req.fed, self.chunk))))

    def started(self, req: Request) -> None:
        """Its prompt is in the cache: it decodes from the next step."""
        with self.lock:
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)

    def preempt(self, req: Request) -> None:
        """Make a request give way now (the engine found no page for it): to the front of the queue."""
        with self.lock:
            if req.status is not Status.FINISHED:
                self._preempt(req)

    def release(self, req: Request) -> None:
        """A finished request: its pages and its place."""
        with self.lock:
            self._unreserve(req)
            req.status = Status.FINISHED
            if req in self.running:
                self.running.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)

    # --- page counts --------------------------------------------------------------------------

    def _reserve(self, req: Request, want: dict[str, int], *, force: bool = False) -> bool:
        """Grow the request's reservation to `want` per pool, or change nothing and say False."""
        grow = _growth(req, want)
        if not force and not self._fits(grow):
            return False
        for pool, n in grow.items():
            self.reserved[pool] += n
            req.pages[pool] = req.pages.get(pool, 0) + n
        return True

    def _fits(self, grow: dict[str, int]) -> bool:
        return all(self.reserved[pool] + n <= self.capacity[pool] for pool, n in grow.items())

    def _unreserve(self, req: Request) -> None:
        for pool, n in req.pages.items():
            self.reserved[pool] -= n
        req.pages = {}

    def _preempt(self, req: Request) -> None:
        """Release its pages and queue it first, to recompute what it held (the engine frees its
        sequence before the step's forward pass)."""
        self._unreserve(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.WAITING
        req.fed = 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)


def _growth(req: Request, want: dict[str, int]) -> dict[str, int]:
    """The pages per pool a request's reservation grows by to reach `want`."""
    return {pool: max(0, n - req.pages.get(pool, 0)) for pool, n in want.items()}
