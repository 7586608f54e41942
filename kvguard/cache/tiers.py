"""Lower tiers for pages offloaded from the device: pinned CPU memory, local disk, Redis.

A tier stores one page (every layer's fields) under a key. `erase` overwrites what
it can reach before unlinking: CPU tensors are zeroed, disk files overwritten with
zeros and fsynced before removal; Redis values are overwritten, then deleted.

What leaves the process is sealed: the disk and Redis tiers store each page
encrypted with AES-256-GCM under a key drawn when the tier is made and held only
in this process's memory, the page's tier key as associated data. Their copies
are thus unreadable once the process is gone, however it ended (a crash leaves
files and Redis values that no erasure can reach any more), wherever the bytes
went that an overwrite cannot reach (freed Redis memory, a filesystem's old
blocks, backups), and a value swapped under another key or altered fails to
load instead of being unpickled.
"""

from __future__ import annotations

import io
import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from ..errors import TierError

Blob = dict[str, torch.Tensor]


def _to_bytes(blob: Blob) -> bytes:
    buf = io.BytesIO()
    torch.save({k: v.cpu() for k, v in blob.items()}, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Blob:
    return torch.load(io.BytesIO(data), weights_only=True)


class _Seal:
    """AES-256-GCM under a key that never leaves this object. Nonces count up from zero:
    the key is new for every tier, so no nonce repeats under it. (Imported here: the cache
    runs without `cryptography` where it has only device and CPU pages.)"""

    def __init__(self, where: str) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(AESGCM.generate_key(bit_length=256))
        self._where = where
        self._next = 0
        self._lock = threading.Lock()

    def seal(self, key: str, data: bytes) -> bytes:
        with self._lock:
            n, self._next = self._next, self._next + 1
        nonce = n.to_bytes(12, "big")
        return nonce + self._aead.encrypt(nonce, data, self._aad(key))

    def open(self, key: str, data: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            if len(data) < 12 + 16:  # a nonce and a tag at least (a truncated file)
                raise InvalidTag
            return self._aead.decrypt(data[:12], data[12:], self._aad(key))
        except InvalidTag:
            raise TierError(f"the {self._where} copy of page {key} does not open under this process's key: "
                            "it was altered, moved from another key, or written by another process") from None

    def _aad(self, key: str) -> bytes:
        return f"kvguard page {self._where} {key}".encode()


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
    """Pages in files of a directory. With `clear_stale`, the directory is this process's alone
    (an emptyDir of its pod, a path with its name in it): the pages an earlier run left there,
    sealed under a key that is gone, and a write a crash cut short are erased at start."""

    name = "disk"

    def __init__(self, root: str | Path, *, clear_stale: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._seal = _Seal(self.name)
        if clear_stale:
            for path in [*self.root.glob("*.page"), *self.root.glob("*.tmp")]:
                _shred(path)

    def _path(self, key: str) -> Path:
        if not key.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"bad page key {key!r}")
        return self.root / f"{key}.page"

    def put(self, key, blob):
        path = self._path(key)
        data = self._seal.seal(key, _to_bytes(blob))
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
        return _from_bytes(self._seal.open(key, self._path(key).read_bytes()))

    def erase(self, key):
        _shred(self._path(key))

    def keys(self):
        return [p.stem for p in self.root.glob("*.page")]


def _shred(path: Path) -> None:
    """Overwrite a file with zeros, fsync, unlink; nothing when it is gone."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    with open(path, "r+b") as f:
        f.write(b"\x00" * size)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()


class RedisTier(Tier):
    """Pages in a Redis server, which several pods may use: `prefix` namespaces this cache's
    keys, and each process's pages are sealed under its own key, so no pod reads another's.
    With `clear_stale`, the prefix is this process's alone (its pod's name in it): the pages an
    earlier run left under it are erased at start."""

    name = "redis"

    def __init__(self, client, prefix: str = "kvguard:page:", *, clear_stale: bool = False):
        self.r = client
        self.prefix = prefix
        self._seal = _Seal(self.name)
        if clear_stale:
            for key in self.keys():
                self.erase(key)

    def put(self, key, blob):
        data = self._seal.seal(key, _to_bytes(blob))
        self.r.set(self.prefix + key, data)
        return len(data)

    def get(self, key):
        data = self.r.get(self.prefix + key)
        if data is None:
            raise KeyError(key)
        return _from_bytes(self._seal.open(key, data))

    def erase(self, key):
        k = self.prefix + key
        size = self.r.strlen(k)
        if size:
            self.r.set(k, b"\x00" * size, xx=True)
        self.r.delete(k)

    def keys(self):
        return [k.decode()[len(self.prefix):] for k in self.r.scan_iter(self.prefix + "*")]
