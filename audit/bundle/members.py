"""Parsing and checking the small bundle members: checkpoints.json, proofs.json, keys.json.

Each function raises VerificationError naming its member; the records stream and
the cross-checks between members are in audit.bundle.verify.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from ..canonical import loads
from ..checkpoint import Checkpoint, split_note
from ..errors import KeyFileError, RecordFormatError, VerificationError
from ..keys import PublicKey
from ..merkle import decompose, verify_inclusion
from ..ops import KEY_ROTATION
from ..record import Record
from .layout import CHECKPOINTS, KEYS, PROOFS


def _fail(member: str, check: str, message: str, origin: str | None = None, seq: int | None = None):
    return VerificationError(check, message, origin=origin, seq=seq, member=member)


@dataclass(frozen=True, slots=True)
class Listed:
    """A checkpoint as listed (its signature is checked where its signer is known)."""

    size: int
    note: str
    checkpoint: Checkpoint


def parse_checkpoints(doc: Any, origin: str, first: int, size: int) -> list[Listed]:
    try:
        items = [(int(c["tree_size"]), c["note"]) for c in doc["checkpoints"]]
        listed = [Listed(n, note, Checkpoint.parse_text(split_note(note)[0])) for n, note in items]
    except (KeyError, TypeError, ValueError) as exc:
        raise _fail(CHECKPOINTS, "format", f"malformed: {exc}", origin) from None
    except VerificationError as exc:
        raise _fail(CHECKPOINTS, exc.check, exc.message, origin) from None
    sizes = [c.size for c in listed]
    if not listed or sizes[-1] != size or sizes != sorted(set(sizes)) or sizes[0] < first:
        raise _fail(CHECKPOINTS, "format",
                    f"sizes {sizes} must ascend from >= {first} to the covering {size}", origin)
    for c in listed:
        if c.checkpoint.size != c.size or c.checkpoint.origin != origin:
            raise _fail(CHECKPOINTS, "checkpoint_format", f"note of size {c.checkpoint.size} for "
                        f"{c.checkpoint.origin!r} listed as {origin}@{c.size}", origin)
    return listed


@dataclass(frozen=True, slots=True)
class Proofs:
    prefix: list[bytes]
    suffix: list[bytes]
    consistency: dict[int, list[bytes]]  # from size -> proof to the covering size


def parse_proofs(doc: Any, origin: str, first: int, end: int, size: int) -> Proofs:
    try:
        hx = bytes.fromhex
        prefix = [hx(h) for h in doc["prefix"]]
        suffix = [hx(h) for h in doc["suffix"]]
        consistency = {int(c["from"]): [hx(h) for h in c["proof"]] for c in doc["consistency"]
                       if int(c["to"]) == size}
        declared = (int(doc["tree_size"]), [int(x) for x in doc["range"]])
    except (KeyError, TypeError, ValueError) as exc:
        raise _fail(PROOFS, "format", f"malformed: {exc}", origin) from None
    if declared != (size, [first, end]):
        raise _fail(PROOFS, "format",
                    f"proofs are for {declared}, the manifest says {(size, [first, end])}", origin)
    if len(prefix) != len(decompose(0, first)) or len(suffix) != len(decompose(end, size)):
        raise _fail(PROOFS, "merkle_root", "prefix or suffix has the wrong number of hashes", origin)
    if any(len(h) != 32 for h in prefix + suffix):
        raise _fail(PROOFS, "merkle_root", "a tree hash is not 32 bytes", origin)
    return Proofs(prefix, suffix, consistency)


def last_listed_key(data: bytes) -> list[PublicKey]:
    """The key keys.json lists last (the one valid at the tree size), or none if it cannot be
    read: a candidate for the manifest's signature only, before keys.json is checked in full."""
    try:
        raw = base64.b64decode(loads(data)["keys"][-1]["public_key"], validate=True)
        return [PublicKey.from_raw(raw)]
    except (KeyError, IndexError, TypeError, ValueError, binascii.Error, KeyFileError):
        return []


class KeyPlan:
    """keys.json: the log's keys in order, each from its valid_from_seq on. The first is the
    log's root key, which the auditor must trust (audit.bundle.verify checks it)."""

    def __init__(self, doc: Any, origin: str, cover: Checkpoint) -> None:
        try:
            entries = [(PublicKey.from_raw(base64.b64decode(k["public_key"], validate=True)), k["key_id"],
                        int(k["valid_from_seq"]), k["rotation"]) for k in doc["keys"]]
        except (KeyError, TypeError, ValueError, binascii.Error, KeyFileError) as exc:
            raise _fail(KEYS, "format", f"malformed: {exc}", origin) from None
        if not entries or entries[0][2] != 0 or entries[0][3] is not None:
            raise _fail(KEYS, "key", "the first key must be valid from seq 0 without a rotation", origin)
        self.keys: list[tuple[PublicKey, int]] = []
        for i, (key, key_id, start, rotation) in enumerate(entries):
            if key.key_id != key_id:
                raise _fail(KEYS, "key", f"key_id {key_id} is not the SHA-256 of its public key", origin)
            if i and not self.keys[-1][1] < start <= cover.size:
                raise _fail(KEYS, "key", f"key {key_id[:16]}... starts at seq {start}, out of order", origin)
            if i:
                self._check_rotation(rotation, key, start, origin, cover)
            self.keys.append((key, start))

    def _check_rotation(self, rotation: Any, key: PublicKey, start: int, origin: str,
                        cover: Checkpoint) -> None:
        try:
            record = Record.parse(rotation["record"])
            proof = [bytes.fromhex(h) for h in rotation["inclusion_proof"]]
        except (KeyError, TypeError, ValueError, RecordFormatError) as exc:
            raise _fail(KEYS, "format", f"malformed rotation: {exc}", origin, start - 1) from None
        previous = self.keys[-1][0]
        if (record.origin, record.seq, record.op, record.key_id) != (origin, start - 1, KEY_ROTATION,
                                                                     previous.key_id):
            raise _fail(KEYS, "key", "rotation record is not the previous key's key_rotation at the "
                        "seq before the new key", origin, record.seq)
        if record.details != {"new_key_id": key.key_id, "new_public_key": key.to_base64()}:
            raise _fail(KEYS, "key", "rotation record names another key", origin, record.seq)
        try:
            previous.verify(record.signature, record.signing_bytes())
        except VerificationError as exc:
            raise _fail(KEYS, "signature", exc.message, origin, record.seq) from None
        try:
            verify_inclusion(record.seq, cover.size, record.leaf_hash, proof, cover.root)
        except VerificationError as exc:
            raise _fail(KEYS, "inclusion", exc.message, origin, record.seq) from None

    def key_at(self, seq: int) -> PublicKey:
        """The key that signs record `seq` (and checkpoints of tree size `seq`)."""
        return [key for key, start in self.keys if start <= seq][-1]

    def all(self) -> list[PublicKey]:
        return [key for key, _ in self.keys]
