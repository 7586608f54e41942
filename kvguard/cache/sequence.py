"""Sequences: the open ones by id, their pages in token order, and the subjects that own them.

A sequence is one subject's run of tokens. Its pages (`PageRef`, in a device pool or a lower
tier) are kept in a `PageList` whose version changes with every edit, so that what is derived
from it (the block tables, `block_tables.py`) is rebuilt only after a change. `Sequences` opens
them (sharing a tenant's cached prompt pages), finds them by id or by subject, and forgets them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, InputError, UnknownSequence
from ..types import PageId, SeqId, Subject
from .config import CacheConfig
from .pages import HOT, MAIN, SPLIT, PageRef, PageStore
from .prefix import page_hashes, tenant_salt

_VERSIONS = itertools.count(1)


class PageList(list):
    """A sequence's pages in token order. Every new list and every edit takes a fresh version
    number, so that what is derived from the pages (the block tables the kernels read) is
    rebuilt only after a change."""

    def __init__(self, *args):
        super().__init__(*args)
        self.version = next(_VERSIONS)


def _versioned(name: str):
    def method(self, *args):
        self.version = next(_VERSIONS)
        return getattr(list, name)(self, *args)

    method.__name__ = name
    return method


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
              "clear", "sort", "reverse"):
    setattr(PageList, _name, _versioned(_name))


@dataclass
class Layout:
    """Where a sequence's device pages are, per pool, as the decode kernels take them; derived
    from `Sequence.pages` (by block_tables.py) and rebuilt after it changes (a new page, a
    quantized one, a compaction, a fetch), so a decode step costs no walk over the pages."""

    version: int  # of the page list it was built from
    idx: dict[str, list[int]]  # pool -> the sequence's page indices held there, ascending
    host: dict[str, torch.Tensor]  # pool -> [len(idx)] int32 page ids, same order, on the host
    tables: dict[str, torch.Tensor]  # pool -> the same as [1, len(idx)] on the device
    away: int  # pages in a lower tier
    positions: dict[str, torch.Tensor] = field(default_factory=dict)  # pool -> token positions, made on demand


@dataclass
class Sequence:
    id: SeqId
    subject: Subject
    lengths: list[int]
    pages: PageList = field(default_factory=PageList)
    # attention mass per position, on the cache's device: [layers, KV heads, capacity], capacity
    # grown by doubling (`mass` is the part up to the longest layer)
    mass_buf: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, 0))
    evicted: int = 0
    positional: bool = True  # positions still equal token indices (no compaction yet)
    layout: Layout | None = None
    # lower-tier copies (tier, key) that outlived their move: a page fetched back whose copy could
    # not be erased, or a failed put that may have stored; erased with the sequence
    stale: list[tuple[str, str]] = field(default_factory=list)

    def __setattr__(self, name, value):
        if name == "pages" and not isinstance(value, PageList):
            value = PageList(value)
        object.__setattr__(self, name, value)

    @property
    def mass(self) -> torch.Tensor:
        """[layers, KV heads, longest layer's length]: each position's accumulated attention mass."""
        return self.mass_buf[..., : max(self.lengths)]

    @mass.setter
    def mass(self, value: torch.Tensor) -> None:
        self.mass_buf = value

    def grow_mass(self, length: int) -> None:
        have = self.mass_buf.shape[-1]
        if have < length:
            grow = torch.zeros(*self.mass_buf.shape[:-1], max(length, 2 * have) - have, device=self.mass_buf.device)
            old, self.mass_buf = self.mass_buf, torch.cat([self.mass_buf, grow], dim=-1)
            old.zero_()  # attention statistics of the subject's tokens: not left in freed memory

    def written(self, layer: int, t: int, num_layers: int) -> bool:
        """After t tokens of a layer were written: lengths and room for their mass. True once
        every layer has them: the pages that left the 16-bit window may then be quantized."""
        self.lengths[layer] += t
        self.grow_mass(self.lengths[layer])
        return layer == num_layers - 1 or self.lengths[layer] == min(self.lengths)


class Sequences:
    """The open sequences of one cache, by id."""

    def __init__(self, cfg: CacheConfig, store: PageStore):
        self.cfg = cfg
        self.store = store
        self._by_id: dict[SeqId, Sequence] = {}
        self._ids = itertools.count(1)

    def open(self, subject: Subject, tokens: Seq[int] | None = None) -> Sequence:
        """A new sequence of `subject`; with `tokens`, sharing the full pages already cached for
        the same tenant under their salted hashes."""
        if not isinstance(subject, Subject):
            raise InputError("subject must be a kvguard.types.Subject")
        c = self.cfg
        seq = Sequence(SeqId(next(self._ids)), subject, [0] * c.num_layers,
                       mass_buf=torch.zeros(c.num_layers, c.num_kv_heads, 0, device=c.device))
        self._by_id[seq.id] = seq
        if tokens:
            salt = tenant_salt(c.prefix_secret, subject.tenant)
            for h in page_hashes(salt, list(tokens), c.page_size):
                hit = self.store.prefix.get(h)
                if hit is None:
                    break
                pool, page = hit
                self.store.pools[pool].share(PageId(page), subject)
                seq.pages.append(PageRef(pool, page, pool))
            n = len(seq.pages) * c.page_size
            seq.lengths = [n] * c.num_layers
            seq.mass = torch.zeros(c.num_layers, c.num_kv_heads, n, device=c.device)
        return seq

    def publish_prefix(self, seq_id: SeqId, tokens: Seq[int]) -> int:
        """Index the sequence's full device pages under the tenant-salted hashes of `tokens`.
        Returns pages indexed."""
        c = self.cfg
        if not c.prefix_sharing:
            raise ConfigError("this cache shares no prompt pages (its policy's prefix_sharing is none): "
                              "do not publish prefixes, or use a policy with prefix_sharing: tenant")
        seq = self.get(seq_id)
        if not seq.positional:
            return 0
        salt = tenant_salt(c.prefix_secret, seq.subject.tenant)
        full = min(min(seq.lengths), len(tokens)) // c.page_size
        n = 0
        for ref, h in zip(seq.pages[:full], page_hashes(salt, list(tokens), c.page_size)):
            if ref.where in (HOT, MAIN, SPLIT) and self.store.prefix.get(h) is None:
                self.store.prefix.put(h, (ref.where, int(ref.page)))
                n += 1
        return n

    def get(self, seq_id: SeqId) -> Sequence:
        try:
            return self._by_id[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"sequence {seq_id!r} is not open in this cache") from None

    def batch(self, seq_ids: Seq[SeqId]) -> list[Sequence]:
        """The sequences of a batch, one per row: open, and none named twice."""
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Seq) or not seq_ids:
            raise InputError("seq_ids must be a non-empty list of open sequences")
        seqs = [self.get(i) for i in seq_ids]
        if len({seq.id for seq in seqs}) != len(seqs):
            raise InputError("seq_ids names a sequence twice")
        return seqs

    def owned_by(self, match: Callable[[Subject], bool]) -> list[Sequence]:
        """The sequences whose subject `match` accepts."""
        return [s for s in self._by_id.values() if match(s.subject)]

    def remove(self, seq: Sequence) -> None:
        del self._by_id[seq.id]

    def ids(self) -> list[SeqId]:
        return list(self._by_id)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)
