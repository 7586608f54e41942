"""The cache manager: one locked entry point over the cache's parts.

Each part owns one job and lives in its own module:

    sequence.py      open sequences, their pages in token order, their owners (`Sequences`)
    pages.py         the device pools, the prefix index over them, page release (`PageStore`)
    block_tables.py  each sequence's pages per pool as the kernels take them (`BlockTables`)
    writes.py        append: 16-bit pages taken, tokens written (`Writer`)
    quantize.py      full pages out of the 16-bit window re-encoded (`Quantizer`)
    reads.py         attention and dequantized K/V (`Reader`)
    compaction.py    the evictor's survivors moved into fewer pages (`Compactor`)
    residency.py     pages offloaded to lower tiers and fetched back (`Residency`)
    split.py         the K/V split: cold values in CPU memory, fetched by score (`ValueSplit`)
    window.py        a sliding-window cache's pages out of its window, freed (`Window`)
    picks.py         which cold pages a query of the split reads, on the reference path
    erasure.py       free, erase a user or a session (`Eraser`)

`CacheManager` checks what callers hand it (`checks.py`), then calls the part, all under one
reentrant lock: an erasure may arrive on another thread mid-decode (the sidecar client's
command thread), and a static decode step (`step.py`) holds the lock from its `begin` to its
`end`. Every operation that changes what the cache holds emits one frozen event into `events`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvguard.kernels.quantize import INT4_GROUP

from ..compress.codecs import make_codec
from ..compress.codecs.rotation import Rotation
from ..compress.evictors import make_evictor
from ..errors import ConfigError, InputError
from ..types import SeqId, Subject
from . import events as ev
from .block_tables import BlockTables
from .checks import check_counts, check_kv, check_layer, check_same_shape, check_shape
from .compaction import Compactor
from .config import CacheConfig
from .erasure import Eraser
from .pages import HOT, MAIN, PageRef, PageStore, page_name
from .quantize import Quantizer
from .reads import Reader
from .residency import Residency
from .sequence import PageList, Sequence, Sequences
from .split import ValueSplit
from .tiers import Tier
from .window import Window
from .writes import Writer

__all__ = ["HOT", "MAIN", "CacheManager", "CacheStats", "PageList", "PageRef", "Sequence"]


def _locked(method):
    """Serialize public operations: an erasure may arrive on another thread mid-decode."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class CacheStats:
    codec: str
    evictor: str | None
    sequences: int
    tokens_held: int
    tokens_evicted: int
    pages_used: dict[str, int]
    pages_free: dict[str, int]
    pages_offloaded: dict[str, int]
    bytes_per_token: dict[str, float]
    bytes_held: int  # wherever the pools keep them
    bytes_16bit_equivalent: int
    waste_slots: int  # unused token slots inside partly filled pages
    bytes_on_device: int = 0  # of bytes_held, those in device memory (the K/V split keeps values in the host's)

    @property
    def saving(self) -> float:
        return 1.0 - self.bytes_held / self.bytes_16bit_equivalent if self.bytes_16bit_equivalent else 0.0


class CacheManager:
    def __init__(self, config: CacheConfig, *, events: ev.EventQueue | None = None,
                 tiers: dict[str, Tier] | None = None):
        self.cfg = c = config
        if c.layer_windows is not None:
            raise ConfigError("a model whose layers have windows of their own takes kvguard.cache.open_manager, "
                              "which gives its sliding-window and global layers a cache each")
        self.codec = make_codec(c.codec, **c.codec_options)
        try:
            self.codec.check(c.num_kv_heads, c.page_size, c.head_dim)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if c.use_kernels and getattr(self.codec, "group", INT4_GROUP) != INT4_GROUP:
            raise ConfigError(f"the Triton kernels take int4 value groups of {INT4_GROUP}, not "
                              f"{self.codec.group}: use group {INT4_GROUP} or use_kernels=False")
        self.evictor = make_evictor(c.evictor, **c.evictor_options) if c.evictor else None
        if self.evictor is not None and self.evictor.allocation != "uniform":
            raise ConfigError(f"evictor allocation {self.evictor.allocation!r} is not stored by the cache: a page "
                              "holds every layer and KV head, so all keep the same count; use allocation: "
                              "uniform (kvguard eval measures the others by read-time simulation)")
        self.events = events if events is not None else ev.EventQueue()
        self.tiers = dict(tiers or {})
        if c.tiers is not None and (extra := sorted(set(self.tiers) - set(c.tiers))):
            raise ConfigError(f"tier(s) {extra} given, but pages of this cache may go to "
                              f"{list(c.tiers) or 'no lower tier'} only (its policy's tiers)")
        self.lock = threading.RLock()
        emit = self._emit
        self.store = PageStore(c, self.codec)
        self.pools, self.prefix = self.store.pools, self.store.prefix
        self.seqs = Sequences(c, self.store)
        self.block_tables = BlockTables(c, self.pools)
        self.residency = Residency(c, self.store, self.block_tables, self.tiers, emit)
        self.quantizer = Quantizer(c, self.codec, self.store, self.block_tables, emit)
        self.split = self.residency.split = (ValueSplit(c, self.store, self.block_tables, self.residency,
                                                        self.quantizer.report_keys) if c.kv_split else None)
        self.compactor = Compactor(c, self.codec, self.evictor, self.store, self.residency, self.quantizer, emit)
        # A rotating codec stores every page of this cache rotated (kvguard/compress/codecs/rotation.py):
        # K/V are rotated as they are written, a query as it is read and the output back.
        self.rotation = Rotation(c.head_dim, c.device, c.dtype) if self.codec.rotate else None
        self.writer = Writer(c, self.store, self.block_tables, self.quantizer, self.compactor, self.rotation)
        self.writer.split = self.split
        self.writer.window = Window(c, self.store, emit) if c.window is not None else None
        self.reader = Reader(c, self.evictor, self.store, self.block_tables, self.residency)
        self.eraser = Eraser(self.seqs, self.store, self.residency, emit)

    def _emit(self, event: ev.CacheEvent) -> None:
        self.events.emit(event)  # the queue of the moment: a consumer may hand the cache its own

    # --- sequences ------------------------------------------------------------------------------

    @_locked
    def open(self, subject: Subject, tokens: Seq[int] | None = None) -> SeqId:
        """Open a sequence for a subject. With `tokens` (the prompt's ids), full pages
        already cached for the same tenant are shared; `length(seq)` says how many."""
        return self.seqs.open(subject, tokens).id

    @_locked
    def announce_open(self, seq_id: SeqId, policy: str) -> ev.SequenceOpened:
        """Emit the `open` event of a served request's sequence (`open` itself emits none): the
        prompt pages it shares from its tenant's prefix cache and the policy in force."""
        seq = self._seq(seq_id)
        names = tuple(page_name(r.where, r.page) for r in seq.pages)
        event = ev.SequenceOpened(seq.id, seq.subject, names, seq.lengths[0], self.store.bytes_of(names),
                                  policy=policy)
        self.events.emit(event)
        return event

    @_locked
    def publish_prefix(self, seq_id: SeqId, tokens: Seq[int]) -> int:
        """Index the sequence's full pages under the tenant-salted hashes of `tokens`, so
        later sequences of the same tenant share them. Returns pages indexed. A cache whose
        policy shares no prefixes (`prefix_sharing` off) refuses."""
        return self.seqs.publish_prefix(seq_id, tokens)

    def length(self, seq_id: SeqId, layer: int = 0) -> int:
        return self._seq(seq_id).lengths[layer]

    def sequences(self) -> list[SeqId]:
        return self.seqs.ids()

    def subject_of(self, seq_id: SeqId) -> Subject:
        return self._seq(seq_id).subject

    def _seq(self, seq_id: SeqId) -> Sequence:
        return self.seqs.get(seq_id)

    # --- write ----------------------------------------------------------------------------------

    @_locked
    def append(self, seq_id: SeqId, layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Append K/V [T, H, D] of T new tokens for one layer. Returns False, changing
        nothing, when the pool has no page left for them."""
        seq = self.seqs.get(seq_id)
        check_layer(self.cfg, layer)
        check_kv(self.cfg, k, v)
        return self.writer.append([seq], layer, k, v, [k.shape[0]])

    @_locked
    def append_step(self, seq_ids: Seq[SeqId], layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Append one new token to each of several sequences for one layer: k, v [B, H, D],
        row i for seq_ids[i] (a decode step of a batch). Returns False, writing nothing, when
        the 16-bit pool has fewer free pages than the rows that start a page."""
        seqs = self.seqs.batch(seq_ids)
        check_layer(self.cfg, layer)
        check_kv(self.cfg, k, v)
        if k.shape[0] != len(seqs):
            raise InputError(f"k and v have {k.shape[0]} rows for {len(seqs)} sequences")
        return self.writer.append(seqs, layer, k, v, [1] * len(seqs))

    @_locked
    def append_chunk(self, seq_ids: Seq[SeqId], layer: int, k: torch.Tensor, v: torch.Tensor,
                     counts: Seq[int] | None = None) -> bool:
        """Append a chunk of new tokens to each of several sequences for one layer (a batch's
        prefill): k, v [B, T, H, D], row i for seq_ids[i], of which the last counts[i] tokens
        are real and the rest padding, not written (default: all T). Returns False, writing
        nothing, when the 16-bit pool has too few free pages for them."""
        seqs = self.seqs.batch(seq_ids)
        c = self.cfg
        check_layer(c, layer)
        want = (len(seqs), "T", c.num_kv_heads, c.head_dim)
        check_shape("k", k, want)
        check_shape("v", v, want)
        check_same_shape(k, v)
        t = k.shape[1]
        check_kv(c, k.flatten(0, 1), v.flatten(0, 1))
        counts = check_counts(counts, len(seqs), t)
        if all(n == t for n in counts):
            k, v = k.flatten(0, 1), v.flatten(0, 1)
        else:
            k = torch.cat([k[i, t - n:] for i, n in enumerate(counts)])
            v = torch.cat([v[i, t - n:] for i, n in enumerate(counts)])
        return self.writer.append(seqs, layer, k, v, counts)

    # --- read -----------------------------------------------------------------------------------

    @_locked
    def kv(self, seq_id: SeqId, layer: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V over everything the sequence holds, dequantized: [H, L, D]."""
        seq = self.seqs.get(seq_id)
        check_layer(self.cfg, layer)
        k, v = self.reader.kv(seq, layer, dtype or self.cfg.dtype)
        r = self.rotation
        return (k, v) if r is None else (r.inverse(k), r.inverse(v))

    def _rotated(self, read, q: torch.Tensor, *args) -> torch.Tensor:
        """read(q, *args) in the rotated space of a rotating codec: q in, the output back."""
        r = self.rotation
        return read(q, *args) if r is None else r.inverse(read(r(q), *args))

    @_locked
    def attend(self, seq_id: SeqId, layer: int, q: torch.Tensor, *, causal: bool = True,
               scale: float | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] (the sequence's last T positions) over everything
        the sequence holds for this layer. Returns [T, Hq, D]. Accumulates each key's
        attention mass when the evictor scores by it. On the kernel path a decode step
        (T = 1) and a causal chunk read the pages in place; a chunk whose mass the
        evictor needs adds it from a second kernel pass over its keys."""
        seq = self.seqs.get(seq_id)
        c = self.cfg
        check_layer(c, layer)
        check_shape("q", q, ("T", c.num_query_heads, c.head_dim))
        if q.shape[0] > seq.lengths[layer]:
            raise InputError(f"{q.shape[0]} queries but the sequence holds {seq.lengths[layer]} positions")
        return self._rotated(lambda q: self.reader.attend(seq, layer, q, causal, scale), q)

    @_locked
    def attend_step(self, seq_ids: Seq[SeqId], layer: int, q: torch.Tensor, *,
                    scale: float | None = None) -> torch.Tensor:
        """Decode attention of a batch: q [B, Hq, D], row i the last position of seq_ids[i],
        over what each sequence holds for this layer. Returns [B, Hq, D]. On the kernel path
        the whole batch is one pass of the decode kernels; accumulates attention mass as
        `attend` does."""
        seqs = self.seqs.batch(seq_ids)
        c = self.cfg
        check_layer(c, layer)
        check_shape("q", q, (len(seqs), c.num_query_heads, c.head_dim))
        for seq in seqs:
            if seq.lengths[layer] < 1:
                raise InputError(f"sequence {seq.id} holds no position at layer {layer}")
        if c.use_kernels and q.dtype not in (torch.float16, torch.bfloat16):
            raise InputError(f"q has dtype {q.dtype}; the decode kernels take float16 or bfloat16")
        return self._rotated(lambda q: self.reader.attend_step(seqs, layer, q, scale), q)

    @_locked
    def attend_chunk(self, seq_ids: Seq[SeqId], layer: int, q: torch.Tensor, counts: Seq[int] | None = None, *,
                     scale: float | None = None) -> torch.Tensor:
        """Causal attention of a batch's chunk: q [B, T, Hq, D], of which row i's last counts[i]
        queries are its sequence's last counts[i] positions and the rest padding (zeros out;
        default: all T), over what each sequence holds for this layer. Returns [B, T, Hq, D]. On
        the kernel path every row is one launch of the prefill kernel per pool; a chunk whose
        mass the evictor needs takes each row's own `attend`."""
        seqs = self.seqs.batch(seq_ids)
        c = self.cfg
        check_layer(c, layer)
        check_shape("q", q, (len(seqs), "T", c.num_query_heads, c.head_dim))
        counts = check_counts(counts, len(seqs), q.shape[1])
        for seq, n in zip(seqs, counts):
            if n > seq.lengths[layer]:
                raise InputError(f"{n} queries but sequence {seq.id} holds {seq.lengths[layer]} positions")
        return self._rotated(lambda q: self.reader.attend_chunk(seqs, layer, q, counts, scale), q)

    # --- evict, offload -------------------------------------------------------------------------

    @_locked
    def compact(self, seq_id: SeqId) -> ev.TokensEvicted | None:
        """Run the evictor and move the survivors into fewer pages, freeing the rest.
        Returns the event, or None when nothing was evicted (within budget, or no
        free page to compact into). Raises OutOfPages, changing nothing, when the
        sequence's offloaded pages have no room to come back to the device."""
        seq = self.seqs.get(seq_id)
        if self.evictor is None:
            raise ConfigError("this cache has no evictor; configure one to compact")
        return self.compactor.compact(seq)

    @_locked
    def offload(self, seq_id: SeqId, tier: str, max_pages: int | None = None) -> int:
        """Move the sequence's oldest full device pages that no other sequence shares
        to a lower tier, freeing device pages. Returns how many moved."""
        return self.residency.offload(self.seqs.get(seq_id), tier, max_pages)

    @_locked
    def split_cold(self, seq_id: SeqId) -> int:
        """Move the values of the sequence's pages that left the K/V split's window to CPU
        memory now (writes do it at each step's first layer). Returns pages moved."""
        if self.split is None:
            raise ConfigError("this cache has no K/V split; configure kv_split to split values")
        return self.split.settle(self.seqs.get(seq_id))

    # --- free, erase ----------------------------------------------------------------------------

    @_locked
    def free(self, seq_id: SeqId) -> None:
        """End a sequence: its pages are overwritten and freed unless another sequence
        shares them; its prefix-index entries stay for the pages still shared. Raises
        TierError, releasing nothing, when a tier copy cannot be erased."""
        self.eraser.free(self.seqs.get(seq_id))

    @_locked
    def erase_user(self, tenant: str, user: str) -> ev.SubjectErased:
        """Erase every sequence of a user (see `erase_session`)."""
        return self.eraser.erase("user", lambda s: s.tenant == tenant and s.user == user, Subject(tenant, user, "*"))

    @_locked
    def erase_session(self, tenant: str, session: str) -> ev.SubjectErased:
        """Erase every sequence of a session: pages nobody else holds are overwritten and
        freed; shared pages lose the subject and their prefix-index entries. Every lower-tier
        copy is erased first: a tier that fails raises TierError with nothing released and
        nothing recorded, and the erasure can be run again."""
        return self.eraser.erase("session", lambda s: s.tenant == tenant and s.session == session,
                                 Subject(tenant, "*", session))

    # --- accounting -----------------------------------------------------------------------------

    @_locked
    def stats(self) -> CacheStats:
        c = self.cfg
        seqs = list(self.seqs)
        tokens = sum(max(s.lengths) for s in seqs)
        evicted = sum(s.evicted for s in seqs)
        per_token_16 = self.pools[HOT].page_bytes / c.page_size
        slots = sum(len([r for r in s.pages if r.where in self.pools]) for s in seqs) * c.page_size
        off: dict[str, int] = {}
        for s in seqs:
            for tier, n in self.residency.offloaded(s).items():
                off[tier] = off.get(tier, 0) + n
        return CacheStats(
            codec=self.codec.name, evictor=self.evictor.name if self.evictor else None,
            sequences=len(seqs), tokens_held=tokens, tokens_evicted=evicted,
            pages_used={n: p.used_count for n, p in self.pools.items()},
            pages_free={n: p.free_count for n, p in self.pools.items()},
            pages_offloaded=off,
            bytes_per_token={n: p.page_bytes / c.page_size for n, p in self.pools.items()},
            bytes_held=sum(p.used_count * p.page_bytes for p in self.pools.values()),
            bytes_16bit_equivalent=int((tokens + evicted) * per_token_16),
            waste_slots=max(0, slots - tokens),
            bytes_on_device=sum(p.used_count * p.device_page_bytes for p in self.pools.values())
            + (self.split.hot.nbytes if self.split is not None and self.split.hot is not None else 0),
        )
