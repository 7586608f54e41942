"""The bundle container: member names, their order and media types, and safe reading.

A bundle is a zip file whose members are exactly, in this order:

    records.jsonl        the records in range, one leaf-bytes line each
    checkpoints.json     the signed checkpoints from the range start to the covering one
    proofs.json          compact ranges around the records, consistency proofs
    keys.json            the log's public keys and the rotation records naming them
    receipts.jsonl       one erasure receipt per erase record in range
    manifest.dsse.json   DSSE envelope of an in-toto Statement listing the others' SHA-256
"""

from __future__ import annotations

import zipfile
from typing import IO

from ..errors import VerificationError

RECORDS, CHECKPOINTS, PROOFS, KEYS, RECEIPTS, MANIFEST = (
    "records.jsonl", "checkpoints.json", "proofs.json", "keys.json", "receipts.jsonl", "manifest.dsse.json",
)
MEMBERS = (RECORDS, CHECKPOINTS, PROOFS, KEYS, RECEIPTS, MANIFEST)
MEDIA_TYPES = {
    RECORDS: "application/vnd.kvguard.audit.records+jsonl",
    CHECKPOINTS: "application/vnd.kvguard.audit.checkpoints+json",
    PROOFS: "application/vnd.kvguard.audit.proofs+json",
    KEYS: "application/vnd.kvguard.audit.keys+json",
    RECEIPTS: "application/vnd.kvguard.audit.receipts+jsonl",
    MANIFEST: "application/vnd.dsse.envelope.v1+json",
}
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PREDICATE_TYPE = "https://kvguard.dev/audit-bundle/v1"
BUNDLE_FORMAT = 1
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed member times: the same export gives the same bytes
MAX_SMALL_MEMBER = 256 << 20  # members read whole; records.jsonl is streamed


def open_zip(path: str, member: str | None = None) -> zipfile.ZipFile:
    """Open a bundle and insist on exactly the expected members, in order."""
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise VerificationError("container", f"not a readable zip file: {exc}", member=member) from None
    names = [info.filename for info in zf.infolist()]
    if tuple(names) != MEMBERS:
        zf.close()
        raise VerificationError("container", f"members are {names}, expected {list(MEMBERS)}", member=member)
    for info in zf.infolist():
        if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            zf.close()
            raise VerificationError("container", "encrypted or unsupported compression", member=info.filename)
    return zf


def read_small(zf: zipfile.ZipFile, name: str) -> bytes:
    info = zf.getinfo(name)
    if info.file_size > MAX_SMALL_MEMBER:
        raise VerificationError("container", f"{info.file_size} bytes is too large", member=name)
    try:
        with zf.open(info) as fh:
            return fh.read(MAX_SMALL_MEMBER + 1)
    except (zipfile.BadZipFile, OSError) as exc:  # e.g. a CRC mismatch
        raise VerificationError("container", f"cannot read member: {exc}", member=name) from None


def stream(zf: zipfile.ZipFile, name: str) -> IO[bytes]:
    return zf.open(name)
