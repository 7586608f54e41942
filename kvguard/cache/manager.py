"""The cache manager: sequences, their block tables, and every operation on them.

write → encode → page: `append` writes K/V into the sequence's 16-bit tail pages;
a page that is full, past the 16-bit sinks and out of the 16-bit window is
re-encoded into the codec's pool (`quantize` event). `compact` runs the evictor and
moves the survivors into fewer pages (`evict`); `offload` / fetch move pages to
lower tiers and back; `free` and `erase_*` overwrite and release. Each of these
emits one frozen event per operation into `self.events`.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kvguard.kernels.quantize import INT4_GROUP

from ..compress.codecs import Fp16Codec, make_codec
from ..compress.evictors import make_evictor
from ..errors import ConfigError, InputError, OutOfPages, TierError, UnknownSequence
from ..types import PageId, SeqId, Subject
from . import events as ev
from . import paged
from .attention import dense_attention
from .config import CacheConfig
from .pool import PagePool, device_index
from .prefix import PrefixIndex, page_hashes, tenant_salt
from .tiers import Tier

HOT, MAIN = "hot", "main"


def _locked(method):
    """Serialize public operations: an erasure may arrive on another thread mid-decode."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


def _pid(pool: str, page) -> str:
    """A page as events name it: pools number their pages independently."""
    return f"{pool}:{int(page)}"


@dataclass
class PageRef:
    """Where one page of a sequence lives: a device pool (`hot`, `main`) or a tier."""

    where: str
    page: int | str  # page id in a pool, key in a tier
    pool: str = HOT  # the pool it belongs to when on the device (for tiers: where it returns)


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
    from `Sequence.pages` and rebuilt after it changes (a new page, a quantized one, a
    compaction, a fetch), so a decode step costs no walk over the pages."""

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
    bytes_held: int
    bytes_16bit_equivalent: int
    waste_slots: int  # unused token slots inside partly filled pages

    @property
    def saving(self) -> float:
        return 1.0 - self.bytes_held / self.bytes_16bit_equivalent if self.bytes_16bit_equivalent else 0.0


class CacheManager:
    def __init__(self, config: CacheConfig, *, events: ev.EventQueue | None = None,
                 tiers: dict[str, Tier] | None = None):
        self.cfg = c = config
        self.codec = make_codec(c.codec, **c.codec_options)
        try:
            self.codec.check(c.num_kv_heads, c.page_size, c.head_dim)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if c.use_kernels and getattr(self.codec, "group", INT4_GROUP) != INT4_GROUP:
            raise ConfigError(f"the Triton kernels take int4 value groups of {INT4_GROUP}, not "
                              f"{self.codec.group}: use group {INT4_GROUP} or use_kernels=False")
        self.evictor = make_evictor(c.evictor, **c.evictor_options) if c.evictor else None
        self.events = events if events is not None else ev.EventQueue()
        self.tiers = dict(tiers or {})
        if c.tiers is not None and (extra := sorted(set(self.tiers) - set(c.tiers))):
            raise ConfigError(f"tier(s) {extra} given, but pages of this cache may go to "
                              f"{list(c.tiers) or 'no lower tier'} only (its policy's tiers)")
        shape = dict(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     page_size=c.page_size, dtype=c.dtype, device=c.device)
        self.pools = {HOT: PagePool(Fp16Codec(), num_pages=c.num_hot_pages, **shape)}
        if self.codec.quantized:
            self.pools[MAIN] = PagePool(self.codec, num_pages=c.num_pages, **shape)
        self.prefix = PrefixIndex()
        self._seqs: dict[SeqId, Sequence] = {}
        self._ids = itertools.count(1)
        self.lock = threading.RLock()
        self._tables: OrderedDict[tuple, tuple] = OrderedDict()  # see _while_pages_hold
        self._ints: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # see _device_ints

    # --- sequences ------------------------------------------------------------------------------

    @_locked
    def open(self, subject: Subject, tokens: Seq[int] | None = None) -> SeqId:
        """Open a sequence for a subject. With `tokens` (the prompt's ids), full pages
        already cached for the same tenant are shared; `length(seq)` says how many."""
        if not isinstance(subject, Subject):
            raise InputError("subject must be a kvguard.types.Subject")
        seq = Sequence(SeqId(next(self._ids)), subject, [0] * self.cfg.num_layers,
                       mass_buf=torch.zeros(self.cfg.num_layers, self.cfg.num_kv_heads, 0, device=self.cfg.device))
        self._seqs[seq.id] = seq
        if tokens:
            salt = tenant_salt(self.cfg.prefix_secret, subject.tenant)
            for h in page_hashes(salt, list(tokens), self.cfg.page_size):
                hit = self.prefix.get(h)
                if hit is None:
                    break
                pool, page = hit
                self.pools[pool].share(PageId(page), subject)
                seq.pages.append(PageRef(pool, page, pool))
            n = len(seq.pages) * self.cfg.page_size
            seq.lengths = [n] * self.cfg.num_layers
            seq.mass = torch.zeros(self.cfg.num_layers, self.cfg.num_kv_heads, n, device=self.cfg.device)
        return seq.id

    @_locked
    def publish_prefix(self, seq_id: SeqId, tokens: Seq[int]) -> int:
        """Index the sequence's full pages under the tenant-salted hashes of `tokens`, so
        later sequences of the same tenant share them. Returns pages indexed. A cache whose
        policy shares no prefixes (`prefix_sharing` off) refuses."""
        if not self.cfg.prefix_sharing:
            raise ConfigError("this cache shares no prompt pages (its policy's prefix_sharing is none): "
                              "do not publish prefixes, or use a policy with prefix_sharing: tenant")
        seq = self._seq(seq_id)
        if not seq.positional:
            return 0
        salt = tenant_salt(self.cfg.prefix_secret, seq.subject.tenant)
        full = min(min(seq.lengths), len(tokens)) // self.cfg.page_size
        n = 0
        for ref, h in zip(seq.pages[:full], page_hashes(salt, list(tokens), self.cfg.page_size)):
            if ref.where in self.pools and self.prefix.get(h) is None:
                self.prefix.put(h, (ref.where, int(ref.page)))
                n += 1
        return n

    def length(self, seq_id: SeqId, layer: int = 0) -> int:
        return self._seq(seq_id).lengths[layer]

    def sequences(self) -> list[SeqId]:
        return list(self._seqs)

    def subject_of(self, seq_id: SeqId) -> Subject:
        return self._seq(seq_id).subject

    def _seq(self, seq_id: SeqId) -> Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"sequence {seq_id!r} is not open in this cache") from None

    # --- write → encode → page ------------------------------------------------------------------

    @_locked
    def append(self, seq_id: SeqId, layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Append K/V [T, H, D] of T new tokens for one layer. Returns False, changing
        nothing, when the pool has no page left for them."""
        seq = self._seq(seq_id)
        self._check_layer(layer)
        self._check_kv(k, v)
        return self._append([seq], layer, k, v, [k.shape[0]])

    @_locked
    def append_step(self, seq_ids: Seq[SeqId], layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Append one new token to each of several sequences for one layer: k, v [B, H, D],
        row i for seq_ids[i] (a decode step of a batch). Returns False, writing nothing, when
        the 16-bit pool has fewer free pages than the rows that start a page."""
        seqs = self._batch(seq_ids)
        self._check_layer(layer)
        self._check_kv(k, v)
        if k.shape[0] != len(seqs):
            raise InputError(f"k and v have {k.shape[0]} rows for {len(seqs)} sequences")
        return self._append(seqs, layer, k, v, [1] * len(seqs))

    @_locked
    def append_chunk(self, seq_ids: Seq[SeqId], layer: int, k: torch.Tensor, v: torch.Tensor,
                     counts: Seq[int] | None = None) -> bool:
        """Append a chunk of new tokens to each of several sequences for one layer (a batch's
        prefill): k, v [B, T, H, D], row i for seq_ids[i], of which the last counts[i] tokens
        are real and the rest padding, not written (default: all T). Returns False, writing
        nothing, when the 16-bit pool has too few free pages for them."""
        seqs = self._batch(seq_ids)
        c = self.cfg
        self._check_layer(layer)
        if not isinstance(k, torch.Tensor) or k.dim() != 4 or k.shape[0] != len(seqs):
            shape = list(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            raise InputError(f"k must have shape [{len(seqs)}, T, {c.num_kv_heads}, {c.head_dim}], got {shape}")
        if not isinstance(v, torch.Tensor) or v.shape != k.shape:
            raise InputError("k and v differ in shape")
        t = k.shape[1]
        self._check_kv(k.flatten(0, 1), v.flatten(0, 1))
        counts = self._counts(counts, len(seqs), t)
        if all(n == t for n in counts):
            k, v = k.flatten(0, 1), v.flatten(0, 1)
        else:
            k = torch.cat([k[i, t - n:] for i, n in enumerate(counts)])
            v = torch.cat([v[i, t - n:] for i, n in enumerate(counts)])
        return self._append(seqs, layer, k, v, counts)

    def _append(self, seqs: list[Sequence], layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int]) -> bool:
        """counts[i] new tokens for seqs[i], their K/V [sum(counts), H, D] row after row: compact
        a row past the evictor's budget (first layer), take the 16-bit pages the tokens need (all
        or none), write them, and account for them."""
        for seq in seqs:
            self._auto_compact(seq, layer)
        s = self.cfg.page_size
        need = [max(0, -(-(seq.lengths[layer] + n) // s) - len(seq.pages)) for seq, n in zip(seqs, counts)]
        if any(need):
            hot = self.pools[HOT]
            if hot.free_count < sum(need):
                return False
            for seq, n in zip(seqs, need):
                if n:
                    seq.pages.extend(PageRef(HOT, p, HOT) for p in hot.allocate(n, seq.subject))
        if k.shape[0]:
            self._write_tokens(layer, self._token_rows(seqs, layer, counts), k, v)
        ready = [seq for seq, n in zip(seqs, counts) if n and self._written(seq, layer, n)]
        if ready:
            self._quantize_ready(ready)
        return True

    @staticmethod
    def _counts(counts, b: int, t: int) -> list[int]:
        if counts is None:
            return [t] * b
        counts = list(counts)
        if len(counts) != b or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= t for n in counts):
            raise InputError(f"counts must be {b} integers in [0, {t}], one per row")
        return counts

    def _token_rows(self, seqs: list[Sequence], layer: int, counts: list[int]) -> torch.Tensor:
        """Where the next counts[i] tokens of seqs[i] go in the 16-bit pool viewed as
        [P * H * S, D]: rows (page * H + head) * S + slot, sequence by sequence, token by token,
        head by head; the same for every layer of a step or prompt, so copied to the device once."""
        s, h = self.cfg.page_size, self.cfg.num_kv_heads
        at = tuple((seq.id, seq.pages.version, seq.lengths[layer], n) for seq, n in zip(seqs, counts))

        def rows():
            out = []
            for seq, (_, _, start, n) in zip(seqs, at):
                for pos in range(start, start + n):
                    base = int(seq.pages[pos // s].page) * h * s + pos % s
                    out.extend(base + i * s for i in range(h))
            return out

        return self._device_ints(("rows", at), rows)

    def _write_tokens(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [T, H, D] into the 16-bit pool at rows [T * H] of _token_rows' form."""
        d = self.cfg.head_dim
        fields = self.pools[HOT].fields[layer]  # [P, H, S, D]
        fields["k"].view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
        fields["v"].view(-1, d).index_copy_(0, rows, v.reshape(-1, d))

    def _auto_compact(self, seq: Sequence, layer: int) -> None:
        """Before a step's first layer: compact a sequence that outgrew the evictor's budget.
        Best effort: a sequence whose offloaded pages have no room to come back stays as it
        is (the append then takes pages as it would without an evictor)."""
        c = self.cfg
        if layer == 0 and self.evictor and c.auto_compact and len(set(seq.lengths)) == 1:
            if seq.lengths[0] >= self.evictor.budget + c.page_size:
                try:
                    self.compact(seq.id)
                except OutOfPages:
                    return  # no room to fetch its offloaded pages: left over budget for now

    def _written(self, seq: Sequence, layer: int, t: int) -> bool:
        """After t tokens of a layer were written: lengths and room for their mass. True once
        every layer has them: the pages that left the 16-bit window may then be quantized."""
        seq.lengths[layer] += t
        seq.grow_mass(seq.lengths[layer])
        return layer == self.cfg.num_layers - 1 or seq.lengths[layer] == min(seq.lengths)

    def _batch(self, seq_ids: Seq[SeqId]) -> list[Sequence]:
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Seq) or not seq_ids:
            raise InputError("seq_ids must be a non-empty list of open sequences")
        seqs = [self._seq(i) for i in seq_ids]
        if len({seq.id for seq in seqs}) != len(seqs):
            raise InputError("seq_ids names a sequence twice")
        return seqs

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.cfg.num_layers:
            raise InputError(f"layer must be an integer in [0, {self.cfg.num_layers}), got {layer!r}")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cfg
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3 or x.shape[1:] != (c.num_kv_heads, c.head_dim) or x.shape[0] < 1:
                raise InputError(
                    f"{name} must have shape [T, {c.num_kv_heads}, {c.head_dim}] with T >= 1, got {list(x.shape)}"
                )
            if x.dtype != c.dtype:
                raise InputError(f"{name} has dtype {x.dtype}; this cache holds {c.dtype}")
            if x.device != c.device and not (x.device.type == c.device.type == "cuda" and c.device.index is None):
                raise InputError(f"{name} is on {x.device}; this cache lives on {c.device}")
        if k.shape != v.shape:
            raise InputError(f"k and v differ in shape: {list(k.shape)} vs {list(v.shape)}")

    def _quantizable(self, seq: Sequence, i: int, length: int) -> bool:
        s = self.cfg.page_size
        return (i + 1) * s <= length - self.cfg.fp_window and i * s >= self.cfg.fp_sink

    def _quantize_ready(self, seqs: list[Sequence]) -> None:
        """Re-encode the sequences' full pages that left the 16-bit sinks and window: one
        quantize-on-write call per layer for all of them (a batch's rows cross a page boundary
        on the same step), then each sequence's pages swapped, released and reported."""
        if not self.codec.quantized:
            return
        s = self.cfg.page_size
        hot, main = self.pools[HOT], self.pools[MAIN]
        plans = []  # (seq, todo, prefix hashes {i: h}, reused {i: main page}, fresh, new main pages)
        planned = {}  # prefix hash -> main page of a shared page quantized by an earlier row here
        for seq in seqs:
            length = min(seq.lengths)
            # the 16-bit pages i with i * s >= fp_sink and (i + 1) * s <= length - fp_window
            idx = self._layout(seq).idx[HOT]
            todo = idx[bisect.bisect_left(idx, -(-self.cfg.fp_sink // s)):
                       bisect.bisect_left(idx, (length - self.cfg.fp_window) // s)]
            if not todo:
                continue
            hashes = {i: self.prefix.hash_of((HOT, int(seq.pages[i].page))) for i in todo}
            reused = {}  # a shared page someone else already quantized: take their copy
            for i, h in hashes.items():
                hit = self.prefix.get(h) if h else None
                if hit and hit[0] == MAIN:
                    reused[i] = hit[1]
                elif h and h in planned:
                    reused[i] = planned[h]
            fresh = [i for i in todo if i not in reused]
            new = main.allocate(len(fresh), seq.subject)
            if new is None:  # no room in the codec pool: the pages stay 16-bit
                continue
            for i, p in zip(fresh, new):
                if hashes[i]:
                    planned.setdefault(hashes[i], p)
            plans.append((seq, todo, hashes, reused, fresh, new))
        src = [PageId(int(seq.pages[i].page)) for seq, _, _, _, fresh, _ in plans for i in fresh]
        dst = [p for *_, new in plans for p in new]
        if src and self.cfg.use_kernels:  # the page ids copied to the device once for every layer
            src_ids, dst_ids = paged.page_ids(src, hot.device), paged.page_ids(dst, main.device)
        for layer in range(self.cfg.num_layers if src else 0):
            if self.cfg.use_kernels:
                paged.quantize_pages(hot.fields[layer], main.fields[layer], src_ids, dst_ids)
            else:
                k, v = hot.decode(layer, src, self.cfg.dtype)
                main.write(layer, dst, self.codec.encode(k, v))
        for seq, todo, hashes, reused, fresh, new in plans:
            old = [PageId(int(seq.pages[i].page)) for i in todo]
            for i, p in zip(fresh, new):
                if hashes[i]:
                    self.prefix.put(hashes[i], (MAIN, p))
                seq.pages[i] = PageRef(MAIN, p, MAIN)
            for i, p in reused.items():
                main.share(PageId(p), seq.subject)
                seq.pages[i] = PageRef(MAIN, p, MAIN)
            self._release(HOT, old, seq.subject)
            self.events.emit(ev.PagesQuantized(
                seq=seq.id, subject=seq.subject, pages=tuple(_pid(MAIN, seq.pages[i].page) for i in todo),
                n_tokens=len(todo) * s, bytes=len(todo) * main.page_bytes,
                codec=self.codec.name, bytes_before=len(todo) * hot.page_bytes))

    def _release(self, pool_name: str, pages: list[PageId], subject: Subject) -> list[PageId]:
        freed = self.pools[pool_name].release(pages, subject)
        for p in freed:
            self.prefix.drop_page((pool_name, int(p)))
        return freed

    # --- read -----------------------------------------------------------------------------------

    @_locked
    def kv(self, seq_id: SeqId, layer: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V over everything the sequence holds, dequantized: [H, L, D]."""
        seq = self._seq(seq_id)
        self._check_layer(layer)
        self._fetch_all(seq)
        dtype = dtype or self.cfg.dtype
        k, v = self._gather(seq.pages, layer, dtype)
        n = seq.lengths[layer]
        return k[:, :n], v[:, :n]

    def _gather(self, refs: list[PageRef], layer: int, dtype: torch.dtype):
        """Decode pages (all on the device) in order: k, v [H, len(refs) * S, D]."""
        c = self.cfg
        if not refs:
            empty = torch.zeros(c.num_kv_heads, 0, c.head_dim, dtype=dtype, device=c.device)
            return empty, empty.clone()
        k = torch.empty(len(refs), c.num_kv_heads, c.page_size, c.head_dim, dtype=dtype, device=c.device)
        v = torch.empty_like(k)
        for name in self.pools:
            slots = [i for i, r in enumerate(refs) if r.where == name]
            if slots:
                pk, pv = self.pools[name].decode(layer, [PageId(int(refs[i].page)) for i in slots], dtype)
                idx = device_index(slots, c.device)
                k[idx], v[idx] = pk, pv
        # [N, H, S, D] -> [H, N*S, D]
        return k.transpose(0, 1).flatten(1, 2), v.transpose(0, 1).flatten(1, 2)

    @_locked
    def attend(self, seq_id: SeqId, layer: int, q: torch.Tensor, *, causal: bool = True,
               scale: float | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] (the sequence's last T positions) over everything
        the sequence holds for this layer. Returns [T, Hq, D]. Accumulates each key's
        attention mass when the evictor scores by it. On the kernel path a decode step
        (T = 1) and a causal chunk read the pages in place; a chunk whose mass the
        evictor needs adds it from a second kernel pass over its keys."""
        seq = self._seq(seq_id)
        c = self.cfg
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1:] != (c.num_query_heads, c.head_dim):
            shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise InputError(f"q must have shape [T, {c.num_query_heads}, {c.head_dim}], got {shape}")
        if q.shape[0] > seq.lengths[layer]:
            raise InputError(f"{q.shape[0]} queries but the sequence holds {seq.lengths[layer]} positions")
        mass_q = 0
        if self.evictor is not None and self.evictor.needs_mass:
            observe = getattr(self.evictor, "observe", None)  # SnapKV: the last `observe` queries vote
            mass_q = q.shape[0] if observe is None else min(observe, q.shape[0])
        if c.use_kernels and q.shape[0] == 1:
            return self._attend_paged([seq], layer, q.contiguous(), scale, mass_q > 0)
        if c.use_kernels and causal:
            return self._prefill_paged(seq, layer, q.contiguous(), scale, mass_q)
        k, v = self.kv(seq_id, layer, dtype=torch.float32)
        out, mass = dense_attention(q, k, v, causal=causal, mass_queries=mass_q, scale=scale)
        if mass is not None:
            seq.mass_buf[layer, :, : mass.shape[-1]] += mass
        return out

    @_locked
    def attend_step(self, seq_ids: Seq[SeqId], layer: int, q: torch.Tensor, *,
                    scale: float | None = None) -> torch.Tensor:
        """Decode attention of a batch: q [B, Hq, D], row i the last position of seq_ids[i],
        over what each sequence holds for this layer. Returns [B, Hq, D]. On the kernel path
        the whole batch is one pass of the decode kernels; accumulates attention mass as
        `attend` does."""
        seqs = self._batch(seq_ids)
        c = self.cfg
        self._check_layer(layer)
        if (not isinstance(q, torch.Tensor) or q.dim() != 3
                or q.shape != (len(seqs), c.num_query_heads, c.head_dim)):
            shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise InputError(f"q must have shape [{len(seqs)}, {c.num_query_heads}, {c.head_dim}], got {shape}")
        for seq in seqs:
            if seq.lengths[layer] < 1:
                raise InputError(f"sequence {seq.id} holds no position at layer {layer}")
        if not c.use_kernels:
            return torch.cat([self.attend(seq.id, layer, q[i : i + 1], scale=scale) for i, seq in enumerate(seqs)])
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise InputError(f"q has dtype {q.dtype}; the decode kernels take float16 or bfloat16")
        with_mass = self.evictor is not None and self.evictor.needs_mass
        return self._attend_paged(seqs, layer, q.contiguous(), scale, with_mass)

    @_locked
    def attend_chunk(self, seq_ids: Seq[SeqId], layer: int, q: torch.Tensor, counts: Seq[int] | None = None, *,
                     scale: float | None = None) -> torch.Tensor:
        """Causal attention of a batch's chunk: q [B, T, Hq, D], of which row i's last counts[i]
        queries are its sequence's last counts[i] positions and the rest padding (zeros out;
        default: all T), over what each sequence holds for this layer. Returns [B, T, Hq, D]. On
        the kernel path every row is one launch of the prefill kernel per pool; a chunk whose
        mass the evictor needs takes each row's own `attend`."""
        seqs = self._batch(seq_ids)
        c = self.cfg
        self._check_layer(layer)
        if (not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != len(seqs)
                or q.shape[2:] != (c.num_query_heads, c.head_dim)):
            shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise InputError(f"q must have shape [{len(seqs)}, T, {c.num_query_heads}, {c.head_dim}], got {shape}")
        t = q.shape[1]
        counts = self._counts(counts, len(seqs), t)
        for seq, n in zip(seqs, counts):
            if n > seq.lengths[layer]:
                raise InputError(f"{n} queries but sequence {seq.id} holds {seq.lengths[layer]} positions")
        mass = self.evictor is not None and self.evictor.needs_mass
        if not c.use_kernels or mass or q.dtype not in (torch.float16, torch.bfloat16):  # each row its own
            out = q.new_zeros(q.shape)
            for i, (seq, n) in enumerate(zip(seqs, counts)):
                if n:
                    out[i, t - n:] = self.attend(seq.id, layer, q[i, t - n:], scale=scale).to(q.dtype)
            return out
        for seq in seqs:
            self._fetch_all(seq)
        return self._prefill_batch(seqs, layer, q.contiguous(), counts, scale)

    def _prefill_batch(self, seqs: list[Sequence], layer: int, q: torch.Tensor, counts: list[int],
                       scale: float | None) -> torch.Tensor:
        """attend_chunk on the kernel path: per pool, each query sees the pool's tokens at or
        before its position (`limits`, as _prefill_paged), every row in one launch; the pools'
        partials merged by log-sum-exp in one pass."""
        sets, used = self._decode_sets(seqs, layer)
        t = q.shape[1]
        lengths = tuple(seq.lengths[layer] for seq in seqs)
        # the queries' positions, -1 for padding (which then sees no key)
        at = self._device_ints(("queries", lengths, tuple(counts), t), lambda: [
            [n - t + j if j >= t - k else -1 for j in range(t)] for n, k in zip(lengths, counts)])
        parts = []
        lays = [self._layout(seq) for seq in seqs]
        for (fields, table, tokens), (name, _) in zip(sets, used):
            # the same for every layer of the chunk: kept while the rows' pages hold
            limits = self._while_pages_hold(
                ("limits", name, lengths, tuple(counts), t, tuple(seq.id for seq in seqs)), lays,
                lambda name=name: torch.searchsorted(self._batch_positions(seqs, name, pad=2**62), at,
                                                     right=True).to(torch.int32))
            lens = self._device_ints(("lens", tuple(tokens)), lambda tokens=tokens: tokens, torch.int32)
            parts.append((fields, table, lens, max(tokens), limits))
        return paged.prefill_batch(q, parts, scale)

    def _attend_paged(self, seqs: list[Sequence], layer: int, q: torch.Tensor, scale: float | None,
                      with_mass: bool) -> torch.Tensor:
        """Decode of q [B, Hq, D] (one token per sequence) through the Triton kernels: every
        pool's pages of every row in one pass (paged_decode_sets), the block tables from each
        sequence's layout, no walk over the pages and no host sync."""
        for seq in seqs:
            self._fetch_all(seq)
        return paged.decode(q, *self._decode_args(seqs, layer, with_mass), scale=scale)

    def _decode_args(self, seqs: list[Sequence], layer: int, with_mass: bool):
        """paged.decode's sets, lens and mass_into for one layer of a batch step."""
        sets, used = self._decode_sets(seqs, layer)
        tokens = tuple(tuple(t) for _, t in used)
        lens = self._device_ints(("lens", tokens), lambda: tokens, torch.int32)  # [sets, B]
        into = None
        if with_mass:  # the kernels add each key's mass into the row's totals at the key's position
            buffers = [seq.mass_buf[layer] for seq in seqs]
            into = [(buffers, self._positions(seqs[0], name)[None] if len(seqs) == 1
                     else self._batch_positions(seqs, name)) for name, _ in used]
        return sets, lens, into

    def _prefill_paged(self, seq: Sequence, layer: int, q: torch.Tensor, scale: float | None,
                       mass_q: int = 0) -> torch.Tensor:
        """Causal attention of a chunk q [T, Hq, D] (the last T positions) through the prefill
        kernel, once per pool, merged by log-sum-exp. A pool's tokens may be older or newer
        than a query (the chunk's own pages may already be quantized), so each query sees, in
        each pool, the tokens at or before its position: a count per query (`limits`). With
        mass_q, the last mass_q queries' attention mass is added into the sequence's totals."""
        self._fetch_all(seq)
        sets, used = self._decode_sets([seq], layer)
        n, t = seq.lengths[layer], q.shape[0]
        at = torch.arange(n - t, n, device=q.device)  # the queries' positions
        parts = [(fields, table[0], tokens[0], self._positions(seq, name)[: tokens[0]])
                 for (fields, table, tokens), (name, _) in zip(sets, used)]
        return paged.prefill(q, parts, at, scale, seq.mass_buf[layer] if mass_q else None, mass_q)

    def _positions(self, seq: Sequence, name: str) -> torch.Tensor:
        """Positions of a pool's tokens in the kernels' order (ascending): token j of the pool is
        position idx[j // S] * S + j % S. Kept with the layout."""
        lay, s = self._layout(seq), self.cfg.page_size
        pos = lay.positions.get(name)
        if pos is None:
            dev = self.cfg.device
            pos = lay.positions[name] = (device_index(lay.idx[name], dev).unsqueeze(1) * s
                                         + torch.arange(s, device=dev)).flatten()
        return pos

    def _decode_sets(self, seqs: list[Sequence], layer: int):
        """paged.decode's sets for one layer: (fields, block table [B, *], tokens per row) per pool
        holding some of the rows' tokens, and (pool, tokens per row) of each. A row's table holds
        all its pages of the pool in order; only the first `tokens` are read (a page past this
        layer's tokens is another layer's new one)."""
        lays = [self._layout(seq) for seq in seqs]
        sets, used = [], []
        for name in self.pools:
            tokens = [self._held(lay, name, seq.lengths[layer]) for seq, lay in zip(seqs, lays)]
            if any(tokens):
                table = lays[0].tables[name] if len(seqs) == 1 else self._batch_table(seqs, lays, name)
                sets.append((self.pools[name].fields[layer], table, tokens))
                used.append((name, tokens))
        return sets, used

    def _held(self, lay: Layout, name: str, n: int) -> int:
        """How many of a sequence's first n positions one pool holds."""
        s = self.cfg.page_size
        need = -(-n // s)  # pages the n positions fill
        idx = lay.idx[name]
        count = bisect.bisect_left(idx, need)
        partial = need * s - n if count and idx[count - 1] == need - 1 else 0  # only the last page
        return count * s - partial

    def _batch_table(self, seqs: list[Sequence], lays: list[Layout], name: str) -> torch.Tensor:
        """[B, most pages] int32 block table of several sequences in one pool, zero-padded."""
        def build():
            empty = torch.zeros(0, dtype=torch.int32)
            rows = torch.nn.utils.rnn.pad_sequence([lay.host.get(name, empty) for lay in lays], batch_first=True)
            return rows.to(self.cfg.device, non_blocking=True)

        return self._while_pages_hold(("table", name, tuple(seq.id for seq in seqs)), lays, build)

    def _batch_positions(self, seqs: list[Sequence], name: str, pad: int = -1) -> torch.Tensor:
        """[B, most pages * S] positions of several sequences' tokens in one pool, in the order
        of _batch_table's rows (ascending), padded with `pad`: -1 for the mass kernels, which
        skip it, or a position past any query's for searchsorted."""
        lays = [self._layout(seq) for seq in seqs]

        def build():
            empty = torch.zeros(0, dtype=torch.long, device=self.cfg.device)
            rows = [self._positions(seq, name) if lay.idx[name] else empty for seq, lay in zip(seqs, lays)]
            return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)

        return self._while_pages_hold(("positions", name, pad, tuple(seq.id for seq in seqs)), lays, build)

    def _while_pages_hold(self, key: tuple, lays: list[Layout], build) -> torch.Tensor:
        """build(), kept under key while no row's pages change (the same for every layer of a
        step, and for the steps until a row's next page): an LRU of the last few batches'."""
        versions = tuple(lay.version for lay in lays)
        hit = self._tables.get(key)
        if hit is not None and hit[0] == versions:
            self._tables.move_to_end(key)
            return hit[1]
        value = build()
        self._tables[key] = (versions, value)
        while len(self._tables) > 32:
            self._tables.popitem(last=False)
        return value

    def _device_ints(self, key: tuple, values, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host ints (`values()`) as a tensor on the cache's device, kept under `key` for the
        other layers of the step, which ask for the same ones (the rows a step writes, the
        tokens it reads): one host-to-device copy a step, not one a layer. An LRU of the last
        few; the tensors are only read."""
        hit = self._ints.get(key)
        if hit is not None and hit.dtype == dtype:
            self._ints.move_to_end(key)
            return hit
        t = self._ints[key] = device_index(values(), self.cfg.device, dtype)
        while len(self._ints) > 64:
            self._ints.popitem(last=False)
        return t

    def _layout(self, seq: Sequence) -> Layout:
        """The sequence's pages per pool, rebuilt only when its page list changed."""
        lay = seq.layout
        if lay is not None and lay.version == seq.pages.version:
            return lay
        idx: dict[str, list[int]] = {name: [] for name in self.pools}
        away = 0
        for i, r in enumerate(seq.pages):
            if r.where in idx:
                idx[r.where].append(i)
            else:
                away += 1
        host, tables = {}, {}
        if self.cfg.use_kernels:
            for name, ix in idx.items():
                if ix:
                    host[name] = torch.tensor([int(seq.pages[i].page) for i in ix], dtype=torch.int32)
                    tables[name] = host[name].view(1, -1).to(self.cfg.device, non_blocking=True)
        seq.layout = Layout(seq.pages.version, idx, host, tables, away)
        return seq.layout

    # --- evict ----------------------------------------------------------------------------------

    @_locked
    def compact(self, seq_id: SeqId) -> ev.TokensEvicted | None:
        """Run the evictor and move the survivors into fewer pages, freeing the rest.
        Returns the event, or None when nothing was evicted (within budget, or no
        free page to compact into). Raises OutOfPages, changing nothing, when the
        sequence's offloaded pages have no room to come back to the device."""
        seq = self._seq(seq_id)
        if self.evictor is None:
            raise ConfigError("this cache has no evictor; configure one to compact")
        if len(set(seq.lengths)) != 1:
            raise InputError("compact between steps: every layer must hold the same number of tokens")
        length, s = seq.lengths[0], self.cfg.page_size
        keep = self.evictor.select(length, seq.mass[..., :length].cpu())
        if keep is None:
            return None
        c = self.cfg
        if keep.dim() == 1:  # one set for the sequence: the same positions in every layer and head
            keep = keep.expand(c.num_layers, c.num_kv_heads, keep.shape[0])
        new_len = keep.shape[-1]
        ident = (keep == torch.arange(new_len)).flatten(0, -2).all(0).int()
        same = int(ident.cumprod(0).sum())  # leading positions that move in no layer or head
        first = same // s  # pages before this one stay as they are
        self._fetch_all(seq)
        old_refs = seq.pages[first:]
        # per layer and head, the surviving positions from page `first` on (rows are sorted
        # and their first `same` >= first * s entries are 0, 1, 2, ...)
        rel = (keep[..., first * s:] - first * s).to(c.device)  # [layers, H, new_len - first * s]
        n_new = math.ceil((new_len - first * s) / s)
        main_slots = [j for j in range(n_new) if self.codec.quantized and self._quantizable(seq, first + j, new_len)
                      and (first + j + 1) * s <= new_len]
        hot_slots = [j for j in range(n_new) if j not in main_slots]
        got_hot = self.pools[HOT].allocate(len(hot_slots), seq.subject)
        got_main = self.pools[MAIN].allocate(len(main_slots), seq.subject) if main_slots else []
        if got_hot is None or got_main is None:
            if got_hot:
                self._release(HOT, got_hot, seq.subject)
            if got_main:
                self._release(MAIN, got_main, seq.subject)
            return None
        new_refs = [None] * n_new
        for j, p in zip(hot_slots, got_hot):
            new_refs[j] = PageRef(HOT, p, HOT)
        for j, p in zip(main_slots, got_main):
            new_refs[j] = PageRef(MAIN, p, MAIN)
        for layer in range(c.num_layers):
            k, v = self._gather(old_refs, layer, c.dtype)  # [H, n_old*S, D]
            idx = rel[layer].unsqueeze(-1).expand(-1, -1, c.head_dim)
            k, v = k.gather(1, idx), v.gather(1, idx)
            pad = n_new * s - k.shape[1]
            if pad:
                z = torch.zeros(c.num_kv_heads, pad, c.head_dim, dtype=c.dtype, device=c.device)
                k, v = torch.cat([k, z], 1), torch.cat([v, z], 1)
            # [H, N*S, D] -> [N, H, S, D]
            k = k.reshape(c.num_kv_heads, n_new, s, c.head_dim).transpose(0, 1)
            v = v.reshape(c.num_kv_heads, n_new, s, c.head_dim).transpose(0, 1)
            for name, slots, got in ((HOT, hot_slots, got_hot), (MAIN, main_slots, got_main)):
                if not slots:
                    continue
                pool = self.pools[name]
                if name == MAIN and c.use_kernels:  # requantized by the kernel that quantizes on write
                    paged.encode_pages(k[slots].contiguous(), v[slots].contiguous(), pool.fields[layer], got)
                else:
                    pool.write(layer, got, pool.codec.encode(k[slots], v[slots]))
        freed = []
        for name in self.pools:
            pages = [PageId(int(r.page)) for r in old_refs if r.where == name]
            if pages:
                freed += [_pid(name, p) for p in self._release(name, pages, seq.subject)]
        seq.pages = seq.pages[:first] + new_refs
        seq.lengths = [new_len] * c.num_layers
        # H2O's mass accumulates for good; SnapKV's votes are those of the queries since the
        # last compaction (its observation window in decode), so they start again from zero
        old_mass = seq.mass_buf
        seq.mass = (torch.zeros_like(seq.mass_buf[..., :new_len]) if self.evictor.fresh_votes
                    else seq.mass_buf.gather(-1, keep.to(seq.mass_buf.device)))
        old_mass.zero_()
        seq.evicted += length - new_len
        seq.positional = False
        if got_main:  # the survivors written into codec pages were (re)quantized
            main, hot = self.pools[MAIN], self.pools[HOT]
            self.events.emit(ev.PagesQuantized(
                seq=seq.id, subject=seq.subject, pages=tuple(_pid(MAIN, p) for p in got_main),
                n_tokens=len(got_main) * s, bytes=len(got_main) * main.page_bytes,
                codec=self.codec.name, bytes_before=len(got_main) * hot.page_bytes))
        event = ev.TokensEvicted(
            seq=seq.id, subject=seq.subject, pages=tuple(freed), n_tokens=length - new_len,
            bytes=self._bytes_of(freed),
            evictor=self.evictor.name, kept=new_len)
        self.events.emit(event)
        return event

    def _bytes_of(self, pages: Seq[str]) -> int:
        """Bytes of pages named "<pool>:<page>", as events name them."""
        return sum(self.pools[p.split(":")[0]].page_bytes for p in pages)

    # --- offload / fetch ------------------------------------------------------------------------

    @_locked
    def offload(self, seq_id: SeqId, tier: str, max_pages: int | None = None) -> int:
        """Move the sequence's oldest full device pages that no other sequence shares
        to a lower tier, freeing device pages. Returns how many moved."""
        seq = self._seq(seq_id)
        if tier not in self.tiers:
            raise ConfigError(f"unknown tier {tier!r}; this cache has {sorted(self.tiers) or 'none'}")
        full = min(seq.lengths) // self.cfg.page_size
        cand = [i for i, r in enumerate(seq.pages[:full])
                if r.where in self.pools and self.pools[r.where].ref[int(r.page)] == 1]
        cand = cand[:max_pages] if max_pages is not None else cand
        if not cand:
            return 0
        moved, nbytes, stored = [], 0, 0
        try:
            for i in cand:
                r = seq.pages[i]
                key = f"{seq.id}-{uuid.uuid4().hex}"
                try:
                    stored += self.tiers[tier].put(key, self.pools[r.where].page_blob(PageId(int(r.page))))
                except BaseException:  # the tier may have stored it before failing (a reply lost)
                    self._erase_or_keep(seq, tier, key)
                    raise
                nbytes += self.pools[r.where].page_bytes
                self._release(r.where, [PageId(int(r.page))], seq.subject)
                moved.append(_pid(r.where, r.page))
                seq.pages[i] = PageRef(tier, key, r.where)
        finally:  # pages moved before a failing put are recorded too
            if moved:
                self.events.emit(ev.PagesOffloaded(seq=seq.id, subject=seq.subject, pages=tuple(moved),
                                                   n_tokens=len(moved) * self.cfg.page_size, bytes=nbytes,
                                                   src="device", dst=tier, stored_bytes=stored))
        return len(moved)

    def _fetch_all(self, seq: Sequence) -> None:
        """Bring the sequence's offloaded pages back to the device. Raises OutOfPages, having
        moved nothing, when a pool has too few free pages for them. A tier read that fails
        stops the fetch there: the pages brought back before stay fetched, the failing one
        stays in its tier and no device page is left taken."""
        if not self._layout(seq).away:
            return
        away = [i for i, r in enumerate(seq.pages) if r.where not in self.pools]
        need: dict[str, int] = {}
        for i in away:
            need[seq.pages[i].pool] = need.get(seq.pages[i].pool, 0) + 1
        for pool, n in need.items():
            if self.pools[pool].free_count < n:
                raise OutOfPages(f"no free {pool} page to fetch an offloaded page back into ({n} needed, "
                                 f"{self.pools[pool].free_count} free); free or offload other sequences first")
        by_tier: dict[str, list[int]] = {}
        for i in away:
            by_tier.setdefault(seq.pages[i].where, []).append(i)
        for tier, idxs in by_tier.items():
            got, nbytes = [], 0
            try:
                for i in idxs:
                    r = seq.pages[i]
                    blob = self.tiers[tier].get(str(r.page))
                    new = self.pools[r.pool].allocate(1, seq.subject)  # room checked above
                    try:
                        self.pools[r.pool].load_blob(new[0], blob)
                    except BaseException:  # the copy stays the page's one home: the device page goes back
                        self._release(r.pool, new, seq.subject)
                        raise
                    # the device page holds it now; a copy that cannot be erased (it may be half
                    # overwritten) is kept on the sequence and erased with it
                    seq.pages[i] = PageRef(r.pool, new[0], r.pool)
                    self._erase_or_keep(seq, tier, str(r.page))
                    got.append(_pid(r.pool, new[0]))
                    nbytes += self.pools[r.pool].page_bytes
            finally:  # pages fetched before a failure are recorded too
                if got:
                    self.events.emit(ev.PagesFetched(seq=seq.id, subject=seq.subject, pages=tuple(got),
                                                     n_tokens=len(got) * self.cfg.page_size, bytes=nbytes,
                                                     src=tier, dst="device"))

    # --- free / erase ---------------------------------------------------------------------------

    def _erase_or_keep(self, seq: Sequence, tier: str, key: str) -> None:
        try:
            self.tiers[tier].erase(key)
        except Exception:
            seq.stale.append((tier, key))

    def _erase_copies(self, seqs: list[Sequence]) -> int:
        """Erase every lower-tier copy of the sequences, before anything else of theirs is
        released: a tier that fails then leaves them whole, and erasing again is harmless (a
        tier erases an absent key without error), so the operation can simply be retried.
        Returns the copies erased; raises TierError, having tried every copy."""
        n, failed, first = 0, 0, None
        for seq in seqs:
            copies = [(r.where, str(r.page)) for r in seq.pages if r.where not in self.pools]
            for tier, key in copies + seq.stale:
                try:
                    self.tiers[tier].erase(key)
                    n += 1
                except Exception as e:
                    failed, first = failed + 1, first or e
        if failed:
            raise TierError(f"{failed} of {n + failed} lower-tier copies could not be erased "
                            f"({type(first).__name__}); nothing was released: retry when the tier is back") from first
        return n

    def _drop(self, seq: Sequence) -> tuple[list[str], int, int]:
        """Release every device page of a sequence (its tier copies erased first); returns
        (freed pages, shared pages kept for others, prefix entries removed)."""
        freed, shared, prefix = [], 0, 0
        for r in seq.pages:
            if r.where in self.pools:
                if self.prefix.drop_page((r.where, int(r.page))):
                    prefix += 1
                got = self._release(r.where, [PageId(int(r.page))], seq.subject)
                freed += [_pid(r.where, p) for p in got]
                shared += not got
        seq.mass_buf.zero_()
        del self._seqs[seq.id]
        return freed, shared, prefix

    @_locked
    def free(self, seq_id: SeqId) -> None:
        """End a sequence: its pages are overwritten and freed unless another sequence
        shares them; its prefix-index entries stay for the pages still shared. Raises
        TierError, releasing nothing, when a tier copy cannot be erased."""
        seq = self._seq(seq_id)
        copies = self._erase_copies([seq])
        freed = []
        for r in seq.pages:
            if r.where in self.pools:
                freed += [_pid(r.where, p) for p in self._release(r.where, [PageId(int(r.page))], seq.subject)]
        seq.mass_buf.zero_()
        del self._seqs[seq.id]
        self.events.emit(ev.SequenceFreed(seq=seq.id, subject=seq.subject, pages=tuple(freed),
                                          n_tokens=max(seq.lengths),
                                          bytes=self._bytes_of(freed),
                                          tier_copies=copies))

    @_locked
    def erase_user(self, tenant: str, user: str) -> ev.SubjectErased:
        return self._erase("user", lambda s: s.tenant == tenant and s.user == user, Subject(tenant, user, "*"))

    @_locked
    def erase_session(self, tenant: str, session: str) -> ev.SubjectErased:
        return self._erase("session", lambda s: s.tenant == tenant and s.session == session,
                           Subject(tenant, "*", session))

    def _erase(self, scope: str, match, who: Subject) -> ev.SubjectErased:
        """Erase every sequence of a subject: pages nobody else holds are overwritten
        and freed; shared pages lose the subject and their prefix-index entries. Every
        lower-tier copy is erased first: a tier that fails raises TierError with nothing
        released and nothing recorded, and the erasure can be run again."""
        freed, shared, prefix, n, tokens = [], 0, 0, 0, 0
        seqs = [s for s in self._seqs.values() if match(s.subject)]
        tiers = self._erase_copies(seqs)
        for seq in seqs:
            f, sh, p = self._drop(seq)
            freed += f
            shared, prefix, n = shared + sh, prefix + p, n + 1
            tokens += max(seq.lengths)
        nbytes = self._bytes_of(freed)
        event = ev.SubjectErased(seq=None, subject=who, pages=tuple(freed), n_tokens=tokens, bytes=nbytes,
                                 scope=scope, sequences=n, shared_pages=shared, tier_copies=tiers,
                                 prefix_entries=prefix)
        self.events.emit(event)
        return event

    # --- accounting -----------------------------------------------------------------------------

    @_locked
    def stats(self) -> CacheStats:
        c = self.cfg
        tokens = sum(max(s.lengths) for s in self._seqs.values())
        bytes_held = sum(p.used_count * p.page_bytes for p in self.pools.values())
        per_token_16 = self.pools[HOT].page_bytes / c.page_size
        slots = sum(len([r for r in s.pages if r.where in self.pools]) for s in self._seqs.values()) * c.page_size
        off: dict[str, int] = {}
        for s in self._seqs.values():
            for r in s.pages:
                if r.where not in self.pools:
                    off[r.where] = off.get(r.where, 0) + 1
        return CacheStats(
            codec=self.codec.name, evictor=self.evictor.name if self.evictor else None,
            sequences=len(self._seqs), tokens_held=tokens,
            tokens_evicted=sum(s.evicted for s in self._seqs.values()),
            pages_used={n: p.used_count for n, p in self.pools.items()},
            pages_free={n: p.free_count for n, p in self.pools.items()},
            pages_offloaded=off,
            bytes_per_token={n: p.page_bytes / c.page_size for n, p in self.pools.items()},
            bytes_held=bytes_held,
            bytes_16bit_equivalent=int((tokens + sum(s.evicted for s in self._seqs.values())) * per_token_16),
            waste_slots=max(0, slots - tokens),
        )
