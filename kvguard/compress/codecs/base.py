"""What every codec is: a page layout plus encode/decode of whole pages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

# name -> (shape without the page dimension, dtype)
FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class Codec(ABC):
    """A page codec. `encode` takes k, v [N, H, S, D] in 16-bit and returns the page
    fields, each [N, ...]; `decode` returns k, v [N, H, S, D]."""

    name: ClassVar[str]
    quantized: ClassVar[bool] = True
    # Store each head's K and V rotated by the normalized Hadamard matrix (rotation.py).
    rotate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rotate, bool):
            raise ValueError(f"{self.name}: rotate must be true or false, got {self.rotate!r}")

    @abstractmethod
    def fields(self, heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> FieldSpec:
        ...

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        ...

    @abstractmethod
    def decode(self, f: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    @property
    def key_codec(self) -> Codec:
        """The codec of the page's keys (another than the values' in a K/V split's page: mixed.py)."""
        return self

    @property
    def value_codec(self) -> Codec:
        return self

    def encode_keys(self, k: torch.Tensor) -> dict[str, torch.Tensor]:
        """The key fields of pages whose keys are k [N, H, S, D] (keys are encoded on their own)."""
        return {n: t for n, t in self.encode(k, k).items() if n.startswith("k")}

    def check(self, heads: int, page_size: int, head_dim: int) -> None:
        """Raise ValueError when this codec cannot hold pages of this shape."""
        if self.rotate and (head_dim < 1 or head_dim & (head_dim - 1)):
            raise ValueError(f"{self.name} with rotate needs a power-of-two head_dim, got {head_dim}")

    def page_bytes(self, heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page takes for one layer, scales included."""
        total = 0
        for shape, dt in self.fields(heads, page_size, head_dim, dtype).values():
            n = 1
            for s in shape:
                n *= s
            total += n * torch.empty((), dtype=dt).element_size()
        return total
