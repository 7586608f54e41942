"""Ids and hashes get their own types, so they are never confused with counts or raw text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

SeqId = NewType("SeqId", int)
PageId = NewType("PageId", int)
BlockHash = NewType("BlockHash", bytes)


@dataclass(frozen=True, slots=True)
class Subject:
    """Who a sequence belongs to. Raw ids: they stay inside the serving process and the
    sidecar's ingest, which pseudonymizes them; never log them (the repr hides them)."""

    tenant: str
    user: str
    session: str

    def __post_init__(self) -> None:
        for name in ("tenant", "user", "session"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 256 or "\x00" in value:
                raise ValueError(f"subject {name} must be a non-empty string of at most 256 characters, "
                                 "without NUL (the pseudonyms' separator)")

    def __repr__(self) -> str:
        return "Subject(<redacted>)"

    __str__ = __repr__
