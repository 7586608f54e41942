"""Keys in one codec, values in another: the K/V split's pages (kvguard/cache/split.py).

A split page keeps its keys on the device, where every read scores all of them, and its values
in host memory, read only where attention needs them. The keys are then most of the device's
bytes for a long context: in a smaller codec (INT4 keys beside INT8 values) the same device
memory holds a longer context. The page layout is each half's own (kernels/__init__.py): the
key fields of `keys` and the value fields of `values`; the kernels tell them apart by the
dtypes of `k` and `v`.

With `exact` (the cache's codec; `kv_split.host_keys`), a page also keeps its keys in that
codec, under the same names prefixed with `x` and in host memory beside the values: the small
keys then only rank the pages, and a read attends over the pages it picked with `exact_view`,
the exact keys under the kernels' names beside the values.
"""

from dataclasses import dataclass, field

import torch

from kvguard.kernels import quantize as q

from .base import Codec


@dataclass(frozen=True)
class MixedCodec(Codec):
    name = "mixed"
    keys: Codec = field(default=None)  # type: ignore[assignment]
    values: Codec = field(default=None)  # type: ignore[assignment]
    exact: Codec | None = None  # the keys again, in this codec, as `x` fields

    def __post_init__(self) -> None:
        super().__post_init__()
        for half in ("keys", "values"):
            c = getattr(self, half)
            if not isinstance(c, Codec) or isinstance(c, MixedCodec):
                raise ValueError(f"mixed: {half} must be a codec, got {c!r}")
            if c.rotate != self.rotate:
                raise ValueError(f"mixed: {half} must rotate as the page does ({self.rotate}), got {c.rotate}")
        if getattr(self.values, "group", None) not in (None, q.INT4_GROUP) or \
                getattr(self.keys, "group", None) not in (None, q.INT4_GROUP):
            raise ValueError(f"mixed: int4 halves take the kernels' group {q.INT4_GROUP}")
        if self.exact is not None and (not isinstance(self.exact, Codec) or isinstance(self.exact, MixedCodec)
                                       or self.exact.rotate != self.rotate or self.exact == self.keys):
            raise ValueError(f"mixed: exact keys must be another codec than the keys', rotating as the page does; "
                             f"got {self.exact!r}")

    @property
    def quantized(self) -> bool:  # type: ignore[override]
        return self.keys.quantized or self.values.quantized

    @property
    def key_codec(self) -> Codec:
        return self.keys

    @property
    def value_codec(self) -> Codec:
        return self.values

    def check(self, heads, page_size, head_dim):
        super().check(heads, page_size, head_dim)
        self.keys.check(heads, page_size, head_dim)
        self.values.check(heads, page_size, head_dim)
        if self.exact is not None:
            self.exact.check(heads, page_size, head_dim)

    def fields(self, heads, page_size, head_dim, dtype):
        k = self.keys.fields(heads, page_size, head_dim, dtype)
        v = self.values.fields(heads, page_size, head_dim, dtype)
        x = {} if self.exact is None else self.exact.fields(heads, page_size, head_dim, dtype)
        return {**{n: f for n, f in k.items() if n.startswith("k")}, **{n: f for n, f in v.items() if n.startswith("v")},
                **{"x" + n: f for n, f in x.items() if n.startswith("k")}}

    def encode(self, k, v):
        exact = {} if self.exact is None else {"x" + n: t for n, t in self.exact.encode_keys(k).items()}
        return {**self.keys.encode_keys(k), **{n: t for n, t in self.values.encode(k, v).items() if n.startswith("v")},
                **exact}

    @staticmethod
    def exact_view(f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fields of pages with exact keys as the kernels read them: the `x` keys as `k`, and the values."""
        return {**{n[1:]: t for n, t in f.items() if n.startswith("x")}, **{n: t for n, t in f.items() if n.startswith("v")}}

    def decode(self, f, dtype):
        return q.decode_pages(f, dtype)  # each half by its own dtype

    def encode_keys(self, k: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.keys.encode_keys(k)
