"""Erasure receipts: proof to a requester that their erasure is recorded in the log.

A receipt (docs/audit-format.md, "Erasure receipts") is a JSON object holding the
signed erase record, its RFC 9162 inclusion proof into a signed checkpoint that
covers it, that checkpoint, and the log's public key. Anyone with the public
key checks it offline with `verify_receipt`.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from .checkpoint import open_checkpoint
from .errors import ReceiptError, RecordFormatError, VerificationError
from .keys import PublicKey
from .merkle import verify_inclusion
from .ops import ERASE_OPS
from .record import Record

RECEIPT_FORMAT = "kvguard-erasure-receipt/v1"


def build_receipt(record: Record, checkpoint_note: str, tree_size: int, proof: list[bytes],
                  public_key: PublicKey) -> dict[str, Any]:
    return {
        "format": RECEIPT_FORMAT,
        "origin": record.origin,
        "record": record.to_dict(),
        "leaf_index": record.seq,
        "tree_size": tree_size,
        "inclusion_proof": [h.hex() for h in proof],
        "checkpoint": checkpoint_note,
        "public_key": public_key.to_base64(),
    }


def receipt_parts(store, record: Record, max_size: int | None = None):
    """The record's public key and the first checkpoint that covers the record and is signed
    by that same key (None if there is none yet)."""
    key = next((k.key for k in store.keys(record.origin) if k.key.key_id == record.key_id), None)
    if key is None:
        raise ReceiptError(f"key {record.key_id} of record {record.ref} is not registered")
    cps = store.checkpoints(record.origin, min_size=record.seq + 1, max_size=max_size)
    return key, next((c for c in cps if c.key_id == record.key_id), None)


def make_receipt(log, erase_record_seq: int) -> dict[str, Any]:
    """The receipt of record `erase_record_seq` of an open AuditLog, against the first
    checkpoint that covers it and is signed by the record's own key (issuing one now if
    none does yet)."""
    record = log.store.record(log.origin, erase_record_seq)
    if record.op not in ERASE_OPS:
        raise ReceiptError(f"record {record.ref} is a {record.op!r} record, not an erasure")
    key, cp = receipt_parts(log.store, record)
    if cp is None:
        cp = log.checkpoint()
        if cp.key_id != record.key_id:  # cannot happen: a rotation checkpoints first
            raise ReceiptError(f"no checkpoint signed by the key of record {record.ref}")
    proof = log.inclusion_proof(record.seq, cp.size)
    return build_receipt(record, cp.note, cp.size, proof, key)


def verify_receipt(receipt: dict[str, Any], public_key: PublicKey) -> Record:
    """Check a receipt against the log's public key; returns the erase record, raises
    VerificationError naming the record and the failed check."""
    def fail(check: str, message: str, seq: int | None = None) -> VerificationError:
        return VerificationError(check, message, origin=receipt.get("origin"), seq=seq)

    # (1) shape
    if not isinstance(receipt, dict) or receipt.get("format") != RECEIPT_FORMAT:
        raise fail("format", f"not a {RECEIPT_FORMAT} object")
    try:
        record = Record.parse(receipt["record"])
        index, size = receipt["leaf_index"], receipt["tree_size"]
        proof = [bytes.fromhex(h) for h in receipt["inclusion_proof"]]
        note = receipt["checkpoint"]
        shipped_key = PublicKey.from_raw(base64.b64decode(receipt["public_key"], validate=True))
    except (KeyError, TypeError, ValueError, binascii.Error, RecordFormatError) as exc:
        raise fail("format", f"malformed receipt: {exc}") from None
    seq = record.seq
    # (2) what it claims
    if record.op not in ERASE_OPS:
        raise fail("format", f"record is a {record.op!r} record, not an erasure", seq)
    if record.origin != receipt["origin"] or index != seq:
        raise fail("format", "origin or leaf_index disagree with the record", seq)
    # (3) the key: the one the verifier trusts, and the one that signed
    if shipped_key != public_key or record.key_id != public_key.key_id:
        raise fail("key", f"record is signed by key {record.key_id[:16]}..., not the trusted key", seq)
    # (4) the record's signature
    try:
        public_key.verify(record.signature, record.signing_bytes())
    except VerificationError as exc:
        raise fail("signature", exc.message, seq) from None
    # (5) the checkpoint's signature, for this log and size
    try:
        cp = open_checkpoint(note, public_key, record.origin)
    except VerificationError as exc:
        raise fail(exc.check, exc.message, seq) from None
    if cp.size != size:
        raise fail("checkpoint_format", f"tree_size {size} but the checkpoint is of size {cp.size}", seq)
    # (6) the record is in the tree the checkpoint commits to
    try:
        verify_inclusion(seq, size, record.leaf_hash, proof, cp.root)
    except VerificationError as exc:
        raise fail("inclusion", exc.message, seq) from None
    return record


FLEET_RECEIPT_FORMAT = "kvguard-fleet-erasure-receipt/v1"


def verify_fleet_receipt(receipt: dict[str, Any], public_keys: list[PublicKey]) -> list[Record]:
    """Check a fleet receipt (one erasure request carried out by several logs) against the
    fleet's public keys; returns each origin's erase record. Every origin's receipt must
    verify under a trusted key, every record must be of this request and state the same
    fleet (origins taking part, exclusions and their reasons), and the receipt must hold
    one receipt for each origin that fleet names: none left out, none added."""
    def fail(check: str, message: str, origin: str | None = None, seq: int | None = None) -> VerificationError:
        return VerificationError(check, message, origin=origin, seq=seq)

    # (1) shape
    if not isinstance(receipt, dict) or receipt.get("format") != FLEET_RECEIPT_FORMAT:
        raise fail("format", f"not a {FLEET_RECEIPT_FORMAT} object")
    request, origins, excluded, parts = (receipt.get(k) for k in ("request", "origins", "excluded", "receipts"))
    if not (isinstance(request, str) and isinstance(origins, list) and isinstance(excluded, list)
            and isinstance(parts, list) and parts):
        raise fail("format", "malformed fleet receipt: request, origins, excluded and receipts are required")
    by_id = {k.key_id: k for k in public_keys}
    records = []
    for part in parts:
        # (2) each origin's receipt, under the trusted key that signed its record
        key_id = part.get("record", {}).get("key_id") if isinstance(part, dict) else None
        key = by_id.get(key_id)
        if key is None:
            raise fail("key", f"no trusted public key with id {str(key_id)[:16]}...: give every origin's key",
                       part.get("origin") if isinstance(part, dict) else None)
        record = verify_receipt(part, key)
        # (3) of this request, stating this fleet
        details = record.details
        if details.get("request") != request:
            raise fail("request", f"the record is of request {details.get('request')!r}, not {request!r}",
                       record.origin, record.seq)
        if details.get("fleet") != {"origins": origins, "excluded": excluded}:
            raise fail("fleet", "the record states another fleet than the receipt", record.origin, record.seq)
        records.append(record)
    # (4) one receipt per origin the fleet names
    got = [r.origin for r in records]
    if sorted(got) != sorted(origins) or len(set(got)) != len(got):
        missing, extra = sorted(set(origins) - set(got)), sorted(set(got) - set(origins))
        raise fail("fleet", f"the receipts do not match the fleet: missing {missing}, unexpected {extra}, "
                            f"or an origin twice")
    return records
