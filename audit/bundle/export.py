"""Export one log range as a sealed bundle (needs the store extra).

Streams: records go from a server-side cursor straight into the zip member
while their digest is computed, so a million-record export holds one batch in
memory (plus the tree's cached upper levels, audit.tree). Every record is
verified on the way (signature, key, chain, leaf hash) and the covering
checkpoint's note against the exporting key: an export refuses, naming the
first bad record, rather than seal what it did not check.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import zipfile
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any

from ..canonical import canonical
from ..checkpoint import open_checkpoint
from ..cosignature import with_cosignatures
from ..errors import BundleError, RecordFormatError, StoreError, VerificationError
from ..fields import ZERO_HASH, format_time
from ..keys import SigningKey
from ..receipt import ERASE_OPS, build_receipt, receipt_parts
from ..record import Record
from ..store import AuditStore, CheckpointEntry
from ..tree import HashTree
from ..verify import KeySchedule, LogVerifier
from .dsse import sign_envelope
from .layout import (
    BUNDLE_FORMAT,
    CHECKPOINTS,
    KEYS,
    MANIFEST,
    MEDIA_TYPES,
    MEMBERS,
    PREDICATE_TYPE,
    PROOFS,
    RECEIPTS,
    RECORDS,
    STATEMENT_TYPE,
    ZIP_TIME,
)


@dataclass(frozen=True, slots=True)
class ExportSummary:
    path: str
    origin: str
    from_seq: int
    to_seq: int  # inclusive
    tree_size: int
    records: int
    receipts: int
    seconds: float
    tail_failure: VerificationError | None = None  # a record past the last checkpoint that fails, with warn_tail


def export_bundle(store: AuditStore, origin: str, out_path: str, key: SigningKey, *,
                  from_seq: int | None = None, to_seq: int | None = None,
                  since_ms: int | None = None, until_ms: int | None = None,
                  progress: bool = True, witnessed: bool = False, warn_tail: bool = False) -> ExportSummary:
    """Write the bundle of records [from_seq, to_seq] (or since <= time < until; default
    everything a checkpoint covers) to `out_path`, its manifest signed by `key`, the log's key
    at the bundle's tree size. Checkpoints carry their stored witness cosignatures; with
    `witnessed`, the bundle is covered by the log's latest cosigned checkpoint, whose fresh
    cosignatures `verify --witness-key` requires. The records stored past the log's last
    checkpoint, which no bundle can prove yet, are verified too: one that fails refuses the
    export, or with `warn_tail` is returned in the summary's `tail_failure`."""
    from ..cosigstore import cosignature_lines

    started = time.perf_counter()
    first, last, cp = _resolve_range(store, origin, from_seq, to_seq, since_ms, until_ms)
    _check_key_table(store, origin)  # before the manifest key is matched against it
    tail_failure = _check_tail(store, origin, warn_tail)
    if witnessed:
        cp = _latest_cosigned(store, origin, last)
    cp = _cover_signed_by(store, origin, last, cp, key)
    end, size = last + 1, cp.size
    tree = HashTree(8, lambda a, b: store.leaf_hashes(origin, a, b))
    tree.extend(leaf for _, leaf in store.iter_leaves(origin, 0, size))
    try:  # the note's root, under the key that signs the manifest: not the root_hash column
        signed = open_checkpoint(cp.note, [key.public_key], origin)
    except VerificationError as exc:
        raise _refused(exc.check, f"checkpoint {origin}@{size}: {exc.message}", origin, size - 1) from None
    cosigned = cosignature_lines(store, origin, min_size=first, max_size=size)  # those of listed checkpoints
    checkpoints = [_cosigned(c, cosigned) for c in store.checkpoints(origin, min_size=first, max_size=size)]
    keys = [k for k in store.keys(origin) if k.valid_from_seq <= size]  # incl. the key that signs `size`
    verifier = _body_verifier(store, origin, first, keys, tree)

    directory = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(prefix=".bundle-", dir=directory)
    os.close(fd)
    digests: dict[str, str] = {}
    try:
        with zipfile.ZipFile(tmp, "w", allowZip64=True) as zf:
            erases = _write_records(zf, store, origin, first, end, digests, progress, verifier)
            # after the records, so that a body edited with its leaf hash is named by its own check
            if signed.size != size or tree.root() != signed.root:
                raise _refused("merkle_root", f"stored leaf hashes do not hash to the root of checkpoint "
                               f"{origin}@{size}", origin, size - 1)
            _write(zf, CHECKPOINTS, canonical({"checkpoints": [
                {"tree_size": c.size, "note": c.note} for c in checkpoints]}) + b"\n", digests)
            _write(zf, PROOFS, canonical({
                "tree_size": size, "range": [first, end],
                "prefix": _hex(tree.compact(0, first)),
                "suffix": _hex(tree.compact(end, size)),
                "consistency": [
                    {"from": c.size, "to": size, "proof": _hex(tree.consistency_proof(c.size, size))}
                    for c in checkpoints if c.size < size],
            }) + b"\n", digests)
            _write(zf, KEYS, canonical(_keys_member(store, origin, keys, tree, size)) + b"\n", digests)
            receipts = [_receipt(store, r, tree, cosigned) for r in erases]
            _write(zf, RECEIPTS, b"".join(canonical(r) + b"\n" for r in receipts), digests)
            statement = {
                "_type": STATEMENT_TYPE,
                "subject": [{"name": n, "digest": {"sha256": digests[n]}} for n in MEMBERS if n != MANIFEST],
                "predicateType": PREDICATE_TYPE,
                "predicate": {
                    "format": BUNDLE_FORMAT, "origin": origin,
                    "range": {"from_seq": first, "to_seq": last, "count": end - first,
                              **({"since": format_time(since_ms)} if since_ms is not None else {}),
                              **({"until": format_time(until_ms)} if until_ms is not None else {})},
                    "tree_size": size, "root_hash": cp.root.hex(), "receipts": len(receipts),
                    "exported_at": format_time(time.time_ns() // 1_000_000),
                    "members": [{"name": n, "mediaType": MEDIA_TYPES[n]} for n in MEMBERS],
                },
            }
            _write(zf, MANIFEST, sign_envelope(statement, key), digests)
        os.replace(tmp, out_path)
    except BaseException:
        os.unlink(tmp)
        raise
    return ExportSummary(out_path, origin, first, last, size, end - first, len(receipts),
                         time.perf_counter() - started, tail_failure)


def _check_key_table(store: AuditStore, origin: str) -> None:
    """The keys table against the stored key_rotation records and the key id of #0 (audit.check
    (3)), so that a replaced or added key row is named as such, not as a manifest key that
    signs no checkpoint. The records themselves are verified as they are exported."""
    from ..check import check_keys, key_rows
    from ..ops import KEY_ROTATION

    try:
        first = store.record(origin, 0)
    except StoreError:
        return  # no #0: the pass over the records names it
    try:
        rotations = [Record.from_leaf_bytes(body.encode("utf-8")) for body in store.bodies_of(origin, KEY_ROTATION)]
        check_keys(store, origin, key_rows(store, origin), first.key_id, rotations, store.size(origin))
    except VerificationError as exc:
        raise _refused(exc.check, exc.message, origin, exc.seq) from None
    except RecordFormatError:
        return  # a malformed rotation record: the pass over the records names it


def _check_tail(store: AuditStore, origin: str, warn: bool) -> VerificationError | None:
    """Verify the records past the last checkpoint as the writer does before chaining onto
    them (audit.adopt): they are in no bundle yet, but one that fails shows the store was
    written to by someone without the log's key."""
    from ..adopt import Tail, _adopt_row
    from ..errors import TamperedLogError

    latest = store.latest_checkpoint(origin)
    if latest is None or store.size(origin) <= latest.size:
        return None
    keys = store.keys(origin)
    active = [k.key for k in keys if k.valid_from_seq <= latest.size][-1]
    tail = Tail(latest.size, store.record(origin, latest.size - 1).digest if latest.size else ZERO_HASH,
                KeySchedule([k.key for k in keys], active))
    sink = HashTree()
    try:
        with closing(store.iter_rows(origin, latest.size)) as rows:
            for row in rows:
                _adopt_row(origin, tail, sink, row)
    except TamperedLogError as exc:
        f = exc.failure
        failure = VerificationError(f.check, f"past the last checkpoint ({origin}@{latest.size}), which no bundle "
                                    f"covers yet: {f.message}", origin=f.origin, seq=f.seq)
        if not warn:
            raise _refused(failure.check, failure.message, origin, failure.seq) from None
        return failure
    return None


def _resolve_range(store: AuditStore, origin: str, from_seq, to_seq, since_ms, until_ms
                   ) -> tuple[int, int, CheckpointEntry]:
    if not store.has_log(origin):
        raise BundleError(f"no log {origin!r} in this store")
    latest = store.latest_checkpoint(origin)
    if latest is None or latest.size == 0:
        raise BundleError(f"log {origin} has no checkpoint yet: nothing can be exported and proven")
    if since_ms is not None or until_ms is not None:
        if from_seq is not None or to_seq is not None:
            raise BundleError("give a sequence range or a time range, not both")
        found = store.seq_range(origin, since_ms, until_ms)
        if found is None:
            raise BundleError("no records in that time range")
        from_seq, to_seq = found
    first = 0 if from_seq is None else from_seq
    last = latest.size - 1 if to_seq is None else to_seq
    if not 0 <= first <= last:
        raise BundleError(f"empty or negative range {first}..{last}")
    if last >= latest.size:
        raise BundleError(f"records after #{latest.size - 1} are not covered by a checkpoint yet; "
                          "wait for the next one or export an earlier range")
    cp = store.checkpoint_covering(origin, last)
    assert cp is not None
    return first, last, cp


def _cover_signed_by(store: AuditStore, origin: str, last: int, cp: CheckpointEntry, key: SigningKey
                     ) -> CheckpointEntry:
    """The covering checkpoint: the smallest after #last that `key` signs, since a verifier
    accepts a manifest only from the key valid at the tree size. After a rotation the current
    key still exports an older range, under a later checkpoint."""
    keys = store.keys(origin)

    def signer(size: int):
        return [k.key for k in keys if k.valid_from_seq <= size][-1]

    if signer(cp.size) == key.public_key:
        return cp
    kid = key.public_key.key_id[:16]
    later = [k.valid_from_seq for k in keys if k.key == key.public_key and k.valid_from_seq > cp.size]
    if not later:
        raise BundleError(f"key {kid}... signs no checkpoint of {origin} covering #{last} (key "
                          f"{signer(cp.size).key_id[:16]}... signs the one at {cp.size}): sign the manifest "
                          "with the log's key at the bundle's tree size")
    found = store.checkpoint_covering(origin, later[0] - 1)
    if found is None or signer(found.size) != key.public_key:
        raise BundleError(f"no checkpoint signed by key {kid}... covers #{last} yet: wait for the next one")
    return found


def _hex(hashes: list[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def _write(zf: zipfile.ZipFile, name: str, data: bytes, digests: dict[str, str]) -> None:
    zf.writestr(_info(name), data)
    digests[name] = hashlib.sha256(data).hexdigest()


def _info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def _write_records(zf, store, origin, first, end, digests, progress, verifier: LogVerifier) -> list[Record]:
    """Stream the bodies into the records member, each verified before it is written (a
    bundle is sealed over nothing unchecked): checks (1)-(6) of §7 and its stored leaf
    hash, which the checkpoint's root binds."""
    from tqdm import tqdm

    sha, erases = hashlib.sha256(), []
    bar = tqdm(total=end - first, unit="rec", unit_scale=True, desc=f"export {origin}",
               file=sys.stderr, disable=not progress, mininterval=0.5)
    try:
        with zf.open(_info(RECORDS), "w", force_zip64=True) as out, \
                closing(store.iter_bodies(origin, first, end)) as bodies:  # a refusal ends the read
            chunk: list[bytes] = []
            for seq, body, _sig, leaf in bodies:
                line = body.encode("utf-8") + b"\n"
                record = verifier.add_bytes(line[:-1])
                if record.leaf_hash != leaf:
                    raise _refused("leaf_hash", "the body does not hash to the stored leaf", origin, seq)
                chunk.append(line)
                if record.op in ERASE_OPS:
                    erases.append(record)
                if len(chunk) == 4096:
                    _flush(out, sha, chunk, bar)
            _flush(out, sha, chunk, bar)
            verifier.finish()
            if verifier.size != end:
                raise _refused("sequence", f"record {origin}#{verifier.size} is missing", origin, verifier.size)
    except VerificationError as exc:
        if exc.message.endswith(_REFUSED):
            raise
        raise _refused(exc.check, exc.message, origin, exc.seq) from None
    finally:
        verifier.signatures.close()
        bar.close()
    digests[RECORDS] = sha.hexdigest()
    return erases


def _body_verifier(store: AuditStore, origin: str, first: int, keys, tree: HashTree) -> LogVerifier:
    """A verifier positioned at record `first`: the key in force there, and the chain's tail
    (the digest of record first - 1, whose leaf the checkpoint's root binds)."""
    active = [k.key for k in keys if k.valid_from_seq <= first][-1]
    prev = ZERO_HASH
    if first > 0:
        before = store.record(origin, first - 1)
        if before.leaf_hash != tree.leaf(first - 1):
            raise _refused("leaf_hash", "the body does not hash to the stored leaf", origin, first - 1)
        prev = before.digest
    return LogVerifier(origin, KeySchedule([k.key for k in keys], active), start=first,
                       prefix=tree.compact(0, first), prev=prev)


_REFUSED = "; nothing was exported: run `kvguard audit check`"


def _refused(check: str, message: str, origin: str, seq: int | None) -> VerificationError:
    return VerificationError(check, message + _REFUSED, origin=origin, seq=seq)


def _flush(out, sha, chunk: list[bytes], bar) -> None:
    data = b"".join(chunk)
    out.write(data)
    sha.update(data)
    bar.update(len(chunk))
    chunk.clear()


def _keys_member(store: AuditStore, origin: str, keys, tree: HashTree, size: int) -> dict[str, Any]:
    entries = []
    for k in keys:
        rotation = None
        if k.rotation_seq is not None:
            rotation = {"record": store.record(origin, k.rotation_seq).to_dict(),
                        "inclusion_proof": _hex(tree.inclusion_proof(k.rotation_seq, size))}
        entries.append({"key_id": k.key.key_id, "public_key": k.key.to_base64(),
                        "valid_from_seq": k.valid_from_seq, "rotation": rotation})
    return {"origin": origin, "tree_size": size, "keys": entries}


def _receipt(store: AuditStore, record: Record, tree: HashTree, cosigned: dict[int, list[str]]
             ) -> dict[str, Any]:
    key, cp = receipt_parts(store, record, max_size=tree.size)
    if cp is None:  # cannot happen: the covering checkpoint, or the one before a rotation, qualifies
        raise BundleError(f"no checkpoint signed by the key of record {record.ref}")
    cp = _cosigned(cp, cosigned)
    return build_receipt(record, cp.note, cp.size, tree.inclusion_proof(record.seq, cp.size), key)


def _cosigned(cp: CheckpointEntry, cosigned: dict[int, list[str]]) -> CheckpointEntry:
    """The checkpoint with its witnesses' cosignature lines appended to its note (C2SP
    tlog-cosignature: one signed note, the log's signature first)."""
    lines = cosigned.get(cp.size)
    return replace(cp, note=with_cosignatures(cp.note, lines)) if lines else cp


def _latest_cosigned(store: AuditStore, origin: str, last: int) -> CheckpointEntry:
    from ..cosigstore import latest_cosigned_size

    size = latest_cosigned_size(store, origin, min_size=last + 1)
    found = [] if size is None else store.checkpoints(origin, min_size=size, max_size=size)
    if found:
        return found[0]
    raise BundleError(f"no checkpoint of {origin} covering #{last} carries a witness cosignature yet: wait "
                      "for the witnesses (the sidecar's /readyz shows their state), or export without --witnessed")
