"""Requests and the scheduler: who waits for prefill, who decodes, and the pages they reserve.

A request reserves, when admitted, the pages its prompt and all its `max_tokens` can take in
each pool (worst case, before eviction; with the K/V split, the pages older than its window in
the split's pool), so a running request never runs out of pages mid-stream; one that does not
fit is refused at once (429) and the others run on.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache import CacheConfig
from ..compress.evictors import EVICTORS
from ..errors import InputError
from ..types import SeqId, Subject


class PoolFull(Exception):
    """No room for one more request now: the client should retry later."""


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


@dataclass(eq=False)
class Request:
    id: str
    subject: Subject
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    seq: SeqId | None = None
    cached: int = 0  # prompt tokens found in the prefix cache, not prefilled
    fed: int = 0  # tokens written to the cache (prompt and output)
    output: list[int] = field(default_factory=list)
    text: str = ""  # the output's text sent so far
    pages: dict[str, int] = field(default_factory=dict)  # reserved per pool
    generator: torch.Generator | None = None
    cancel: str | None = None  # why the engine must stop it at its next step
    request_id: str | None = None  # the HTTP request's id, named in the log lines about it
    finished: bool = False

    def emit(self, item: tuple) -> None:
        """Hand an item to the request's handler, from the engine's thread."""
        if self.loop is not None and self.queue is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


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


class Scheduler:
    """The waiting (to prefill) and running (decoding) requests and what they reserve."""

    def __init__(self, capacity: dict[str, int], max_seqs: int):
        self.capacity = capacity
        self.max_seqs = max_seqs
        self.reserved = {pool: 0 for pool in capacity}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Lock()
        self.peak = 0

    def admit(self, req: Request, pages: dict[str, int]) -> None:
        """Reserve the request's pages or raise PoolFull; the caller then adds it."""
        with self.lock:
            if len(self.waiting) + len(self.running) >= self.max_seqs:
                raise PoolFull(f"{self.max_seqs} requests are running, the most this server takes at once")
            for pool, n in pages.items():
                if self.reserved[pool] + n > self.capacity[pool]:
                    raise PoolFull("the KV page pool is full")
            for pool, n in pages.items():
                self.reserved[pool] += n
            req.pages = pages

    def add(self, req: Request) -> None:
        with self.lock:
            self.waiting.append(req)
            self.peak = max(self.peak, len(self.waiting) + len(self.running))

    def release(self, req: Request) -> None:
        with self.lock:
            for pool, n in req.pages.items():
                self.reserved[pool] -= n
            req.pages = {}
            if req in self.running:
                self.running.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)

    def fits_ever(self, pages: dict[str, int]) -> bool:
        return all(n <= self.capacity[pool] for pool, n in pages.items())

    @property
    def active(self) -> list[Request]:
        with self.lock:
            return [*self.waiting, *self.running]
