"""A cache for a model whose layers differ in reach: sliding-window layers beside global ones.

A page holds every layer of its cache, so a sliding-window layer's pages could not be freed
while a global layer still reads the same tokens. `open_manager` gives each kind of layer a
`CacheManager` of its own: the global layers one with the configuration as given (codec,
evictor and its budget, K/V split, tiers), each window its own sliding-window cache (window.py:
the same codec and 16-bit sinks-free window, no evictor, no split, no lower tier), whose pages
are freed as they fall out of the window and never count against the global layers' pool or
budget. `LayeredManager` routes each call to the part that holds the layer, under one lock.

One sequence id names a request in every part (each part opens one for it, in step), so events
and erasures name it once. Events of a window part name its pages "window<W>-<pool>:<page>";
a sequence's `free` and an erasure are one event each, their pages and bytes summed over the
parts. Prompt pages are not shared between requests here: a part that found a prefix the other
did not would hold another count of tokens.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from ..errors import ConfigError
from ..types import SeqId, Subject
from . import events as ev
from .config import CacheConfig
from .manager import CacheManager, CacheStats
from .tiers import Tier


def open_manager(config: CacheConfig, *, events: ev.EventQueue | None = None,
                 tiers: dict[str, Tier] | None = None) -> CacheManager | LayeredManager:
    """The cache for `config`: a CacheManager when its layers are alike (all global, or all of one
    window), else a LayeredManager over one per kind of layer."""
    windows = config.layer_windows
    if windows is None:
        return CacheManager(config, events=events, tiers=tiers)
    if len(set(windows)) == 1:
        return CacheManager(_window_config(config, windows[0], len(windows)), events=events, tiers=tiers)
    return LayeredManager(config, events=events, tiers=tiers)


def _window_config(c: CacheConfig, window: int, layers: int) -> CacheConfig:
    return replace(c, num_layers=layers, layer_windows=None, window=window, evictor=None, evictor_options={},
                   kv_split=None, fp_sink=0, use_kernels=False, tiers=())


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class _PartEvents:
    """A part's event queue: its events go on to the layered manager's queue of the moment (a
    consumer may hand it its own), pages renamed for a window part; a free's or an erasure's
    event is held back while `LayeredManager` merges them."""

    def __init__(self, owner: LayeredManager, prefix: str):
        self.owner = owner
        self.prefix = prefix

    def emit(self, event: ev.CacheEvent) -> None:
        if self.prefix:
            event = replace(event, pages=tuple(self.prefix + p for p in event.pages))
        held = self.owner._held
        if held is not None and isinstance(event, (ev.SequenceFreed, ev.SubjectErased)):
            held.append(event)
        else:
            self.owner.events.emit(event)


class LayeredManager:
    """The CacheManager calls of a model whose sliding-window and global layers are cached apart.

    `cfg` is the whole model's configuration; each part has its own (`parts`, keyed by window,
    None for the global layers). `pools`, `evictor`, `compact`, `offload` and `split_cold` are
    the global layers' (what a serving engine plans and budgets with); a window part's pool is
    sized as the configuration's pools, and holds a sequence's last window + one page of tokens.
    """

    def __init__(self, config: CacheConfig, *, events: ev.EventQueue | None = None,
                 tiers: dict[str, Tier] | None = None):
        c = config
        if c.layer_windows is None or len(set(c.layer_windows)) < 2:
            raise ConfigError("LayeredManager caches layers of different windows: use open_manager")
        self.events = events if events is not None else ev.EventQueue()
        self.lock = threading.RLock()
        self._held: list[ev.CacheEvent] | None = None
        groups: dict[int | None, list[int]] = {}
        for i, w in enumerate(c.layer_windows):
            groups.setdefault(w, []).append(i)
        self.parts: dict[int | None, CacheManager] = {}
        self.route: list[tuple[CacheManager, int]] = [None] * c.num_layers  # model layer -> (part, its layer)
        for w in sorted(groups, key=lambda w: (w is not None, w or 0)):  # the global part first
            layers = groups[w]
            if w is None:
                part_cfg = replace(c, num_layers=len(layers), layer_windows=None, prefix_sharing=False)
                part = CacheManager(part_cfg, events=_PartEvents(self, ""), tiers=tiers)
            else:
                part = CacheManager(_window_config(c, w, len(layers)), events=_PartEvents(self, f"window{w}-"))
            part.lock = self.lock
            self.parts[w] = part
            for j, i in enumerate(layers):
                self.route[i] = (part, j)
        self.main = self.parts.get(None) or next(iter(self.parts.values()))  # the global layers' part
        # the model's configuration as callers read it: no prompt pages shared; the reads of the
        # window layers take the reference path, so callers do not batch for the kernels
        self.cfg = replace(c, prefix_sharing=False, use_kernels=False)

    # --- what callers read of a manager ----------------------------------------------------------

    @property
    def pools(self):
        return self.main.pools

    @property
    def evictor(self):
        return self.main.evictor

    @property
    def codec(self):
        return self.main.codec

    @property
    def split(self):
        return self.main.split

    def _part(self, layer: int) -> tuple[CacheManager, int]:
        if not isinstance(layer, int) or not 0 <= layer < len(self.route):
            raise ConfigError(f"layer {layer!r} is not one of this cache's {len(self.route)} layers")
        return self.route[layer]

    # --- sequences ------------------------------------------------------------------------------

    @_locked
    def open(self, subject: Subject, tokens: Seq[int] | None = None) -> SeqId:
        """Open a sequence in every part, under one id (`tokens` are not looked up: see the module)."""
        ids = {part.open(subject) for part in self.parts.values()}
        if len(ids) != 1:
            raise RuntimeError(f"the parts opened sequences {sorted(ids)}: every open must go through the "
                               "LayeredManager")
        return ids.pop()

    @_locked
    def announce_open(self, seq_id: SeqId, policy: str) -> ev.SequenceOpened:
        return self.main.announce_open(seq_id, policy)

    def publish_prefix(self, seq_id: SeqId, tokens: Seq[int]) -> int:
        raise ConfigError("a cache of sliding-window and global layers shares no prompt pages")

    def length(self, seq_id: SeqId, layer: int = 0) -> int:
        part, j = self._part(layer)
        return part.length(seq_id, j)

    def sequences(self) -> list[SeqId]:
        return self.main.sequences()

    def subject_of(self, seq_id: SeqId) -> Subject:
        return self.main.subject_of(seq_id)

    # --- write, read: the layer's part ----------------------------------------------------------

    def append(self, seq_id: SeqId, layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        part, j = self._part(layer)
        return part.append(seq_id, j, k, v)

    def append_step(self, seq_ids: Seq[SeqId], layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        part, j = self._part(layer)
        return part.append_step(seq_ids, j, k, v)

    def append_chunk(self, seq_ids: Seq[SeqId], layer: int, k: torch.Tensor, v: torch.Tensor,
                     counts: Seq[int] | None = None) -> bool:
        part, j = self._part(layer)
        return part.append_chunk(seq_ids, j, k, v, counts)

    def kv(self, seq_id: SeqId, layer: int, dtype: torch.dtype | None = None):
        part, j = self._part(layer)
        return part.kv(seq_id, j, dtype)

    def attend(self, seq_id: SeqId, layer: int, q: torch.Tensor, *, causal: bool = True,
               scale: float | None = None) -> torch.Tensor:
        part, j = self._part(layer)
        return part.attend(seq_id, j, q, causal=causal, scale=scale)

    def attend_step(self, seq_ids: Seq[SeqId], layer: int, q: torch.Tensor, *,
                    scale: float | None = None) -> torch.Tensor:
        part, j = self._part(layer)
        return part.attend_step(seq_ids, j, q, scale=scale)

    def attend_chunk(self, seq_ids: Seq[SeqId], layer: int, q: torch.Tensor, counts: Seq[int] | None = None, *,
                     scale: float | None = None) -> torch.Tensor:
        part, j = self._part(layer)
        return part.attend_chunk(seq_ids, j, q, counts, scale=scale)

    # --- evict, offload: the global layers ------------------------------------------------------

    def compact(self, seq_id: SeqId) -> ev.TokensEvicted | None:
        return self.main.compact(seq_id)

    def offload(self, seq_id: SeqId, tier: str, max_pages: int | None = None) -> int:
        return self.main.offload(seq_id, tier, max_pages)

    def split_cold(self, seq_id: SeqId) -> int:
        return self.main.split_cold(seq_id)

    # --- free, erase: every part, one event -----------------------------------------------------

    def _merged(self, run):
        """Run `run(part)` on every part, their free or erase events held back, then emit one
        event of them all (pages and bytes summed) and return it."""
        self._held = held = []
        try:
            for part in self.parts.values():
                run(part)
        finally:
            self._held = None
        if not held:
            return None
        first = held[0]
        sums = {"pages": tuple(p for e in held for p in e.pages), "bytes": sum(e.bytes for e in held),
                "n_tokens": max(e.n_tokens for e in held), "tier_copies": sum(e.tier_copies for e in held)}
        if isinstance(first, ev.SubjectErased):
            sums |= {"shared_pages": sum(e.shared_pages for e in held),
                     "prefix_entries": sum(e.prefix_entries for e in held),
                     "sequences": max(e.sequences for e in held)}
        event = replace(first, **sums)
        self.events.emit(event)
        return event

    @_locked
    def free(self, seq_id: SeqId) -> None:
        self.main.subject_of(seq_id)  # unknown: raises before any part frees
        self._merged(lambda part: part.free(seq_id))

    @_locked
    def erase_user(self, tenant: str, user: str) -> ev.SubjectErased:
        return self._merged(lambda part: part.erase_user(tenant, user))

    @_locked
    def erase_session(self, tenant: str, session: str) -> ev.SubjectErased:
        return self._merged(lambda part: part.erase_session(tenant, session))

    # --- accounting -----------------------------------------------------------------------------

    @_locked
    def stats(self) -> CacheStats:
        """The parts' stats summed, pool by pool ("hot", "main", ...: a token's bytes per token
        over every layer; what each part holds alone is `parts[w].stats()`)."""
        parts = [p.stats() for p in self.parts.values()]
        main = self.main.stats()

        def pools(field):
            out: dict = {}
            for st in parts:
                for n, x in getattr(st, field).items():
                    out[n] = out.get(n, 0) + x
            return out

        return CacheStats(
            codec=main.codec, evictor=main.evictor, sequences=main.sequences,
            tokens_held=max(st.tokens_held for st in parts), tokens_evicted=main.tokens_evicted,
            pages_used=pools("pages_used"), pages_free=pools("pages_free"), pages_offloaded=main.pages_offloaded,
            bytes_per_token=pools("bytes_per_token"), bytes_held=sum(st.bytes_held for st in parts),
            bytes_16bit_equivalent=sum(st.bytes_16bit_equivalent for st in parts),
            waste_slots=sum(st.waste_slots for st in parts),
            bytes_on_device=sum(st.bytes_on_device for st in parts))
