"""INT4 (KIVI-style): two codes a byte, asymmetric min/max scale and zero point;
keys per channel over the page, values per token in groups of `group` channels."""

from dataclasses import dataclass

import torch

from kvguard.kernels import quantize as q

from .base import Codec


@dataclass(frozen=True)
class Int4Codec(Codec):
    name = "int4"
    group: int = q.INT4_GROUP

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 1:
            raise ValueError(f"int4: group must be a positive integer, got {self.group!r}")

    def check(self, heads, page_size, head_dim):
        super().check(heads, page_size, head_dim)
        if head_dim % 2 or head_dim % self.group:
            raise ValueError(f"int4 needs head_dim divisible by 2 and by its group {self.group}, got {head_dim}")
        if page_size % 2:
            raise ValueError(f"int4 packs two tokens' values a byte: page_size must be even, got {page_size}")

    def fields(self, heads, page_size, head_dim, dtype):
        half, groups = head_dim // 2, head_dim // self.group
        return {
            "k": ((heads, page_size, half), torch.uint8),
            "k_scale": ((heads, head_dim), torch.float16),
            "k_zero": ((heads, head_dim), torch.float16),
            "v": ((heads, head_dim, page_size // 2), torch.uint8),  # channel-major (kernels/__init__.py)
            "v_scale": ((heads, groups, page_size), torch.float16),  # group-major, as the codes
            "v_zero": ((heads, groups, page_size), torch.float16),
        }

    def encode(self, k, v):
        return q.encode_int4(k, v, group=self.group)

    def decode(self, f, dtype):
        return q.decode_int4(f, out_dtype=dtype, group=self.group)
