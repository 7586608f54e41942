"""The "kvguard" attention implementation of transformers, and its mask function.

`register()` (run on import of kvguard.hf) adds both to transformers' global
interfaces, so a model loaded with `attn_implementation="kvguard"` routes every
attention call to `kvguard_attention`, which hands it to the KVGuardCache that
produced the layer's K/V.

The mask function passes the model's 2D padding mask through untouched: causality
is the cache's business (the queries are the last positions of each sequence),
and the cache only needs to know which new tokens are padding. Registering it
also makes transformers 5.0-5.17 hand that mask over at all; they give custom
implementations without a mask function no mask.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..errors import ConfigError
from .cache import ATTN_IMPLEMENTATION, TAG, cache_kwarg


def kvguard_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D]; key, value [B, H, T, D] of the T new tokens, as the cache's
    `update` returned them. Returns (out [B, T, Hq, D], None)."""
    pending = getattr(key, TAG, None)
    if pending is None:
        raise ConfigError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs a kvguard.hf.KVGuardCache: pass "
                          f"{cache_kwarg(module)}=KVGuardCache(model.config, subject, ...) to the model or "
                          "generate, or call kvguard.hf.use_default_cache(model, subject) once so that "
                          "generate makes one for every call that passes none")
    cache, layer = pending
    if kwargs.get("softcap") is not None:
        raise ConfigError("this model soft-caps its attention logits (softcap), which kvguard's attention does not "
                          "apply: its outputs would differ from the model's")
    window = kwargs.get("sliding_window")
    if window != cache.window(layer):
        raise ConfigError(f"layer {layer} attends with sliding window {window}, but the cache keeps "
                          f"{cache.window(layer)}: make the cache after setting the model's windows "
                          "(kvguard.hf.layer_windows(model.config) is what it reads)")
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    return cache.attend(layer, query, key, value, padding, scaling), None


def kvguard_mask(*, attention_mask: torch.Tensor | None = None, **_) -> torch.Tensor | None:
    """The 2D padding mask [B, past + T] (or None), passed through."""
    return attention_mask


def register(name: str = ATTN_IMPLEMENTATION) -> None:
    AttentionInterface.register(name, kvguard_attention)
    AttentionMaskInterface.register(name, kvguard_mask)
