"""Lower tiers for pages offloaded from the device: pinned CPU memory, local disk, Redis.

A tier stores one page (every layer's fields) under a key. `erase` overwrites what
it can reach before unlinking: CPU tensors are zeroed, disk files overwritten with
zeros and fsynced before removal; Redis values are overwritten, then deleted (Redis
frees the memory; it cannot be asked to zero it, so keep Redis on a host you trust).
"""

from __future__ import annotations

import io
import os
from abc import ABC, abstractmethod
from pathlib import Path

import torch

Blob = dict[str, torch.Tensor]


def _to_bytes(blob: Blob) -> bytes:
    buf = io.BytesIO()
    torch.save({k: v.cpu() for k, v in blob.items()}, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Blob:
    return torch.load(io.BytesIO(data), weights_only=True)


class Tier(ABC):
    name: str

    @abstractmethod
    def put(self, key: str, blob: Blob) -> int:
        """Store a page; return the bytes it takes."""

    @abstractmethod
    def get(self, key: str) -> Blob:
        """The page stored under key (KeyError when there is none)."""

    @abstractmethod
    def erase(self, key: str) -> None:
        """Overwrite and remove the page; no error when absent."""

    @abstractmethod
    def keys(self) -> list[str]:
        ...


class CpuTier(Tier):
    name = "cpu"

    def __init__(self, pin: bool = False):
        self._pages: dict[str, Blob] = {}
        self._pin = pin and torch.cuda.is_available()

    def put(self, key, blob):
        stored = {k: (v.cpu().pin_memory() if self._pin else v.cpu().clone()) for k, v in blob.items()}
        self._pages[key] = stored
        return sum(v.numel() * v.element_size() for v in stored.values())

    def get(self, key):
        return self._pages[key]

    def erase(self, key):
        blob = self._pages.pop(key, None)
        for t in (blob or {}).values():
            t.zero_()

    def keys(self):
        return list(self._pages)


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, key: str) -> Path:
        if not key.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"bad page key {key!r}")
        return self.root / f"{key}.page"

    def put(self, key, blob):
        data = _to_bytes(blob)
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:  # a full disk: no part of the page stays behind
            tmp.unlink(missing_ok=True)
            raise
        return len(data)

    def get(self, key):
        return _from_bytes(self._path(key).read_bytes())

    def erase(self, key):
        path = self._path(key)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        with open(path, "r+b") as f:
            f.write(b"\x00" * size)
            f.flush()
            os.fsync(f.fileno())
        path.unlink()

    def keys(self):
        return [p.stem for p in self.root.glob("*.page")]


class RedisTier(Tier):
    """Pages shared across pods. `prefix` namespaces this cache's keys."""

    name = "redis"

    def __init__(self, client, prefix: str = "kvguard:page:"):
        self.r = client
        self.prefix = prefix

    def put(self, key, blob):
        data = _to_bytes(blob)
        self.r.set(self.prefix + key, data)
        return len(data)

    def get(self, key):
        data = self.r.get(self.prefix + key)
        if data is None:
            raise KeyError(key)
        return _from_bytes(data)

    def erase(self, key):
        k = self.prefix + key
        size = self.r.strlen(k)
        if size:
            self.r.set(k, b"\x00" * size, xx=True)
        self.r.delete(k)

    def keys(self):
        return [k.decode()[len(self.prefix):] for k in self.r.scan_iter(self.prefix + "*")]
