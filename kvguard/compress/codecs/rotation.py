"""An orthogonal rotation of each head's K and V before they are stored (QuaRot's idea).

4- and 8-bit codes lose most where a few channels carry most of a vector: one scale per
channel or per token must then span them all. Multiplying each head's vectors by the
normalized Walsh-Hadamard matrix R (d x d, d a power of two, entries ±1/√d) spreads every
channel over all of them, so the codes share the load; R is symmetric and orthogonal, its
own inverse. A cache whose codec rotates stores R·k and R·v in every page, 16-bit ones
included; a read rotates the query the same way, (R q)·(R k) = q·k, and the output back, since
Σ p_i R v_i = R Σ p_i v_i. The scores, and so the softmax and the attention mass the evictors
keep, are unchanged in exact arithmetic; the page layout and the kernels are unchanged.
"""

from __future__ import annotations

import functools
import math

import torch


def is_power_of_two(d: int) -> bool:
    return d >= 1 and d & (d - 1) == 0


@functools.lru_cache(maxsize=8)
def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester's construction: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(torch.float32)


def hadamard(d: int) -> torch.Tensor:
    """The normalized d x d Walsh-Hadamard matrix, float32 (d a power of two)."""
    if not is_power_of_two(d):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    return _hadamard(d)


class Rotation:
    """x -> x R over the last dimension, in x's dtype (computed in fp32 off the GPU, where fp16
    matmuls are slow or missing, and in x's dtype with fp32 accumulation on it)."""

    def __init__(self, head_dim: int, device: torch.device | str, dtype: torch.dtype = torch.float32):
        self.matrix = hadamard(head_dim).to(device)
        # the cache's own dtype made now, not on first use: a first use may be inside CUDA-graph capture
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {torch.float32: self.matrix, dtype: self.matrix.to(dtype)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" or x.dtype == torch.float32:
            return (x.float() @ self.matrix).to(x.dtype)
        r = self._by_dtype.get(x.dtype)
        if r is None:
            r = self._by_dtype[x.dtype] = self.matrix.to(x.dtype)
        return x @ r

    # R is its own inverse: rotating back is rotating again
    inverse = __call__
