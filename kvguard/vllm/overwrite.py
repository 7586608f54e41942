"""Overwriting vLLM's KV blocks in place, in every layer a worker holds, and reading them back.

A layer's KV tensor keeps its blocks along one dimension: first on the CPU backend
([blocks, 2, block_size, heads, dim]), second under FlashAttention ([2, blocks, ...]). It is
found by its size, the engine's number of blocks. No vLLM import: tested on the CPU and a GPU
without an engine.
"""

from __future__ import annotations

import torch


def block_dims(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[tuple[torch.Tensor, int]]:
    """Each layer's tensor with the dimension that indexes its blocks."""
    layers = []
    for name, t in kv_caches.items():
        dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
        if not dims:
            raise RuntimeError(f"layer {name}'s KV tensor {tuple(t.shape)} has no dimension of {num_blocks} "
                               "blocks: this vLLM lays out its cache in a way kvguard does not know")
        layers.append((t, dims[0]))
    return layers


def overwrite(layers: list[tuple[torch.Tensor, int]], blocks: list[int], read_back: bool = True) -> float:
    """Zero `blocks` in every layer. With `read_back`, returns the largest magnitude then read from
    them (0.0: nothing left), read once for all layers (a device sync per layer would stall the
    step); without, 0.0 unread: a step's frees are overwritten, an erasure's are also checked."""
    idx, peaks = None, []
    for t, dim in layers:
        if idx is None or idx.device != t.device:
            idx = torch.tensor(blocks, dtype=torch.long, device=t.device)
        t.index_fill_(dim, idx, 0)
        if read_back:
            peaks.append(t.index_select(dim, idx).abs().amax().float())
    return float(torch.stack([p.to(peaks[0].device) for p in peaks]).max()) if peaks else 0.0
