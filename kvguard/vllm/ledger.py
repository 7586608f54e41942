"""Which subject's data each vLLM KV block holds, and the events that say so.

vLLM owns its blocks; kvguard only watches them. The connector feeds this ledger what the
scheduler did each step (requests admitted with their prefix hits, blocks allocated,
requests finished, block hashes dropped) and the ledger answers with audit events and with
the blocks that must be overwritten before anything else is written into them:

- a block allocated to a request that still held other subjects' data (vLLM evicted it from
  its prefix cache to reuse it): an `evict` event for each earlier owner, the block with its
  earlier owners in `reused` (the connector may copy it to kvguard's host tier first), and
  it is overwritten before the new owner's forward pass;
- a finished request's blocks that vLLM keeps in no prefix cache (no hash): `free`, and they
  are overwritten;
- an erasure: the subject's blocks that no one else shares leave the prefix cache and are
  overwritten; blocks another subject's request also holds are kept for it.

Pure Python over block ids: no vLLM import, so it is tested without an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..cache import events as ev
from ..types import Subject

POOL = "vllm"  # pages are named "vllm:<block id>" in records


def pages(block_ids: Iterable[int]) -> tuple[str, ...]:
    return tuple(f"{POOL}:{b}" for b in block_ids)


def erased(scope: str, tenant: str, target: str) -> Callable[[Subject], bool]:
    """Whether a subject is one an erasure of `target` (a user or a session of the tenant) covers."""
    def match(s: Subject) -> bool:
        return s.tenant == tenant and (s.user if scope == "user" else s.session) == target

    return match


@dataclass
class Running:
    subject: Subject
    blocks: list[int] = field(default_factory=list)


@dataclass
class Erasure:
    """What one erasure did in this engine (its acknowledgement's counts)."""

    subject: Subject
    scope: str
    overwritten: list[int]  # blocks overwritten (left the prefix cache first, where cached)
    evicted: int  # of those, blocks that had a prefix-cache entry
    shared: int  # blocks kept for other owners, the subject removed from them
    copies: list[int] = field(default_factory=list)  # host-tier slots emptied (the connector's offload)


class BlockLedger:
    def __init__(self, block_size: int, block_bytes: int) -> None:
        self.block_size, self.block_bytes = block_size, block_bytes
        self.owners: dict[int, set[Subject]] = {}  # block -> subjects whose tokens it holds
        self.running: dict[str, Running] = {}
        self.held: dict[int, int] = {}  # block -> running requests holding it
        self.events: list[ev.CacheEvent] = []
        self.reused: list[tuple[int, frozenset[Subject]]] = []  # blocks reused this step, their earlier owners

    # --- what the scheduler did -------------------------------------------------------------------

    def admit(self, req: str, subject: Subject, block_ids: list[int], hits: int) -> list[int]:
        """A request scheduled for the first time (or again after preemption) with its blocks, the
        first `hits` found in the prefix cache. Returns blocks to overwrite before this step runs."""
        self._release(req)  # resumed after preemption: the blocks it had were freed
        self.running[req] = Running(subject)
        shared = block_ids[:hits]
        for b in shared:
            self.owners.setdefault(b, set()).add(subject)
            self.held[b] = self.held.get(b, 0) + 1
        self.running[req].blocks.extend(shared)
        self.events.append(ev.SequenceOpened(None, subject, pages(shared), hits * self.block_size,
                                             hits * self.block_bytes, policy="vllm"))
        return self.grow(req, block_ids[hits:])

    def grow(self, req: str, block_ids: list[int]) -> list[int]:
        """New blocks allocated to a running request; returns those that held others' data."""
        run = self.running.get(req)
        if run is None or not block_ids:
            return []
        reused: dict[Subject, list[int]] = {}
        for b in block_ids:
            if self.held.get(b):  # a running request holds it: shared, not reused (vLLM never reuses it)
                self.owners.setdefault(b, set()).add(run.subject)
            else:
                earlier = self.owners.get(b, ())
                for old in earlier:
                    reused.setdefault(old, []).append(b)
                if earlier:
                    self.reused.append((b, frozenset(earlier)))
                self.owners[b] = {run.subject}
            self.held[b] = self.held.get(b, 0) + 1
        run.blocks.extend(block_ids)
        for old, blocks in reused.items():
            self.events.append(ev.TokensEvicted(None, old, pages(blocks), len(blocks) * self.block_size,
                                                len(blocks) * self.block_bytes, evictor="vllm-prefix-cache"))
        self.events.append(ev.BlocksStored(None, run.subject, pages(block_ids), len(block_ids) * self.block_size,
                                           len(block_ids) * self.block_bytes))
        return sorted({b for blocks in reused.values() for b in blocks})

    def _release(self, req: str) -> Running | None:
        run = self.running.pop(req, None)
        for b in run.blocks if run else ():
            n = self.held.get(b, 0) - 1
            if n > 0:
                self.held[b] = n
            else:
                self.held.pop(b, None)
        return run

    def finish(self, req: str, cached: Callable[[int], bool]) -> list[int]:
        """A request ended (or was aborted). Its blocks that vLLM keeps in no prefix cache
        (`cached(b)` false) and no other request holds are overwritten now: returned."""
        run = self._release(req)
        if run is None:
            return []
        gone = [b for b in run.blocks if not self.held.get(b) and not cached(b)]
        for b in gone:
            self.owners.pop(b, None)
        self.events.append(ev.SequenceFreed(None, run.subject, pages(gone), len(run.blocks) * self.block_size,
                                            len(gone) * self.block_bytes))
        return gone

    def forget(self, block_ids: Iterable[int]) -> None:
        """Blocks overwritten for another reason (the engine's own reset)."""
        for b in block_ids:
            self.owners.pop(b, None)

    # --- erasure ----------------------------------------------------------------------------------

    def running_of(self, match: Callable[[Subject], bool]) -> list[str]:
        return [r for r, run in self.running.items() if match(run.subject)]

    def erase(self, scope: str, tenant: str, target: str, in_use: Callable[[int], bool]) -> Erasure | None:
        """The subject's blocks: those it alone holds leave the ledger (the caller evicts them from
        the prefix cache and overwrites them); shared ones lose the subject. None while a request
        of the subject still runs: its blocks are in use until it ends."""
        match = erased(scope, tenant, target)
        if self.running_of(match):
            return None
        overwritten, shared = [], 0
        for b, owners in list(self.owners.items()):
            mine = {o for o in owners if match(o)}
            if not mine:
                continue
            rest = owners - mine
            if rest or in_use(b):
                self.owners[b] = rest or owners  # another request holds it; nothing of it is only ours
                shared += 1
            else:
                del self.owners[b]
                overwritten.append(b)
        subject = Subject(tenant, target if scope == "user" else "*", target if scope == "session" else "*")
        return Erasure(subject, scope, sorted(overwritten), 0, shared)
