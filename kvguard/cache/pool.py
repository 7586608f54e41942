"""A pool of KV pages in one codec: preallocated tensors, a free list, reference counts.

Every page holds `page_size` token slots of every layer's K and V. Running out of
pages is an ordinary outcome (`allocate` returns None); freeing a page overwrites
its memory with zeros before the page can be handed out again.
"""

from __future__ import annotations

from collections import deque

import torch

from ..compress.codecs import Codec
from ..types import PageId, Subject


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
                 head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device):
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
        self._stacks = {name: torch.zeros((num_layers, num_pages, *shape), dtype=dt, device=device)
                        for name, (shape, dt) in spec.items()}
        self.fields: list[dict[str, torch.Tensor]] = [
            {name: st[layer] for name, st in self._stacks.items()} for layer in range(num_layers)
        ]
        self.page_bytes = codec.page_bytes(num_kv_heads, page_size, head_dim, dtype) * num_layers
        self._free: deque[int] = deque(range(num_pages))
        self.ref = [0] * num_pages
        # owners[page][subject] = how many references that subject's sequences hold
        self.owners: list[dict[Subject, int]] = [{} for _ in range(num_pages)]

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

    def wipe(self, pages: list[PageId]) -> None:
        """Zero the pages in every layer: one fill per field."""
        idx = device_index(pages, self.device)
        for t in self._stacks.values():
            _raw(t).index_fill_(1, idx, 0)

    # --- data ---------------------------------------------------------------------------------

    def read(self, layer: int, pages: list[PageId]) -> dict[str, torch.Tensor]:
        idx = device_index(pages, self.device)
        return {name: _raw(t).index_select(0, idx).view(t.dtype) for name, t in self.fields[layer].items()}

    def write(self, layer: int, pages: list[PageId], values: dict[str, torch.Tensor]) -> None:
        idx = device_index(pages, self.device)
        for name, t in self.fields[layer].items():
            _raw(t).index_copy_(0, idx, _raw(values[name].to(t.dtype)))

    def decode(self, layer: int, pages: list[PageId], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, H, S, D] of the pages, dequantized to `dtype`."""
        return self.codec.decode(self.read(layer, pages), dtype)

    def page_blob(self, page: PageId) -> dict[str, torch.Tensor]:
        """Every layer's fields of one page, for moving it to another tier: {"<layer>.<name>": tensor}."""
        return {f"{i}.{n}": _raw(t)[page].clone() for i, layer in enumerate(self.fields) for n, t in layer.items()}

    def load_blob(self, page: PageId, blob: dict[str, torch.Tensor]) -> None:
        for i, layer in enumerate(self.fields):
            for n, t in layer.items():
                _raw(t)[page].copy_(blob[f"{i}.{n}"].to(t.device))

    # --- the K/V split: a page's value fields alone (names starting with "v") ----------------------

    def value_fields(self) -> list[str]:
        return [n for n in self.fields[0] if n.startswith("v")]

    def value_blob(self, page: PageId) -> dict[str, torch.Tensor]:
        """Every layer's value fields of one page: {"<layer>.<name>": tensor}."""
        return {f"{i}.{n}": _raw(layer[n])[page].clone() for i, layer in enumerate(self.fields)
                for n in self.value_fields()}

    def value_bytes(self) -> int:
        """Bytes of one page's value fields, every layer."""
        return sum(layer[n][0].numel() * layer[n].element_size() for layer in self.fields for n in self.value_fields())

    def wipe_values(self, pages: list[PageId]) -> None:
        """Zero the value fields of pages in every layer (their keys stay)."""
        idx = device_index(pages, self.device)
        for n in self.value_fields():
            _raw(self._stacks[n]).index_fill_(1, idx, 0)

    def load_values(self, page: PageId, blob: dict[str, torch.Tensor]) -> None:
        for i, layer in enumerate(self.fields):
            for n in self.value_fields():
                _raw(layer[n])[page].copy_(blob[f"{i}.{n}"].to(layer[n].device))
