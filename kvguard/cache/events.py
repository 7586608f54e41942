"""Frozen events the cache emits for every operation that changes what it holds.

The cache appends them to an `EventQueue`; a consumer (kvguard.client's SidecarClient) drains
it with `take_events()` and turns each into one signed audit record. Events carry
the raw `Subject` because they never leave the serving process except to the
sidecar, which pseudonymizes at ingest; they hold no K/V values or token ids.
Their ops are names of the audit format's registry (kvguard.audit.ops, a module
that imports nothing), so the sidecar records every one.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import kvguard.audit.ops as ops

from ..types import SeqId, Subject


@dataclass(frozen=True, slots=True)
class CacheEvent:
    op: ClassVar[str]
    seq: SeqId | None
    subject: Subject
    pages: tuple[str, ...]  # "<pool>:<page>"
    n_tokens: int  # tokens the operation touched ("tokens" alone would read as content)
    bytes: int

    def details(self) -> dict:
        """Non-identifying details of the event, fit for an audit record."""
        d = asdict(self)
        d.pop("subject")
        d["pages"] = list(self.pages)
        return d


@dataclass(frozen=True, slots=True)
class SequenceOpened(CacheEvent):
    """A sequence opened for a subject under a policy (a served request began): `pages` are the
    prompt pages it shares from its tenant's prefix cache, `n_tokens` the tokens they hold.
    The cache's `open` emits none; a serving process that wants its requests' starts in the log
    (kvguard.serve) emits it."""

    op = ops.OPEN
    policy: str = ""


@dataclass(frozen=True, slots=True)
class BlocksStored(CacheEvent):
    """Blocks of an engine that keeps its own pool (vLLM) allocated to a request, which writes its
    K/V into them: `pages` the blocks, `n_tokens` the slots they hold. kvguard's own cache says
    this with `open` and `quantize`; vLLM's pool is watched block by block (kvguard.vllm)."""

    op = ops.STORE


@dataclass(frozen=True, slots=True)
class PagesQuantized(CacheEvent):
    """Full 16-bit pages re-encoded into the codec (bytes: after; bytes_before: before). With
    `fields` (["k"]) only that part of each page was: a K/V split's keys encoded again in its
    smaller codec as their pages moved in (`pages` the split's pages)."""

    op = ops.QUANTIZE
    codec: str = ""
    bytes_before: int = 0
    fields: tuple[str, ...] = ()

    def details(self) -> dict:
        return _with_fields(self)


@dataclass(frozen=True, slots=True)
class TokensEvicted(CacheEvent):
    """One compaction: `n_tokens` evicted, `pages` freed (overwritten; `bytes` theirs, pages
    other sequences still share are not freed), `kept` tokens left. The survivors written into
    codec pages are reported by a `PagesQuantized` just before. A sliding-window layer's pages
    that fell out of its window (window.py) are an eviction with no evictor and `reason` "window"."""

    op = ops.EVICT
    evictor: str = ""
    kept: int = 0
    reason: str = ""  # why, when no evictor chose: "window" (a sliding-window layer's pages it is past)

    def details(self) -> dict:
        d = CacheEvent.details(self)
        if not self.reason:  # the records of an evictor's compactions stay as they were
            d.pop("reason")
        return d


@dataclass(frozen=True, slots=True)
class PagesOffloaded(CacheEvent):
    """Device pages moved to a lower tier (bytes: the device pages', as `fetch` counts them;
    stored_bytes: what the tier holds for them, sealed and serialized)."""

    op = ops.OFFLOAD
    src: str = ""
    dst: str = ""
    stored_bytes: int = 0
    fields: tuple[str, ...] = ()  # the part of the pages moved ("v": their values, "k" too with host keys); empty: whole

    def details(self) -> dict:
        return _with_fields(self)


@dataclass(frozen=True, slots=True)
class PagesFetched(CacheEvent):
    """Pages brought back to the device (`fields`: as PagesOffloaded's). A K/V split read's
    fetch of cold values, for attention only, is one event per step of a sequence across all
    layers: `pages` each page read in any layer, `bytes` the value bytes moved in all of them."""

    op = ops.FETCH
    src: str = ""
    dst: str = ""
    fields: tuple[str, ...] = ()

    def details(self) -> dict:
        return _with_fields(self)


def _with_fields(event: PagesQuantized | PagesOffloaded | PagesFetched) -> dict:
    """An event's details: `fields` only when it touched part of each page, so the records of
    whole-page operations stay as they were."""
    d = CacheEvent.details(event)
    if event.fields:
        d["fields"] = list(event.fields)
    else:
        d.pop("fields")
    return d


@dataclass(frozen=True, slots=True)
class SequenceFreed(CacheEvent):
    """A sequence ended; its unshared pages were overwritten and returned to the pool, and
    its lower-tier copies erased (`tier_copies`)."""

    op = ops.FREE
    tier_copies: int = 0


@dataclass(frozen=True, slots=True)
class SubjectErased(CacheEvent):
    """An erasure of a user or a session: every sequence, page and tier copy of it."""

    op = ops.ERASE
    scope: str = ""  # "user" or "session"
    sequences: int = 0
    shared_pages: int = 0  # pages kept for other owners, the subject removed from them
    tier_copies: int = 0
    prefix_entries: int = 0


@dataclass
class EventQueue:
    """A thread-safe queue of events; `take_events` drains it in order."""

    _items: deque = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: CacheEvent) -> None:
        with self._lock:
            self._items.append(event)

    def take_events(self) -> list[CacheEvent]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)
