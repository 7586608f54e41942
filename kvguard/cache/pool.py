"""A pool of KV pages in one codec: preallocated tensors, a free list, reference counts.

Every page holds `page_size` token slots of every layer's K and V. Running out of
pages is an ordinary outcome (`allocate` returns None); freeing a page overwrites
its memory with zeros before the page can be handed out again.

The K/V split's pool (split.py) keeps its value fields in host memory (`values_on`): pinned
where CUDA is present, so the decode kernels read a page's values in place over the bus (a
pinned page is mapped into the device's address space), and only its keys take device memory;
with `kv_split.host_keys` also a second copy of its keys, in the cache's codec (the `x` fields).
"""

from __future__ import annotations

from collections import deque

import torch

from ..compress.codecs import Codec
from ..kernels import quantize as q
from ..types import PageId, Subject


def host_field(name: str) -> bool:
    """Whether a K/V split's pool keeps this field in host memory: values, and exact keys (`x`)."""
    return name.startswith(("v", "x"))


def device_index(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list of indices as a tensor on `device`. `torch.tensor(values, device=cuda)`
    copies from pageable memory and then waits for the stream, stalling the host on every
    kernel queued before it; an asynchronous copy of a fresh host tensor does not (its bytes
    are staged before the call returns, so the host tensor may go at once)."""
    t = torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _raw(t: torch.Tensor) -> torch.Tensor:
    # Some index kernels lack float8 on the CPU: move those bytes as uint8.
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


class PagePool:
    def __init__(self, codec: Codec, *, num_pages: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 values_on: torch.device | None = None):
        self.codec = codec
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        spec = codec.fields(num_kv_heads, page_size, head_dim, dtype)
        # one tensor per field for every layer, [L, P, ...], so that wiping freed pages is one
        # fill per field rather than one per layer and field; fields[layer][name] is its [P, ...]
        # view, what the kernels and the codec take
        self.values_on = values_on  # the value fields' device when not `device` (the K/V split's pool)
        self.host_values = values_on is not None and values_on != device
        pin = self.host_values and values_on.type == "cpu" and device.type == "cuda"

        def stack(name, shape, dt):
            if self.host_values and host_field(name):
                return torch.zeros((num_layers, num_pages, *shape), dtype=dt, device=values_on, pin_memory=pin)
            return torch.zeros((num_layers, num_pages, *shape), dtype=dt, device=device)

        self._stacks = {name: stack(name, shape, dt) for name, (shape, dt) in spec.items()}
        self.fields: list[dict[str, torch.Tensor]] = [
            {name: st[layer] for name, st in self._stacks.items()} for layer in range(num_layers)
        ]
        self.page_bytes = codec.page_bytes(num_kv_heads, page_size, head_dim, dtype) * num_layers
        # of a page's bytes, those in device memory
        self.device_page_bytes = sum(t[:, 0].numel() * t.element_size() for t in self._stacks.values()
                                     if t.device == self._stacks["k"].device)
        self._free: deque[int] = deque(range(num_pages))
        self.ref = [0] * num_pages
        # owners[page][subject] = how many references that subject's sequences hold
        self.owners: list[dict[Subject, int]] = [{} for _ in range(num_pages)]
        self.on_wipe: list = []  # called with the pages wiped: what keeps copies of them forgets them

    # --- allocation ---------------------------------------------------------------------------

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int, owner: Subject) -> list[PageId] | None:
        if n > len(self._free):
            return None
        pages = [PageId(self._free.popleft()) for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
            self.owners[p] = {owner: 1}
        return pages

    def share(self, page: PageId, owner: Subject) -> None:
        if self.ref[page] <= 0:
            raise RuntimeError(f"page {page} is free and cannot be shared")
        self.ref[page] += 1
        self.owners[page][owner] = self.owners[page].get(owner, 0) + 1

    def release(self, pages: list[PageId], owner: Subject) -> list[PageId]:
        """Drop one reference of `owner` to each page; pages nobody holds any more are
        overwritten and freed. Returns the freed pages."""
        freed = []
        for p in pages:
            if self.ref[p] <= 0 or self.owners[p].get(owner, 0) <= 0:
                raise RuntimeError(f"page {p} released by a subject that holds no reference to it")
            self.ref[p] -= 1
            self.owners[p][owner] -= 1
            if self.owners[p][owner] == 0:
                del self.owners[p][owner]
            if self.ref[p] == 0:
                freed.append(p)
        if freed:
            self.wipe(freed)
            self._free.extend(freed)
        return freed

    def _index(self, pages, t: torch.Tensor) -> torch.Tensor:
        return device_index(pages, t.device)

    def _host_sync(self) -> None:
        """Before the host reads or writes the value fields kept in its memory: let the device
        finish what it queued, which may still read or write them (a kernel reading a page's
        values in place, a copy into them)."""
        if self.host_values and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def wipe(self, pages: list[PageId]) -> None:
        """Zero the pages in every layer: one fill per field."""
        self._host_sync()
        for t in self._stacks.values():
            _raw(t).index_fill_(1, self._index(pages, t), 0)
        for forget in self.on_wipe:
            forget(pages)

    # --- data ---------------------------------------------------------------------------------

    def read(self, layer: int, pages: list[PageId], values: bool = True) -> dict[str, torch.Tensor]:
        """The pages' fields of one layer, on the device. Without `values`, value fields kept in
        host memory come as zeros (the K/V split's key-only reads)."""
        if values:
            self._host_sync()  # copies into host memory may still be under way
        out = {}
        for name, t in self.fields[layer].items():
            if self.host_values and host_field(name) and not values:
                out[name] = torch.zeros((len(pages), *t.shape[1:]), dtype=t.dtype, device=self.device)
            else:
                out[name] = _raw(t).index_select(0, self._index(pages, t)).view(t.dtype).to(self.device)
        return out

    def write(self, layer: int, pages: list[PageId], values: dict[str, torch.Tensor]) -> None:
        self._host_sync()
        for name, t in self.fields[layer].items():
            _raw(t).index_copy_(0, self._index(pages, t), _raw(values[name].to(t.device, t.dtype)))

    def head_index(self, pages: list[PageId], rows: int) -> torch.Tensor:
        """The (page, head) slices decode_by_head reads for `rows` rows of P `pages` each, row by
        row and head by head: [rows * H * P] on the pool's device."""
        heads = next(iter(self.fields[0].values())).shape[1]
        idx = torch.tensor(pages, dtype=torch.long).view(rows, 1, -1) * heads
        return (idx + torch.arange(heads).view(1, heads, 1)).flatten().to(self.device)

    def decode_by_head(self, layer: int, pages: list[PageId] | torch.Tensor, rows: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [rows * H, P * S, D] of `pages` (or their head_index), `rows` rows of P pages
        each in order: each (row, head)'s positions in one contiguous run, what a batched matmul
        reads without a copy. Every field of a page is per head, so one gather of (page, head)
        slices reads them, decoded as pages of one head each."""
        self._host_sync()
        heads = next(iter(self.fields[layer].values())).shape[1]
        idx = pages if isinstance(pages, torch.Tensor) else self.head_index(pages, rows)
        got = {name: _raw(t).flatten(0, 1).index_select(0, idx.to(t.device)).view(t.dtype).unsqueeze(1).to(self.device)
               for name, t in self.fields[layer].items()}
        k, v = self.codec.decode(got, dtype)
        return k.reshape(rows * heads, -1, k.shape[-1]), v.reshape(rows * heads, -1, v.shape[-1])

    def decode(self, layer: int, pages: list[PageId], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, H, S, D] of the pages, dequantized to `dtype`."""
        return self.codec.decode(self.read(layer, pages), dtype)

    def page_blob(self, page: PageId) -> dict[str, torch.Tensor]:
        """Every layer's fields of one page, for moving it to another tier: {"<layer>.<name>": tensor}."""
        self._host_sync()
        return {f"{i}.{n}": _raw(t)[page].clone() for i, layer in enumerate(self.fields) for n, t in layer.items()}

    def load_blob(self, page: PageId, blob: dict[str, torch.Tensor]) -> None:
        self._host_sync()
        for i, layer in enumerate(self.fields):
            for n, t in layer.items():
                _raw(t)[page].copy_(blob[f"{i}.{n}"].to(t.device))

    # --- the K/V split: pages moved between a device pool and the split's pool ---------------------

    def value_fields(self) -> list[str]:
        """The fields a K/V split's pool keeps in host memory: the values (and exact keys)."""
        return [n for n in self._stacks if host_field(n)]

    def value_bytes(self) -> int:
        """Bytes of one page's fields kept in host memory by a K/V split's pool, every layer."""
        return sum(t[:, 0].numel() * t.element_size() for n, t in self._stacks.items() if host_field(n))

    def copy_pages(self, src: PagePool, src_pages: list[PageId], dst_pages: list[PageId]) -> None:
        """Copy every field of `src_pages` of another pool of the same shape into this pool's
        `dst_pages`, every layer. The values' codec must be the same; keys in another codec (a
        K/V split pool's smaller one) are decoded and encoded again on the device, unless the
        source keeps them in this pool's key codec too (exact keys, copied as they are). Copies into
        host memory are queued on the device's stream (no wait): one copy per layer and run of
        consecutive destination pages."""
        if len(src_pages) != len(dst_pages):
            raise ValueError("copy_pages takes as many destination pages as source pages")
        if src.codec.value_codec != self.codec.value_codec:
            raise ValueError(f"copy_pages moves values in one codec, not {src.codec.value_codec.name} to "
                             f"{self.codec.value_codec.name}")
        if not src_pages:
            return
        if src.host_values or (self.host_values and self.device.type != "cuda"):
            src._host_sync()
            self._host_sync()
        # a split pool's exact keys (x fields) come back as the keys of a pool in their codec, and
        # are copied from the keys of the pool whose codec they are in
        back = getattr(src.codec, "exact", None) == self.codec.key_codec
        recode = self.keys_recoded(src)
        if recode:
            self._recode_keys(src, src_pages, dst_pages)
        for name, t in self._stacks.items():
            if recode and name.startswith("k"):
                continue
            s = src._stacks["x" + name if back and name.startswith("k") else
                            name[1:] if name.startswith("x") and name not in src._stacks else name]
            got = _raw(s).index_select(1, self._index(src_pages, s))  # [L, n, ...] where src keeps it
            if t.device == s.device or t.device.type != "cpu" or s.device.type != "cuda":
                _raw(t).index_copy_(1, self._index(dst_pages, t), got.to(t.device))
                continue
            runs, start = [], 0  # device -> pinned host: asynchronous copies of contiguous slices
            for j in range(1, len(dst_pages) + 1):
                if j == len(dst_pages) or int(dst_pages[j]) != int(dst_pages[j - 1]) + 1:
                    runs.append((start, j))
                    start = j
            for a, b in runs:
                d0 = int(dst_pages[a])
                for layer in range(t.shape[0]):
                    _raw(t)[layer, d0:d0 + b - a].copy_(got[layer, a:b], non_blocking=True)

    def keys_recoded(self, src: PagePool) -> bool:
        """Whether copying src's pages here encodes their keys again: their codecs differ and src
        keeps no exact copy in this pool's (kv_split.host_keys)."""
        return src.codec.key_codec != self.codec.key_codec and getattr(src.codec, "exact", None) != self.codec.key_codec

    def _recode_keys(self, src: PagePool, src_pages: list[PageId], dst_pages: list[PageId], chunk: int = 256) -> None:
        """The keys of src_pages (src's key codec) into dst_pages in this pool's key codec: decoded to
        fp32 and encoded again, on the device, a layer and `chunk` pages at a time."""
        keys = [n for n in self._stacks if n.startswith("k")]
        for lo in range(0, len(src_pages), chunk):
            si = self._index(src_pages[lo:lo + chunk], src._stacks["k"])
            di = self._index(dst_pages[lo:lo + chunk], self._stacks["k"])
            for layer in range(self.num_layers):
                got = {n: t.index_select(0, si) for n, t in src.fields[layer].items() if n.startswith("k")}
                new = self.codec.encode_keys(q.decode_keys(got, torch.float32))
                for n in keys:
                    self._stacks[n][layer].index_copy_(0, di, new[n].to(self._stacks[n].dtype))
