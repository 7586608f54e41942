"""Keyed pseudonyms of tenants, users and sessions, and crypto-shredding.

For a subject of kind K with raw id R (docs/audit-format.md, "Pseudonyms"):

    data      = K || 0x00 || scoped id     scoped id: tenant = T, user = T || 0x00 || U,
                                           session = T || 0x00 || S (UTF-8, no NUL inside)
    index     = HMAC-SHA256(index key, data)          locates the subject's secret row
    secret    = 32 random bytes, row `index` of subject_keys
    pseudonym = hex(HMAC-SHA256(secret, data))[:32]   what records carry (128 bits)

Users and sessions are scoped by tenant, so the same user name in two tenants
is two subjects. The secret is stored wrapped under a key-encryption key kept
outside the database (audit.keyring), which rotates. `shred` deletes the secret
row. After that, nobody - not even someone holding the whole database, the
index key and the signing keys - can recompute the pseudonym: it is an HMAC
under 256 random bits that no longer exist anywhere (copies of the row in WAL
and backups stay wrapped under a KEK that the next rotation destroys), and the
index is an HMAC under a different key. Asking again
for the same subject creates a fresh secret, hence an unlinkable new pseudonym.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable

from .errors import RecordFormatError
from .fields import SUBJECT_KINDS
from .keys import read_private_file, write_private_file

INDEX_KEY_BYTES = 32


def generate_index_key(path: str | os.PathLike[str]) -> bytes:
    """Create the server's index key file (mode 0600) and return the key."""
    key = os.urandom(INDEX_KEY_BYTES)
    write_private_file(path, key.hex().encode() + b"\n")
    return key


def load_index_key(path: str | os.PathLike[str]) -> bytes:
    try:
        key = bytes.fromhex(read_private_file(path).decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != INDEX_KEY_BYTES:
        raise RecordFormatError(f"{path} must hold {INDEX_KEY_BYTES} bytes as hex")
    return key


def subject_data(kind: str, raw_id: str, tenant: str | None = None) -> bytes:
    """The bytes both HMACs run over: kind || 0x00 || scoped id."""
    if kind not in SUBJECT_KINDS:
        raise RecordFormatError(f"subject kind {kind!r} is not one of {SUBJECT_KINDS}")
    parts = [raw_id] if kind == "tenant" else [tenant, raw_id]
    if kind != "tenant" and tenant is None:
        raise RecordFormatError(f"a {kind} pseudonym is scoped by its tenant: pass tenant=")
    for part in parts:
        if not isinstance(part, str) or not part or "\x00" in part:
            raise RecordFormatError("subject ids must be non-empty strings without NUL")
    return kind.encode() + b"\x00" + b"\x00".join(p.encode("utf-8") for p in parts)


def index_of(index_key: bytes, data: bytes) -> bytes:
    """The subject's index: HMAC-SHA256 under the index key."""
    return hmac.new(index_key, data, hashlib.sha256).digest()


def shred_tag(stored_secret: bytes) -> str:
    """What an erase record keeps of a secret it destroyed: 128 bits of a domain-separated
    SHA-256 of the secret as stored. It reveals nothing once the secret is gone (a 2^256
    preimage search) and matches the row again if anyone puts the row back."""
    return hashlib.sha256(b"kvguard shredded secret\x00" + stored_secret).hexdigest()[:32]


def pseudonym_of(secret: bytes, data: bytes) -> str:
    return hmac.new(secret, data, hashlib.sha256).hexdigest()[:32]


def reason_hmac_of(secret: bytes, reason: str) -> str:
    """Domain-separated from pseudonyms, whose data starts with a subject kind."""
    return hmac.new(secret, b"kvguard-erasure-reason\x00" + reason.encode("utf-8"), hashlib.sha256).hexdigest()


class ShreddedTags:
    """The shred tags that erase records list, each with the record (origin, seq) that lists
    it: what the log writer found in the logs it verified, kept in memory and consulted on
    every use of a secret, so that a destroyed secret put back in the table is never used."""

    def __init__(self) -> None:
        self._tags: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()

    def add(self, tags, origin: str, seq: int) -> None:
        with self._lock:
            for tag in tags:
                self._tags.setdefault(tag, (origin, seq))

    def get(self, tag: str) -> tuple[str, int] | None:
        return self._tags.get(tag)

    def __len__(self) -> int:
        return len(self._tags)


class ShreddedSecretError(RecordFormatError):
    """A stored subject secret is one that an erase record lists as destroyed."""


class Pseudonymizer:
    """Turns raw subject ids into record pseudonyms, backed by a store's subject_keys table.

    With a `keyring` (audit.keyring), secrets are stored wrapped under its current
    key-encryption key; without one, in the clear (tests, embedded use). Nothing is cached:
    after `shred` in any process, no process can produce the old pseudonym again. Callers
    compute a request's pseudonyms once and reuse them.

    With `shredded` (the log writer's ShreddedTags), every secret read is first matched
    against the tags of the erase records: one that matches was put back after its
    erasure, and is never used. `on_shredded(origin, seq)` is told, the row is deleted,
    and the subject gets a fresh secret as on its first use, so nothing new links to the
    records that named it before the erasure."""

    def __init__(self, store, index_key: bytes, keyring=None, *, shredded: ShreddedTags | None = None,
                 on_shredded: Callable[[str, int], None] | None = None) -> None:
        if len(index_key) != INDEX_KEY_BYTES:
            raise RecordFormatError(f"the index key must be {INDEX_KEY_BYTES} bytes")
        self._store = store
        self._index_key = index_key
        self.keyring = keyring
        self.shredded, self._on_shredded = shredded, on_shredded

    def __repr__(self) -> str:
        return "Pseudonymizer(<index key hidden>)"

    def index(self, data: bytes) -> bytes:
        return index_of(self._index_key, data)

    def _secret(self, kind: str, data: bytes, *, create: bool) -> bytes | None:
        idx = self.index(data)
        found = self._refuse_shredded(idx, self._store.find_subject_secret(idx))
        for _ in range(3 if found is None and create else 0):
            # wrapped before the write transaction: the KEK may have to be read, or made, first
            fresh = os.urandom(32)
            candidate = (None, fresh) if self.keyring is None else self.keyring.wrap(idx, fresh)
            found = self._refuse_shredded(
                idx, self._store.subject_secret(idx, kind, candidate, int(time.time() * 1000)))
            if found is not None:
                break  # else a destroyed secret was put back meanwhile, and is deleted now: again
        else:
            if create and found is None:
                raise ShreddedSecretError("destroyed subject secrets keep being put back under this index: "
                                          "see the erase records reported")
        if found is None:
            return None
        kek_id, blob = found
        if kek_id is None:
            if self.keyring is not None:  # the sidecar wraps these at start: this one came later
                raise RecordFormatError("a subject secret is stored in the clear although secrets are wrapped: "
                                        "it was not written by kvguard; restart the sidecar to wrap it, "
                                        "after checking who writes to subject_keys")
            return blob
        if self.keyring is None:
            raise RecordFormatError("this subject's secret is wrapped under a key-encryption key: "
                                    "give the Pseudonymizer the keyring")
        return self.keyring.unwrap(idx, kek_id, blob)

    def _refuse_shredded(self, idx: bytes, found: tuple[str | None, bytes] | None
                         ) -> tuple[str | None, bytes] | None:
        """`found`, or None if its secret is one an erase record destroyed: that row is
        deleted (if it is still the same bytes) and reported, never unwrapped."""
        if found is None or self.shredded is None:
            return found
        erased = self.shredded.get(shred_tag(found[1]))
        if erased is None:
            return found
        self._store.delete_subject_secret_if(idx, found[1])
        if self._on_shredded is not None:
            self._on_shredded(*erased)
        return None

    def pseudonym(self, kind: str, raw_id: str, *, tenant: str | None = None) -> str:
        """The subject's pseudonym, creating its secret on first use."""
        data = subject_data(kind, raw_id, tenant)
        return pseudonym_of(self._secret(kind, data, create=True), data)

    def existing(self, kind: str, raw_id: str, *, tenant: str | None = None) -> str | None:
        """The pseudonym if the subject has a secret, without creating one (erasure lookups)."""
        data = subject_data(kind, raw_id, tenant)
        secret = self._secret(kind, data, create=False)
        return None if secret is None else pseudonym_of(secret, data)

    def reason_hmac(self, kind: str, raw_id: str, reason: str, *, tenant: str | None = None) -> str:
        """HMAC-SHA256 of an erasure's free-text reason under the subject's secret (created on
        first use), in hex: it can be checked only while the secret exists, and the erasure
        shreds it, after which a guessed reason cannot be confirmed."""
        data = subject_data(kind, raw_id, tenant)
        return reason_hmac_of(self._secret(kind, data, create=True), reason)

    def cache_salt(self, kind: str, raw_id: str, *, tenant: str | None = None) -> str:
        """The prefix-cache salt of a subject (vLLM's `cache_salt`): HMAC-SHA256 under its secret
        (created on first use) of a domain-separated string, in hex. Requests with the same salt
        share prefix blocks; once the secret is shredded no later salt equals it, so no later
        request reaches the blocks computed under it."""
        data = subject_data(kind, raw_id, tenant)
        return hmac.new(self._secret(kind, data, create=True), b"kvguard-cache-salt\x00" + data,
                        hashlib.sha256).hexdigest()

    def subject(self, tenant: str | None = None, user: str | None = None,
                session: str | None = None) -> dict[str, str]:
        """The `subject` object of a record for the ids given."""
        out: dict[str, str] = {}
        if tenant is not None:
            out["tenant"] = self.pseudonym("tenant", tenant)
        if user is not None:
            out["user"] = self.pseudonym("user", user, tenant=tenant)
        if session is not None:
            out["session"] = self.pseudonym("session", session, tenant=tenant)
        return out

    def shred(self, kind: str, raw_id: str, *, tenant: str | None = None) -> bool:
        """Destroy the subject's secret; True if there was one. Shredding a tenant does not
        shred its users or sessions: erase those first, each by its own call."""
        return self._store.delete_subject_secret(self.index(subject_data(kind, raw_id, tenant)))
