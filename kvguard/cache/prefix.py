"""The prefix index: full pages found by a chained, tenant-salted SHA-256 of their tokens.

hash_i = SHA-256(salt ‖ hash_{i-1} ‖ tokens of page i as little-endian int32), with
hash_{-1} empty and salt = HMAC-SHA256(server secret, tenant). The salt is chosen
server-side, never by the client, so a tenant cannot probe another tenant's
prompts by timing (the attack vLLM's cache_salt closes).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

from ..types import BlockHash


def tenant_salt(secret: bytes, tenant: str) -> bytes:
    return hmac.new(secret, b"kvguard-prefix\x00" + tenant.encode(), hashlib.sha256).digest()


def page_hashes(salt: bytes, tokens: Sequence[int], page_size: int) -> list[BlockHash]:
    """Chained hashes of every full page of `tokens`."""
    out: list[BlockHash] = []
    parent = b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        chunk = struct.pack(f"<{page_size}i", *tokens[start : start + page_size])
        parent = hashlib.sha256(salt + parent + chunk).digest()
        out.append(BlockHash(parent))
    return out


class PrefixIndex:
    """hash -> (pool name, page) for lookups, and page -> hash for every page indexed.
    Entries point at pages some sequence still holds; the cache forgets a page when it
    is freed or its owner erased. A 16-bit page quantized into the codec pool hands its
    hash's lookup to the codec copy but keeps its hash while sharers still hold it, so
    that their own quantize finds the copy and shares it instead of making another."""

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, tuple[str, int]] = {}
        self._by_page: dict[tuple[str, int], BlockHash] = {}

    def get(self, h: BlockHash) -> tuple[str, int] | None:
        return self._by_hash.get(h)

    def put(self, h: BlockHash, ref: tuple[str, int]) -> None:
        self.drop_page(ref)
        self._by_hash[h] = ref
        self._by_page[ref] = h

    def hash_of(self, ref: tuple[str, int]) -> BlockHash | None:
        return self._by_page.get(ref)

    def drop_page(self, ref: tuple[str, int]) -> bool:
        """Forget a page; True when it was its hash's lookup entry, now removed."""
        h = self._by_page.pop(ref, None)
        if h is None or self._by_hash.get(h) != ref:
            return False
        del self._by_hash[h]
        return True

    def __len__(self) -> int:
        return len(self._by_hash)
