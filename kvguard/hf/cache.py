"""kvguard as the KV cache of a transformers 5.x model.

`KVGuardCache` is a `transformers.Cache` built on the layered API: one
`KVGuardLayer` per decoder layer, none of which holds a tensor. Each batch row is
one sequence of a kvguard `CacheManager`, owned by the subject given when the
cache is made. The "kvguard" attention function (attention.py) hands each
layer's new K/V and queries to `KVGuardCache.attend`, which writes the K/V of the
row's real (non-padding) tokens into its pages and attends over what the pages
hold through `CacheManager.attend`: codecs, evictors, tiers and events all apply
to what the model reads.

Positions are the model's business: `get_seq_length` counts every token fed
(as `DynamicCache` does), not the tokens held, so RoPE positions keep counting
after an evictor has dropped tokens. Keys are stored after RoPE.

A model whose config mixes sliding-window layers with global ones (`layer_types`, Gemma 3)
gets a cache that knows each layer's window (kvguard/cache/layered.py): the window layers'
pages are freed as they fall out of the window, and the attention function checks that the
model attends with the windows the cache keeps.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache import CacheConfig, CacheManager, CacheStats, EventQueue, LayeredManager, open_manager
from ..errors import ConfigError, InputError, KVGuardError
from ..types import SeqId, Subject

ATTN_IMPLEMENTATION = "kvguard"
TAG = "_kvguard_pending"  # attribute set on the key tensor that `update` hands to the attention function


def cache_kwarg(model) -> str:
    """The keyword a model's forward and generate take their cache by: `cache` from
    transformers 5.24 (`past_key_values` is still accepted there, with a FutureWarning),
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def shape_fields(config) -> dict:
    """CacheConfig's shape fields for a transformers config (kvguard.policy.ModelShape's fields)."""
    heads = config.num_attention_heads
    return {"num_layers": config.num_hidden_layers,
            "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads, "num_query_heads": heads}


def layer_windows(config) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: global) as transformers applies it, from `layer_types`
    and `sliding_window` (Gemma 3: five "sliding_attention" layers to one "full_attention");
    None when no layer slides."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not types or not window or "sliding_attention" not in types:
        return None
    return tuple(window if t == "sliding_attention" else None for t in types)


class CacheFullError(KVGuardError, MemoryError):
    """The page pool has no free page for the new tokens."""


class KVGuardLayer(CacheLayerMixin):
    """One decoder layer's view of a KVGuardCache: counts tokens, holds no K/V."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: KVGuardCache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0  # tokens fed to this layer, padding included

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hand the new K/V [B, H, T, D] on to the attention function, which writes them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cache._prepare(self.layer_idx, key_states)
        self.seen += key_states.shape[-2]
        setattr(key_states, TAG, (self.cache, self.layer_idx))
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query) -> tuple[int, int]:
        # transformers >= 5.17 passes the query length, 5.0 the cache positions
        q = query if isinstance(query, int) else int(query.shape[-1])
        return self.seen + q, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the name in transformers < 5.16

    def reset(self) -> None:
        self.seen = 0

    def _unsupported(self, *_args, **_kwargs):
        raise InputError("a KVGuardCache cannot be cropped, reordered or copied across rows: "
                         "generate with num_beams=1, num_return_sequences=1 and no assistant model")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class KVGuardCache(Cache):
    """The KV cache of one `generate` call (or one forward loop): a sequence per batch row.

    config: the model's `PretrainedConfig` (for the shape and the attention check).
    subject: who the rows belong to: one Subject for every row, or one per row.
    manager: a CacheManager to open the sequences in (shared with other requests,
        and the sidecar); its shape must match the model. Without it, the cache
        makes its own from `options` (CacheConfig fields: codec, evictor, dtype,
        num_pages, ...), on the model's device and dtype unless they say otherwise.
    events: the queue the cache's own manager emits into (default: a new one).
    """

    attn_implementation = ATTN_IMPLEMENTATION
    # a decode step (one new token in every row) and, on the kernel path, a prefill chunk whose
    # rows are padded on the left go to the manager as one batch; a subclass that reads rows its
    # own way in `_attend_row` turns this off
    batched_decode = True

    def __init__(self, config, subject: Subject | Sequence[Subject], *, manager: CacheManager | None = None,
                 events: EventQueue | None = None, **options):
        self.shape = shape_fields(config)
        self.windows = layer_windows(config)
        super().__init__(layers=[KVGuardLayer(self, i) for i in range(self.shape["num_layers"])])
        self.model_config = config
        self.subjects = [subject] if isinstance(subject, Subject) else list(subject)
        if not self.subjects or not all(isinstance(s, Subject) for s in self.subjects):
            raise InputError("subject must be a kvguard.types.Subject or a non-empty list of them, one per row")
        if manager is not None:
            if options or events is not None:
                raise InputError("pass either a manager or cache options, not both")
            self._check_manager(manager)
            self.events = manager.events
        else:
            CacheConfig(**self.shape, layer_windows=self.windows, **options)  # validate now, build at the first forward
            self.events = events if events is not None else EventQueue()
        self._manager = manager
        self._options = options
        self.seqs: list[SeqId] = []
        # (the last padding mask seen, (t, its version), its rows' real tokens, their counts when
        # they are each row's last tokens)
        self._mask: tuple | None = None
        self._static = None  # the StaticStep of a decode step run by a DecodeGraph (graph.py), while it runs

    @classmethod
    def from_policy(cls, config, subject, policy, **overrides) -> KVGuardCache:
        """A cache configured by a kvguard Policy (see kvguard.policy)."""
        return cls(config, subject, **(policy.cache_options() | overrides))

    # --- the manager and its sequences ---------------------------------------------------------

    @property
    def manager(self) -> CacheManager | LayeredManager:
        if self._manager is None:
            raise InputError("the cache makes its manager at the first forward; run the model first "
                             "or pass manager= to share one")
        return self._manager

    def _check_manager(self, manager: CacheManager | LayeredManager) -> None:
        got = {k: getattr(manager.cfg, k) for k in self.shape}
        want = self.shape
        if got != want:
            raise ConfigError(f"the manager's shape is {got}; the model's is {want}")
        windows = manager.cfg.layer_windows
        if windows is None and manager.cfg.window is not None:
            windows = (manager.cfg.window,) * manager.cfg.num_layers
        if windows != self.windows:
            raise ConfigError(f"the manager's layer windows are {windows}; the model's are {self.windows}: "
                              "make it with kvguard.cache.open_manager and layer_windows=kvguard.hf.layer_windows"
                              "(model.config)")

    def window(self, layer: int) -> int | None:
        """The sliding window the cache keeps for a layer (None: global)."""
        return None if self.windows is None else self.windows[layer]

    def _prepare(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Checks and lazy set-up before a layer's first write of a forward pass."""
        impl = getattr(self.model_config, "_attn_implementation", None)
        if impl != self.attn_implementation:
            raise ConfigError(f"KVGuardCache needs the model's attn_implementation to be "
                              f"{self.attn_implementation!r}, not {impl!r}: load it with "
                              f"attn_implementation={self.attn_implementation!r} or call "
                              f"model.set_attn_implementation({self.attn_implementation!r})")
        if self._manager is None:
            opts = {"device": key_states.device, "dtype": key_states.dtype} | self._options
            self._manager = open_manager(CacheConfig(**self.shape, layer_windows=self.windows, **opts),
                                         events=self.events)
        batch = key_states.shape[0]
        if not self.seqs:
            subjects = self.subjects * batch if len(self.subjects) == 1 else self.subjects
            if len(subjects) != batch:
                raise InputError(f"{len(self.subjects)} subjects for a batch of {batch} rows")
            self.seqs = [self._manager.open(s) for s in subjects]
        elif batch != len(self.seqs):
            raise InputError(f"this cache holds {len(self.seqs)} rows; a forward pass brought {batch}")

    def set_rows(self, seqs: Sequence[SeqId]) -> None:
        """The rows of the next forward pass: open sequences of the shared manager, one per row,
        in batch order. A serving loop calls it before each step, as requests join and leave;
        each row's positions are the caller's (pass position_ids to the model), so the layers'
        token counts mean nothing here. The cache does not own these rows: `free` leaves them."""
        if self._manager is None:
            raise InputError("set_rows needs a cache made with manager= (the pool the rows are open in)")
        seqs = list(seqs)
        if not seqs:
            raise InputError("set_rows needs at least one open sequence")
        self.seqs = seqs
        self._mask = None

    def free(self) -> None:
        """End every row's sequence: pages are overwritten and freed (one `free` event each)."""
        for seq in self.seqs:
            self._manager.free(seq)
        self.seqs = []
        self._mask = None
        for layer in self.layers:
            layer.reset()

    def reset(self) -> None:
        self.free()

    def __enter__(self) -> KVGuardCache:
        return self

    def __exit__(self, *exc) -> None:
        if self._manager is not None:
            self.free()

    def stats(self) -> CacheStats:
        return self.manager.stats()

    # --- attention ----------------------------------------------------------------------------

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               padding: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        """Write the new K/V of each row's real tokens and attend over the row's pages.

        query [B, Hq, T, D]; key, value [B, H, T, D] (the T new tokens); padding: the
        model's 2D attention mask [B, >= T] (1 = real token) or None.
        Returns [B, T, Hq, D]; padding positions get zeros."""
        batch, _, t, _ = query.shape
        real = self._real_tokens(padding, t)
        dtype = self._manager.cfg.dtype
        if self._static is not None:  # a DecodeGraph's step: device work only, through fixed buffers
            if t != 1 or (real is not None and any(r is not None for r in real)):
                raise InputError("a DecodeGraph step takes one new token in every row, none of them padding")
            self._static.write(layer, key[:, :, 0].to(dtype).contiguous(), value[:, :, 0].to(dtype).contiguous())
            out = self._static.attend(layer, query[:, :, 0].to(dtype).contiguous(), scale)
            return out.to(query.dtype).unsqueeze(1)
        if self.batched_decode and t == 1 and (real is None or all(r is None for r in real)):
            # a decode step: every row's token in one write and one pass of the decode kernels
            k, v = key[:, :, 0].to(dtype).contiguous(), value[:, :, 0].to(dtype).contiguous()  # [B, H, D]
            if not self._manager.append_step(self.seqs, layer, k, v):
                raise self._full(layer, t, f"no free page for the new tokens of {batch} rows at layer {layer}")
            return self._attend_step(layer, query[:, :, 0], scale).to(query.dtype).unsqueeze(1)
        counts = self._suffix_counts(real, t)
        if self.batched_decode and self._manager.cfg.use_kernels and counts is not None:
            # a prefill chunk whose rows' real tokens come last (left padding): one write and one
            # launch of the prefill kernel per pool for every row
            k, v = key.transpose(1, 2).to(dtype).contiguous(), value.transpose(1, 2).to(dtype).contiguous()
            if not self._manager.append_chunk(self.seqs, layer, k, v, counts):
                raise self._full(layer, t, f"no free page for the new tokens of {batch} rows at layer {layer}")
            q = query.transpose(1, 2).to(dtype).contiguous()  # [B, T, Hq, D]
            return self._manager.attend_chunk(self.seqs, layer, q, counts, scale=scale).to(query.dtype)
        out = query.new_zeros(batch, t, query.shape[1], query.shape[3])
        for b, seq in enumerate(self.seqs):
            idx = slice(None) if real is None or real[b] is None else real[b]
            q = query[b, :, idx].transpose(0, 1)  # [t, Hq, D]
            if q.shape[0] == 0:
                continue
            k = key[b, :, idx].transpose(0, 1).to(dtype).contiguous()  # [t, H, D]
            v = value[b, :, idx].transpose(0, 1).to(dtype).contiguous()
            if not self._manager.append(seq, layer, k, v):
                raise self._full(layer, t, f"no free page for {k.shape[0]} tokens of row {b} at layer {layer}")
            out[b, idx] = self._attend_row(seq, layer, q, scale).to(out.dtype)
        return out

    def _full(self, layer: int, t: int, what: str) -> CacheFullError:
        """The error for a write the pool had no pages for. A forward pass takes its pages at the
        first layer, each write all or none, so (but for the rows before row b of a row-by-row
        write) nothing of it is held: the layer stops counting its t tokens, and the cache goes
        on from where it was once pages are free."""
        self.layers[layer].seen -= t
        return CacheFullError(f"{what}: raise num_pages, free other sequences or configure an evictor "
                              "with a budget")

    def _suffix_counts(self, real: list[torch.Tensor | None] | None, t: int) -> list[int] | None:
        """Each row's real tokens among the t new ones when they are its last ones (no padding,
        or padding on the left), else None."""
        if real is None:
            return [t] * len(self.seqs)
        return self._mask[3] if self._mask is not None and self._mask[2] is real else None

    def _real_tokens(self, padding: torch.Tensor | None, t: int) -> list[torch.Tensor | None] | None:
        """Per row, the positions of its real tokens among the t new ones (None: all real), read
        to the host once per forward pass: every layer gets the same mask tensor, and a read per
        layer and row would stall the host on the device that many times."""
        if padding is None:
            return None
        key = (t, padding._version)  # an in-place edit of the mask bumps its version
        if self._mask is not None and self._mask[0] is padding and self._mask[1] == key:
            return self._mask[2]
        real = padding[:, -t:].to(torch.bool).cpu()
        rows = [None if bool(r.all()) else r.nonzero().squeeze(1).to(padding.device) for r in real]
        n = real.sum(1)
        suffix = bool((real == (torch.arange(t) >= t - n[:, None])).all())  # each row's real tokens come last
        self._mask = (padding, key, rows, n.tolist() if suffix else None)
        return rows

    def _attend_step(self, layer: int, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Attention of every row's new token q [B, Hq, D] over what the row holds."""
        return self._manager.attend_step(self.seqs, layer, q, scale=scale)

    def _attend_row(self, seq: SeqId, layer: int, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Attention of one row's q [t, Hq, D] (its last t positions) over what it holds."""
        return self._manager.attend(seq, layer, q, scale=scale)
