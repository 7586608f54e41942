"""16-bit passthrough: the page holds K and V in the model's dtype (fp16 or bf16)."""

from dataclasses import dataclass

from .base import Codec


@dataclass(frozen=True)
class Fp16Codec(Codec):
    name = "fp16"
    quantized = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rotate:
            raise ValueError("rotate is for quantizing codecs: 16-bit pages lose nothing to rotate away")

    def fields(self, heads, page_size, head_dim, dtype):
        return {"k": ((heads, page_size, head_dim), dtype), "v": ((heads, page_size, head_dim), dtype)}

    def encode(self, k, v):
        return {"k": k, "v": v}

    def decode(self, f, dtype):
        return f["k"].to(dtype), f["v"].to(dtype)
