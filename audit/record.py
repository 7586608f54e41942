"""The audit record: its fields, its canonical bytes, its hashes.

Byte definitions (docs/audit-format.md, "Records"):

* signing bytes = RFC 8785 JSON of the record without `sig`; `sig` is Ed25519
  over them, in standard base64;
* leaf bytes = RFC 8785 JSON of the record with `sig` (the stored and shipped
  form, one line of a bundle's records.jsonl);
* `prev` of record n+1 = hex SHA-256(leaf bytes of record n), 64 zeros at seq 0;
* Merkle leaf hash = SHA-256(0x00 || leaf bytes) (RFC 9162).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

from . import fields as f
from .canonical import loads, record_bytes, subject_bytes
from .errors import RecordFormatError
from .merkle import leaf_hash as merkle_leaf_hash

_FIELDS = ("v", "origin", "seq", "time", "op", "subject", "details", "prev", "key_id", "sig")


@dataclass(frozen=True, slots=True)
class Record:
    """One signed (or, before signing, unsigned) audit record. Build with `Record.parse`
    from untrusted input; the writer builds it from already-validated parts."""

    origin: str
    seq: int
    time: str
    op: str
    subject: dict[str, str]
    details: dict[str, Any]
    prev: str
    key_id: str
    sig: str = ""
    v: int = f.FORMAT_VERSION
    # The leaf bytes and leaf hash, computed once: hashing, storing and exporting all need them.
    _leaf: bytes = field(default=b"", repr=False, compare=False)
    _leaf_hash: bytes = field(default=b"", repr=False, compare=False)

    @property
    def ref(self) -> str:
        """`origin#seq`, how errors and docs name a record."""
        return f"{self.origin}#{self.seq}"

    def unsigned_dict(self) -> dict[str, Any]:
        return {
            "v": self.v,
            "origin": self.origin,
            "seq": self.seq,
            "time": self.time,
            "op": self.op,
            "subject": self.subject,
            "details": self.details,
            "prev": self.prev,
            "key_id": self.key_id,
        }

    def to_dict(self) -> dict[str, Any]:
        d = self.unsigned_dict()
        d["sig"] = self.sig
        return d

    def signing_bytes(self) -> bytes:
        return record_bytes(self.unsigned_dict())

    def with_signature(self, sig: bytes, signing_bytes: bytes | None = None) -> Record:
        """The signed record. Given the signing bytes, the leaf bytes are spliced from them:
        in key order `sig` sits right before `subject`, and the last `,"subject":{` of the
        signing bytes is the top-level one (only pseudonyms, time and v follow it)."""
        b64 = base64.b64encode(sig).decode("ascii")
        if signing_bytes is None:
            leaf = record_bytes({**self.unsigned_dict(), "sig": b64})
        else:
            cut = signing_bytes.rindex(b',"subject":{') + 1
            leaf = b"".join(
                (signing_bytes[:cut], b'"sig":"', b64.encode("ascii"), b'",', signing_bytes[cut:]))
        return Record(self.origin, self.seq, self.time, self.op, self.subject, self.details, self.prev,
                      self.key_id, b64, self.v, leaf)

    @classmethod
    def sign_new(cls, key, origin: str, seq: int, time: str, op: str, subject: dict[str, str],
                 details: dict[str, Any], prev: str) -> Record:
        """Build and sign a record from validated parts in one go (the writer's hot path;
        see `sign_leaf`). The leaf hash is computed here, on the signer's side."""
        leaf, sig, leaf_hash = sign_leaf(key, origin, seq, time, op, *encode_parts(subject, details), prev)
        return build_signed(origin, seq, time, op, subject, details, prev, key.key_id, sig, leaf, leaf_hash)

    @property
    def signature(self) -> bytes:
        return base64.b64decode(self.sig)

    @property
    def leaf_bytes(self) -> bytes:
        if not self.sig:
            raise RecordFormatError(f"record {self.ref} is not signed yet")
        if not self._leaf:
            object.__setattr__(self, "_leaf", record_bytes(self.to_dict()))
        return self._leaf

    @property
    def digest(self) -> str:
        """Hex SHA-256 of the leaf bytes: the next record's `prev`."""
        return hashlib.sha256(self.leaf_bytes).hexdigest()

    @property
    def leaf_hash(self) -> bytes:
        if not self._leaf_hash:
            object.__setattr__(self, "_leaf_hash", merkle_leaf_hash(self.leaf_bytes))
        return self._leaf_hash

    @property
    def time_ms(self) -> int:
        return f.parse_time(self.time)

    @classmethod
    def parse(cls, obj: dict[str, Any]) -> Record:
        """Validate every field of a signed record object; raises RecordFormatError."""
        if not isinstance(obj, dict):
            raise RecordFormatError("a record must be a JSON object")
        if set(obj) != set(_FIELDS):
            missing = sorted(set(_FIELDS) - set(obj))
            extra = sorted(set(obj) - set(_FIELDS))
            raise RecordFormatError(f"record fields: missing {missing}, unexpected {extra}")
        if obj["v"] != f.FORMAT_VERSION or type(obj["v"]) is not int:
            raise RecordFormatError(f"unsupported record format version {obj['v']!r}")
        f.parse_time(obj["time"])
        subject = obj["subject"]
        if not isinstance(subject, dict):
            raise RecordFormatError("subject must be an object")
        details = obj["details"]
        if not isinstance(details, dict):
            raise RecordFormatError("details must be an object")
        return cls(
            origin=f.check_origin(obj["origin"]),
            seq=f.check_seq(obj["seq"]),
            time=obj["time"],
            op=f.check_op(obj["op"]),
            subject=f.check_subject(subject),
            details=f.check_details(details),
            prev=f.check_hex64(obj["prev"], "prev"),
            key_id=f.check_hex64(obj["key_id"], "key_id"),
            sig=f.check_sig(obj["sig"]),
        )

    @classmethod
    def from_leaf_bytes(cls, data: bytes) -> Record:
        """Parse one stored/shipped record and insist the bytes are canonical, so the
        bytes that were hashed are the only spelling of this record."""
        try:
            obj = loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecordFormatError(f"record is not JSON: {exc}") from None
        record = cls.parse(obj)
        if record.leaf_bytes != data:
            raise RecordFormatError("record bytes are not canonical RFC 8785 JSON")
        return record

    def signing_bytes_from_leaf(self) -> bytes:
        """The signing bytes cut out of the (canonical) leaf bytes: the exact inverse of the
        splice in with_signature, and one JSON encoding cheaper than signing_bytes()."""
        member = b'"sig":"' + self.sig.encode("ascii") + b'",'
        cut = self.leaf_bytes.rindex(b',"sig":"') + 1
        return self.leaf_bytes[:cut] + self.leaf_bytes[cut + len(member):]


_new = object.__new__
_PUT = tuple(getattr(Record, name).__set__ for name in (
    "origin", "seq", "time", "op", "subject", "details", "prev", "key_id", "sig", "v", "_leaf", "_leaf_hash"))


def build_signed(origin: str, seq: int, time: str, op: str, subject: dict[str, str],
                 details: dict[str, Any], prev: str, key_id: str, sig: str, leaf: bytes,
                 leaf_hash: bytes) -> Record:
    """A signed Record from parts its writer produced together (`Record.sign_new`, the
    signer process): set field by field through the slots, as a frozen dataclass's
    __init__ costs twice as much and this runs once per record."""
    r = _new(Record)
    for put, value in zip(_PUT, (origin, seq, time, op, subject, details, prev, key_id, sig,
                                 f.FORMAT_VERSION, leaf, leaf_hash)):
        put(r, value)
    return r


def encode_parts(subject: dict[str, str], details: dict[str, Any]) -> tuple[bytes, bytes]:
    """(details, subject) as canonical JSON: the parts of a record that do not depend on
    its place in the chain, so callers' threads can encode them before the signer runs."""
    return record_bytes(details), subject_bytes(subject)


def sign_leaf(key, origin: str, seq: int, time: str, op: str, details_json: bytes,
              subject_json: bytes, prev: str) -> tuple[bytes, str, bytes]:
    """(leaf bytes, base64 signature, leaf hash) of a record from validated parts, with
    details and subject already encoded (`encode_parts`).

    The canonical bytes are assembled around the two encoded objects: in RFC 8785 key
    order the members are details, key_id, op, origin, prev, seq, [sig,] subject, time,
    v, and the validated origin, op, hex ids and time contain nothing JSON escapes."""
    head = b'{"details":%b,"key_id":"%b","op":"%b","origin":"%b","prev":"%b","seq":%d,' % (
        details_json, key.key_id.encode(), op.encode(), origin.encode(), prev.encode(), seq)
    tail = b'"subject":%b,"time":"%b","v":%d}' % (subject_json, time.encode(), f.FORMAT_VERSION)
    b64 = base64.b64encode(key.sign(head + tail))
    leaf = b'%b"sig":"%b",%b' % (head, b64, tail)
    return leaf, b64.decode("ascii"), merkle_leaf_hash(leaf)
