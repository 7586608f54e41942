"""The checks of what a caller hands the cache: layers, tensor shapes, K/V, per-row counts.

Each raises InputError naming what was expected and what came, before anything changes.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .config import CacheConfig


def check_layer(cfg: CacheConfig, layer: int) -> None:
    if not isinstance(layer, int) or not 0 <= layer < cfg.num_layers:
        raise InputError(f"layer must be an integer in [0, {cfg.num_layers}), got {layer!r}")


def check_shape(name: str, x: torch.Tensor, want: tuple[int | str, ...], *, nonempty: bool = False) -> None:
    """`x` must be a tensor of shape `want`, in which a name ("T") is a size the caller chooses:
    any, or at least 1 with `nonempty`."""
    if isinstance(x, torch.Tensor) and x.dim() == len(want):
        for n, w in zip(x.shape, want):
            if n != w and not (isinstance(w, str) and (n >= 1 or not nonempty)):
                break
        else:
            return
    dims = ", ".join(map(str, want))
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor of shape [{dims}], got {type(x).__name__}")
    free = [w for w in want if isinstance(w, str)]
    cond = f" with {' and '.join(f'{w} >= 1' for w in free)}" if nonempty and free else ""
    raise InputError(f"{name} must have shape [{dims}]{cond}, got {list(x.shape)}")


def check_kv(cfg: CacheConfig, k: torch.Tensor, v: torch.Tensor) -> None:
    """K and V of T >= 1 tokens, [T, H, D] in the cache's dtype, on its device."""
    want = ("T", cfg.num_kv_heads, cfg.head_dim)
    check_shape("k", k, want, nonempty=True)
    if not isinstance(v, torch.Tensor) or v.shape != k.shape:  # v checked as k was, then against it
        check_shape("v", v, want, nonempty=True)
        check_same_shape(k, v)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != cfg.dtype:
            raise InputError(f"{name} has dtype {x.dtype}; this cache holds {cfg.dtype}")
        if x.device != cfg.device and not (x.device.type == cfg.device.type == "cuda" and cfg.device.index is None):
            raise InputError(f"{name} is on {x.device}; this cache lives on {cfg.device}")


def check_same_shape(k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape:
        raise InputError(f"k and v differ in shape: {list(k.shape)} vs {list(v.shape)}")


def check_counts(counts, b: int, t: int) -> list[int]:
    """Per-row counts of real tokens in a chunk of T (default: all T)."""
    if counts is None:
        return [t] * b
    counts = list(counts)
    if len(counts) != b or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= t for n in counts):
        raise InputError(f"counts must be {b} integers in [0, {t}], one per row")
    return counts
