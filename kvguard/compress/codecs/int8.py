"""INT8: keys per channel over the page, values per token, dynamic max-abs scales (fp16)."""

from dataclasses import dataclass

import torch

from kvguard.kernels import quantize as q

from .base import Codec


@dataclass(frozen=True)
class Int8Codec(Codec):
    name = "int8"
    code_dtype = torch.int8

    def fields(self, heads, page_size, head_dim, dtype):
        return {
            "k": ((heads, page_size, head_dim), self.code_dtype),
            "k_scale": ((heads, head_dim), torch.float16),
            "v": ((heads, head_dim, page_size), self.code_dtype),  # channel-major (kernels/__init__.py)
            "v_scale": ((heads, page_size), torch.float16),
        }

    def encode(self, k, v):
        return q.encode_int8(k, v, dtype=self.code_dtype)

    def decode(self, f, dtype):
        return q.decode_int8(f, out_dtype=dtype)
