"""The device pages of a cache: its pools and their names, where a page of a sequence is
(`PageRef`, `page_name`), the prefix index over them, and their release.

Two pools: `hot` holds 16-bit pages (tails, sinks, windows), `main` the codec's (only when the
codec quantizes); a cache with the K/V split has a third, `split`, of the codec's pages whose
values live in host memory (split.py), their keys in the codec or a smaller one (`kv_split.keys`). Every page leaves a sequence through `release`: a page nobody holds any more
is overwritten, returned to its pool's free list and forgotten by the prefix index.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ..compress.codecs import Codec, Fp16Codec, MixedCodec, make_codec
from ..errors import ConfigError
from ..types import PageId, Subject
from .config import CacheConfig
from .pool import PagePool, device_index
from .prefix import PrefixIndex

HOT, MAIN = "hot", "main"  # the 16-bit pool and the codec's
SPLIT = "split"  # the K/V split's pool: the codec's, its values in host memory (split.py)


def page_name(pool: str, page) -> str:
    """A page as events name it: pools number their pages independently."""
    return f"{pool}:{int(page)}"


@dataclass
class PageRef:
    """Where one page of a sequence lives: a device pool (`hot`, `main`) or a tier."""

    where: str
    page: int | str  # page id in a pool, key in a tier
    pool: str = HOT  # the pool it belongs to when on the device (for tiers: where it returns)


def split_codec(home: Codec, c: CacheConfig) -> Codec:
    """The K/V split pool's codec: the home pool's, or its values with keys in `kv_split.keys`."""
    if c.kv_split.keys is None:
        return home
    keys = make_codec(c.kv_split.keys, rotate=home.rotate)
    if keys == home:
        if c.kv_split.host_keys:
            raise ConfigError(f"kv_split host_keys needs keys in another codec than the cache's, got {c.kv_split.keys}")
        return home
    try:
        codec = MixedCodec(keys=keys, values=home, rotate=home.rotate, exact=home if c.kv_split.host_keys else None)
        codec.check(c.num_kv_heads, c.page_size, c.head_dim)
    except ValueError as e:
        raise ConfigError(f"kv_split keys {c.kv_split.keys}: {e}") from None
    return codec


class PageStore:
    def __init__(self, cfg: CacheConfig, codec: Codec):
        self.cfg = c = cfg
        self.codec = codec
        shape = dict(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     page_size=c.page_size, dtype=c.dtype, device=c.device)
        self.pools = {HOT: PagePool(Fp16Codec(), num_pages=c.num_hot_pages, **shape)}
        if codec.quantized:
            self.pools[MAIN] = PagePool(codec, num_pages=c.num_pages, **shape)
        self.codec_pool = MAIN if codec.quantized else HOT  # where the codec's pages live
        if c.kv_split is not None:
            pages = c.kv_split.capacity or self.pools[self.codec_pool].num_pages
            self.pools[SPLIT] = PagePool(split_codec(self.pools[self.codec_pool].codec, c), num_pages=pages, **shape,
                                         values_on=torch.device("cpu"))
        self.prefix = PrefixIndex()

    def release(self, pool_name: str, pages: list[PageId], subject: Subject) -> list[PageId]:
        """Drop one reference of `subject` to each page of a pool; returns the pages freed
        (overwritten, and out of the prefix index)."""
        freed = self.pools[pool_name].release(pages, subject)
        for p in freed:
            self.prefix.drop_page((pool_name, int(p)))
        return freed

    def release_refs(self, refs: Iterable[PageRef], subject: Subject) -> tuple[list[str], int]:
        """Release the device pages among `refs` (pages in a tier are skipped), one pool at a
        time. Returns the pages freed as events name them, in the order of `refs`, and how many
        references were dropped without freeing (pages other sequences still share)."""
        on_device = [r for r in refs if r.where in self.pools]
        freed: dict[str, set[int]] = {}
        for name in self.pools:
            pages = [PageId(int(r.page)) for r in on_device if r.where == name]
            if pages:
                freed[name] = {int(p) for p in self.release(name, pages, subject)}
        names = []
        for r in on_device:
            if int(r.page) in freed[r.where]:
                freed[r.where].discard(int(r.page))  # a page held twice is freed once
                names.append(page_name(r.where, r.page))
        return names, len(on_device) - len(names)

    def forget(self, refs: Iterable[PageRef]) -> int:
        """Remove the device pages among `refs` from the prefix index; returns the lookup
        entries removed."""
        return sum(self.prefix.drop_page((r.where, int(r.page))) for r in refs if r.where in self.pools)

    def bytes_of(self, pages: Seq[str]) -> int:
        """Bytes of pages named "<pool>:<page>", as events name them."""
        return sum(self.pools[p.split(":")[0]].page_bytes for p in pages)

    def gather(self, refs: list[PageRef], layer: int, dtype: torch.dtype,
               values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode pages (all on the device) in order: k, v [H, len(refs) * S, D]. Without
        `values`, the values the K/V split keeps in host memory are left unread (zeros)."""
        c = self.cfg
        if not refs:
            empty = torch.zeros(c.num_kv_heads, 0, c.head_dim, dtype=dtype, device=c.device)
            return empty, empty.clone()
        k = torch.empty(len(refs), c.num_kv_heads, c.page_size, c.head_dim, dtype=dtype, device=c.device)
        v = torch.empty_like(k)
        for name in self.pools:
            slots = [i for i, r in enumerate(refs) if r.where == name]
            if slots:
                pool = self.pools[name]
                fields = pool.read(layer, [PageId(int(refs[i].page)) for i in slots], values)
                pk, pv = pool.codec.decode(fields, dtype)
                idx = device_index(slots, c.device)
                k[idx], v[idx] = pk, pv
        # [N, H, S, D] -> [H, N*S, D]
        return k.transpose(0, 1).flatten(1, 2), v.transpose(0, 1).flatten(1, 2)
