"""Offline verification of a log: raises VerificationError on the first failure, naming
the record (origin#seq) and the check; returns a summary otherwise, never a bool.

Needs only `cryptography` and `rfc8785`; `verify_store` imports the store lazily.

For each record, in order (docs/audit-format.md, "Verifying a log"):
  (1) format: a canonical record object;      (2) origin: the log's;
  (3) sequence: seq is the next one, no gap, no duplicate;
  (4) chain: prev = SHA-256 of the previous record's leaf bytes;
  (5) key: key_id is the key valid at this seq (trusted at the start, then
      as named by key_rotation records);    (6) signature: Ed25519 verifies;
  (7) the leaf joins the tree; each checkpoint at this size must be signed by
      the key valid at that size and carry this root (merkle_root); a
      checkpoint beyond the last record means the tail was cut (truncation).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass

from .checkpoint import Checkpoint, open_checkpoint
from .errors import RecordFormatError, VerificationError
from .fields import ZERO_HASH
from .keys import PublicKey
from .merkle import CompactRange, verify_consistency
from .ops import KEY_ROTATION
from .record import Record
from .sigcheck import SignatureChecks


class KeySchedule:
    """Which key signs which seq: `trusted` keys may start the log; a verified
    key_rotation record at seq r hands signing to the key it names from r + 1 on."""

    def __init__(self, trusted: Iterable[PublicKey], active: PublicKey | None = None) -> None:
        self.known = {k.key_id: k for k in trusted}
        self.active = active
        if active is not None:
            self.known[active.key_id] = active

    def key_for(self, record: Record) -> PublicKey:
        key = self.known.get(record.key_id)
        if key is None:
            raise VerificationError("key", f"unknown key id {record.key_id}",
                                    origin=record.origin, seq=record.seq)
        if self.active is None:  # the first record verified: any trusted key may have signed it
            self.active = key
        if key != self.active:
            raise VerificationError(
                "key", f"key {record.key_id[:16]}... is not valid at seq {record.seq}; "
                f"key {self.active.key_id[:16]}... signs there", origin=record.origin, seq=record.seq)
        return key

    def observe(self, record: Record) -> None:
        """Apply a verified key_rotation record."""
        if record.op != KEY_ROTATION:
            return
        try:
            new_key = PublicKey.from_raw(base64.b64decode(record.details["new_public_key"], validate=True))
            if new_key.key_id != record.details["new_key_id"]:
                raise ValueError("new_key_id is not the SHA-256 of new_public_key")
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise VerificationError("key", f"malformed key_rotation record: {exc}",
                                    origin=record.origin, seq=record.seq) from None
        self.known[new_key.key_id] = new_key
        self.active = new_key


@dataclass(frozen=True, slots=True)
class Summary:
    origin: str
    start: int  # first seq verified
    size: int  # tree size after the last record verified
    root: bytes
    checkpoints: int  # checkpoints verified against the recomputed root
    last_checkpoint: int | None  # size of the largest one


class LogVerifier:
    """Streams records through checks (1)-(7) with O(log n) memory.

    To verify a range that starts at `start` > 0, pass the compact range of the
    records before it (`prefix`, audit.merkle.decompose(0, start)) and the key
    schedule in force at `start`; `prev` may then be None (the Merkle root binds it)."""

    def __init__(self, origin: str, keys: KeySchedule | Iterable[PublicKey], *, start: int = 0,
                 prefix: Iterable[bytes] = (), prev: str | None = ZERO_HASH,
                 workers: int | None = None) -> None:
        self.origin = origin
        self.keys = keys if isinstance(keys, KeySchedule) else KeySchedule(keys)
        self.tree = CompactRange(start, prefix)
        self.start, self.prev = start, prev
        self.checkpoints, self.last_checkpoint = 0, None
        self.signatures = SignatureChecks(workers)  # (6) runs on worker threads; see finish()

    @property
    def size(self) -> int:
        return self.tree.size

    def fail(self, check: str, message: str, seq: int | None = None) -> VerificationError:
        return VerificationError(check, message, origin=self.origin, seq=self.size if seq is None else seq)

    def add_bytes(self, data: bytes) -> Record:
        try:
            record = Record.from_leaf_bytes(data)  # (1)
        except RecordFormatError as exc:
            raise self.earliest(self.fail("format", str(exc))) from None
        self.add(record)
        return record

    def add(self, record: Record) -> None:
        try:
            key = self._check(record)
        except VerificationError as exc:
            raise self.earliest(exc) from None
        failure = self.signatures.check(record.seq, key, record.signature, record.signing_bytes_from_leaf())
        if failure is not None:  # (6), reported as soon as a worker finds it
            raise self.earliest(self.fail("signature", failure[1], failure[0]))
        self.tree.append_leaf(record.leaf_hash)  # (7)
        self.prev = record.digest
        self.keys.observe(record)

    def _check(self, record: Record) -> PublicKey:
        expected = self.size
        if record.origin != self.origin:  # (2)
            raise self.fail("origin", f"record of log {record.origin!r} in log {self.origin!r}")
        if record.seq != expected:  # (3)
            if record.seq > expected:
                raise self.fail("sequence",
                                f"record {self.origin}#{expected} is missing (found #{record.seq})")
            raise self.fail("sequence", f"seq {record.seq} repeated or out of order (expected {expected})")
        if self.prev is not None and record.prev != self.prev:  # (4)
            raise self.fail("chain", "prev is not the hash of the previous record")
        return self.keys.key_for(record)  # (5)

    def earliest(self, error: VerificationError) -> VerificationError:
        """`error`, unless a signature check still running failed on an earlier record."""
        failure = self.signatures.drain()
        self.signatures.close()
        if failure is not None and (error.seq is None or failure[0] <= error.seq):
            return self.fail("signature", failure[1], failure[0])
        return error

    def check_checkpoint(self, note: str) -> Checkpoint:
        """Verify a checkpoint of the current tree size: signed by the key in force at this
        size, for this log, with the root recomputed from the records."""
        key = self.keys.active if self.keys.active is not None else None
        candidates = [key] if key is not None else list(self.keys.known.values())
        try:
            cp = open_checkpoint(note, candidates, self.origin)
        except VerificationError as exc:
            raise self.earliest(self.fail(exc.check, exc.message, seq=max(self.size - 1, 0))) from None
        if cp.size != self.size:
            raise self.earliest(self.fail("checkpoint_format",
                                          f"checkpoint size {cp.size} checked at size {self.size}"))
        if cp.root != self.tree.root():
            raise self.earliest(self.fail(
                "merkle_root", f"records 0..{self.size - 1} do not hash to the root of checkpoint "
                f"{self.origin}@{cp.size}", seq=self.size - 1))
        self.checkpoints += 1
        self.last_checkpoint = cp.size
        return cp

    def finish(self) -> None:
        """Wait for the outstanding signature checks; raises the earliest failure."""
        failure = self.signatures.drain()
        self.signatures.close()
        if failure is not None:
            raise self.fail("signature", failure[1], failure[0])

    def summary(self) -> Summary:
        self.finish()
        return Summary(self.origin, self.start, self.size, self.tree.root(), self.checkpoints,
                       self.last_checkpoint)


def verify_records(records: Iterable[Record | bytes], public_keys: Iterable[PublicKey], *,
                   origin: str | None = None, checkpoints: Iterable[str] = ()) -> Summary:
    """Verify a whole log from seq 0: records (Record objects or leaf bytes) in order,
    plus signed checkpoint notes, each checked when the stream reaches its size."""
    keys = list(public_keys)
    pending = sorted(((_note_size(n), n) for n in checkpoints), key=lambda p: p[0])
    stream = iter(records)
    item = next(stream, None)
    if item is None:
        if origin is None:
            raise VerificationError("sequence", "no records to verify")
        verifier = LogVerifier(origin, keys)
    else:
        first = item if isinstance(item, Record) else _peek_origin(item, origin)
        verifier = LogVerifier(origin or first.origin, keys)
    i = 0
    try:
        while i < len(pending) and pending[i][0] == 0:
            verifier.check_checkpoint(pending[i][1])
            i += 1
        while item is not None:
            verifier.add(item) if isinstance(item, Record) else verifier.add_bytes(item)
            while i < len(pending) and pending[i][0] == verifier.size:
                verifier.check_checkpoint(pending[i][1])
                i += 1
            item = next(stream, None)
        if i < len(pending):
            size = pending[i][0]
            raise VerificationError(
                "truncation", f"checkpoint {verifier.origin}@{size} covers records up to #{size - 1} "
                f"but the log ends at #{verifier.size - 1}", origin=verifier.origin, seq=verifier.size)
        return verifier.summary()
    except VerificationError as exc:  # e.g. from the store's column check: report the earliest
        raise verifier.earliest(exc) from None
    finally:
        verifier.signatures.close()
        close = getattr(stream, "close", None)
        if close is not None:  # a generator over the store: end its read now, not at GC
            close()


def verify_store(url_or_store, origin: str, public_keys: Iterable[PublicKey]) -> Summary:
    """Verify the log `origin` as stored: every body, the columns copied out of it, every checkpoint."""
    from .store import AuditStore  # the store extra is only needed here

    store = AuditStore(url_or_store) if isinstance(url_or_store, str) else url_or_store
    notes = [cp.note for cp in store.checkpoints(origin)]
    return verify_records(_checked_rows(store, origin), public_keys, origin=origin, checkpoints=notes)


def _checked_rows(store, origin: str) -> Iterable[Record]:
    with closing(store.iter_rows(origin)) as rows:  # a failure ends the read at once
        yield from _checked(rows, origin)


def _checked(rows, origin: str) -> Iterable[Record]:
    from .store import _row, stored_columns

    expected = 0
    for row in rows:
        data = row.body.encode("utf-8")
        try:
            record = Record.from_leaf_bytes(data)
        except RecordFormatError as exc:
            raise VerificationError("format", str(exc), origin=origin, seq=row.seq) from None
        yield record  # checks (1)-(7) run on it before the generator resumes here
        if row.seq != expected or stored_columns(row) != _row(record):
            raise VerificationError("columns", "query columns disagree with the signed body",
                                    origin=origin, seq=record.seq)
        expected += 1


def verify_checkpoint_consistency(old_note: str, new_note: str, proof: list[bytes],
                                  keys: PublicKey | Iterable[PublicKey]) -> tuple[Checkpoint, Checkpoint]:
    """Both checkpoints signed by `keys`, same log, and the new tree extends the old."""
    old, new = open_checkpoint(old_note, keys), open_checkpoint(new_note, keys, None)
    if old.origin != new.origin:
        raise VerificationError("consistency", f"checkpoints of two logs ({old.origin}, {new.origin})")
    verify_consistency(old.size, new.size, old.root, new.root, proof)
    return old, new


def _note_size(note: str) -> int:
    from .checkpoint import split_note

    return Checkpoint.parse_text(split_note(note)[0]).size


def _peek_origin(data: bytes, origin: str | None) -> Record:
    try:
        return Record.from_leaf_bytes(data)
    except RecordFormatError as exc:
        raise VerificationError("format", str(exc), origin=origin, seq=0) from None
