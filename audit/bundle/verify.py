"""Verify a bundle offline (cryptography + rfc8785 only). Raises VerificationError on the
first failure, naming the member, the record (origin#seq) and the check.

  (1) container: a zip with exactly the bundle members, in order
  (2) envelope: DSSE signature (by a trusted key or the key keys.json lists last) over an
      in-toto Statement v1 of our predicate type
  (3) digest: each member's SHA-256 is the Statement's (records.jsonl while it streams)
  (4) checkpoints, proofs, keys: well formed; the first key is a trusted key; every key after
      it is named by a key_rotation record signed by the key before it and included in the
      covering checkpoint; the manifest is signed by the key valid at the tree size
  (5) records: format, origin, sequence, chain, key, signature (audit.verify.LogVerifier);
      listed checkpoints inside the range match the recomputed root and their signer
  (6) merkle_root: prefix hashes + records + suffix hashes give the covering checkpoint's
      root, and that checkpoint is signed by the key valid at its size
  (7) consistency: every other listed checkpoint is a prefix of the covering one
  (8) receipts: one per erasure record in range, each verifies and cites a listed checkpoint
  (9) previous: an older bundle's checkpoint is consistent with this one
  (10) witnesses: the covering checkpoint carries cosignatures by at least `min_witnesses` of the
      trusted witnesses, each made within `max_age_s` before the manifest's exported_at (fresh:
      a log rolled back to an older checkpoint has none) and not after it (beyond a clock skew)

`progress(step, name, done, total)`, if given, is called as each step starts (done 0) and,
during (5), every PROGRESS_EVERY records, so a caller can show how far a large bundle is.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..canonical import loads
from ..checkpoint import open_checkpoint
from ..cosignature import Witness, cosignatures, require_cosignatures
from ..errors import VerificationError
from ..fields import ZERO_HASH, format_time, parse_time
from ..keys import PublicKey
from ..merkle import decompose, verify_consistency
from ..ops import KEY_ROTATION
from ..receipt import ERASE_OPS, verify_receipt
from ..verify import KeySchedule, LogVerifier
from .dsse import open_envelope
from .layout import (
    CHECKPOINTS,
    KEYS,
    MANIFEST,
    MEMBERS,
    PREDICATE_TYPE,
    PROOFS,
    RECEIPTS,
    RECORDS,
    STATEMENT_TYPE,
    open_zip,
    read_small,
)
from .members import KeyPlan, Listed, last_listed_key, parse_checkpoints, parse_proofs

STEPS = ("container", "envelope", "digests", "checkpoints, proofs, keys", "records", "merkle root",
         "consistency", "receipts", "previous bundle", "witness cosignatures")
CLOCK_SKEW_S = 300  # how far after the export a witness's clock may date its cosignature
PROGRESS_EVERY = 4096  # records between two progress calls in (5): cheap against their signatures

Progress = Callable[[int, str, int, int], None]  # (step 1-9, its name, done, total)


def _quiet(step: int, name: str, done: int, total: int) -> None:
    pass


@dataclass(frozen=True, slots=True)
class BundleSummary:
    origin: str
    from_seq: int
    to_seq: int
    records: int
    tree_size: int
    root: str
    checkpoints: int
    keys: int
    receipts: int
    signer: str
    previous_tree_size: int | None = None
    cosignatures: int | None = None  # valid, fresh ones on the covering checkpoint, when required
    exported_at: str | None = None  # with cosignatures: what their freshness was judged against


@dataclass(frozen=True, slots=True)
class _Manifest:
    origin: str
    first: int
    end: int
    size: int
    digests: dict[str, str]
    envelope: bytes
    exported_ms: int | None


def verify_bundle(path: str | os.PathLike[str], public_keys: Iterable[PublicKey], *,
                  previous: str | os.PathLike[str] | None = None,
                  progress: Progress | None = None, witnesses: Iterable[Witness] = (),
                  min_witnesses: int | None = None, max_age_s: int | None = 600) -> BundleSummary:
    """`public_keys`: the trusted keys; the log's first key (keys.json's first) must be one.
    With `witnesses`, (10) requires `min_witnesses` of them (default: all) to have cosigned the
    covering checkpoint within `max_age_s` before the export (None: at any time)."""
    witnesses = list(witnesses)
    if min_witnesses is None:
        min_witnesses = len(witnesses)
    if min_witnesses > len(witnesses):
        raise ValueError(f"{min_witnesses} cosignatures required but {len(witnesses)} witness keys given")
    trusted = list(public_keys)
    report = progress or _quiet

    def step(n: int, total: int = 0) -> None:
        report(n, STEPS[n - 1], 0, total)

    step(1)
    with open_zip(os.fspath(path)) as zf:  # (1)
        # (2) before keys.json is checked, its last key is only a candidate; (4) ties the signer
        # to the key chain that a trusted key starts
        step(2)
        manifest = _manifest(zf, trusted + last_listed_key(read_small(zf, KEYS)),
                             "a trusted key or the key keys.json lists last")
        origin, first, end, size = manifest.origin, manifest.first, manifest.end, manifest.size
        step(3)
        docs = {name: _member_json(zf, name, manifest) for name in (CHECKPOINTS, PROOFS, KEYS)}  # (3)
        step(4)
        listed = parse_checkpoints(docs[CHECKPOINTS], origin, first, size)  # (4)
        cover = listed[-1]
        proofs = parse_proofs(docs[PROOFS], origin, first, end, size)
        plan = KeyPlan(docs[KEYS], origin, cover.checkpoint)
        signer = _anchor(plan, trusted, manifest)
        step(5, end - first)
        verifier, erasures = _records(zf, manifest, plan, proofs, listed, report)  # (5)
        step(6)
        _cover(verifier, proofs, cover, plan)  # (6)
        step(7, len(listed) - 1)
        _consistency(listed, proofs, plan, origin)  # (7)
        step(8)
        receipts = _receipts(zf, manifest, plan, erasures, listed)  # (8)
    if previous is not None:
        step(9)
    prev_size = None if previous is None else _previous(previous, plan, proofs, cover)  # (9)
    cosigned = None
    if min_witnesses:
        step(10)
        cosigned = _witnessed(cover, manifest, witnesses, min_witnesses, max_age_s)  # (10)
    exported = format_time(manifest.exported_ms) if cosigned is not None else None
    return BundleSummary(origin, first, end - 1, end - first, size, cover.checkpoint.root.hex(),
                         len(listed), len(plan.keys), receipts, signer.key_id, prev_size, cosigned, exported)


def _witnessed(cover: Listed, manifest: _Manifest, witnesses: list[Witness], count: int,
               max_age_s: int | None) -> int:
    if manifest.exported_ms is None:
        raise VerificationError("witness", "the manifest has no exported_at to judge cosignatures' age by",
                                member=MANIFEST)
    exported_s = manifest.exported_ms // 1000
    try:
        found = require_cosignatures(cover.note, witnesses, count,
                                     not_before_s=None if max_age_s is None else exported_s - max_age_s,
                                     not_after_s=exported_s + CLOCK_SKEW_S)
    except VerificationError as exc:
        if exc.check == "witness" and not cosignatures(cover.note, witnesses):
            exc = VerificationError(exc.check, exc.message + "; a bundle exported with --witnessed is covered by "
                                    "the latest checkpoint the witnesses cosigned", origin=exc.origin)
        raise exc.with_member(CHECKPOINTS) from None
    return len(found)


def _manifest(zf, keys: list[PublicKey], who: str) -> _Manifest:
    envelope = read_small(zf, MANIFEST)
    statement, _ = open_envelope(envelope, keys, who)

    def fail(message: str) -> VerificationError:
        return VerificationError("statement", message, member=MANIFEST)

    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
        raise fail(f"not an {STATEMENT_TYPE} of predicate type {PREDICATE_TYPE}")
    try:
        digests = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
        p = statement["predicate"]
        origin, first, last, size = p["origin"], p["range"]["from_seq"], p["range"]["to_seq"], p["tree_size"]
        if not all(type(x) is int for x in (first, last, size)) or not 0 <= first <= last < size:
            raise ValueError(f"range {first}..{last} of tree size {size}")
        if p["range"]["count"] != last - first + 1:
            raise ValueError("range count disagrees with from_seq..to_seq")
        exported = parse_time(p["exported_at"]) if "exported_at" in p else None
    except (KeyError, TypeError, ValueError) as exc:
        raise fail(f"malformed statement: {exc}") from None
    if set(digests) != set(MEMBERS) - {MANIFEST} or len(statement["subject"]) != len(digests):
        raise fail(f"subjects are {sorted(digests)}, expected every member but the manifest")
    return _Manifest(origin, first, last + 1, size, digests, envelope, exported)


def _anchor(plan: KeyPlan, trusted: list[PublicKey], manifest: _Manifest) -> PublicKey:
    """(4) The key chain starts at a trusted key, and the manifest is signed by the key valid at
    the tree size: a trusted key's manifest alone does not vouch for records of another key."""
    root = plan.keys[0][0]
    if root not in trusted:
        raise VerificationError("key", f"the log's first key {root.key_id[:16]}... is not a trusted key, so "
                                "nothing ties its records to the trusted keys (give the public key the log "
                                "started with)", origin=manifest.origin, member=KEYS)
    signer = plan.key_at(manifest.size)
    _signed_by(manifest, signer, MANIFEST)
    return signer


def _signed_by(manifest: _Manifest, key: PublicKey, member: str) -> None:
    try:
        open_envelope(manifest.envelope, [key])
    except VerificationError:
        raise VerificationError("envelope_signature", f"not signed by key {key.key_id[:16]}..., the log's "
                                f"key at tree size {manifest.size}", member=member) from None


def _member_json(zf, name: str, manifest: _Manifest) -> Any:
    data = read_small(zf, name)
    if hashlib.sha256(data).hexdigest() != manifest.digests[name]:
        raise VerificationError("digest", "SHA-256 differs from the manifest", member=name)
    try:
        return loads(data)
    except ValueError as exc:
        raise VerificationError("format", f"not JSON: {exc}", member=name) from None


def _records(zf, manifest: _Manifest, plan: KeyPlan, proofs, listed: list[Listed], report: Progress = _quiet):
    origin, first, end = manifest.origin, manifest.first, manifest.end
    schedule = KeySchedule(plan.all(), active=plan.key_at(first))
    verifier = LogVerifier(origin, schedule, start=first, prefix=proofs.prefix,
                           prev=ZERO_HASH if first == 0 else None)
    at_size = {c.size: c.note for c in listed if c.size <= end}
    sha, erasures = hashlib.sha256(), {}
    try:
        if first in at_size:
            verifier.check_checkpoint(at_size[first])
        with zf.open(RECORDS) as fh:
            for line in fh:
                sha.update(line)
                if verifier.size == end:
                    raise verifier.fail("sequence", f"records beyond #{end - 1}, the end of the range")
                if not line.endswith(b"\n"):
                    raise verifier.fail("format", "the last line has no newline")
                record = verifier.add_bytes(line[:-1])
                if record.op == KEY_ROTATION and schedule.active != plan.key_at(record.seq + 1):
                    raise verifier.fail("key", "rotation names a key keys.json does not list next",
                                        record.seq)
                if record.op in ERASE_OPS:
                    erasures[record.seq] = record
                if verifier.size in at_size:
                    verifier.check_checkpoint(at_size[verifier.size])
                if (verifier.size - first) % PROGRESS_EVERY == 0:
                    report(5, STEPS[4], verifier.size - first, end - first)
        verifier.finish()
        report(5, STEPS[4], verifier.size - first, end - first)
    except VerificationError as exc:
        raise verifier.earliest(exc).with_member(RECORDS) from None
    except (OSError, zipfile.BadZipFile) as exc:  # e.g. a CRC mismatch while streaming
        raise VerificationError("container", f"cannot read member: {exc}", member=RECORDS) from None
    finally:
        verifier.signatures.close()
    if verifier.size != end:
        raise VerificationError("sequence", f"the range ends at #{end - 1} but the records stop before",
                                origin=origin, seq=verifier.size, member=RECORDS)
    if sha.hexdigest() != manifest.digests[RECORDS]:
        raise VerificationError("digest", "SHA-256 differs from the manifest", member=RECORDS)
    return verifier, erasures


def _cover(verifier: LogVerifier, proofs, cover: Listed, plan: KeyPlan) -> None:
    for (level, _), h in zip(decompose(verifier.size, cover.size), proofs.suffix):
        verifier.tree.append_node(level, h)
    if verifier.tree.root() != cover.checkpoint.root:
        raise VerificationError("merkle_root", f"records and proof hashes do not give the root of "
                                f"checkpoint @{cover.size}", origin=verifier.origin, member=PROOFS)
    try:
        open_checkpoint(cover.note, plan.key_at(cover.size), verifier.origin)
    except VerificationError as exc:
        raise exc.with_member(CHECKPOINTS) from None


def _consistency(listed: list[Listed], proofs, plan: KeyPlan, origin: str) -> None:
    cover = listed[-1].checkpoint
    for c in listed[:-1]:
        try:
            open_checkpoint(c.note, plan.key_at(c.size), origin)
        except VerificationError as exc:
            raise exc.with_member(CHECKPOINTS) from None
        if c.size not in proofs.consistency:
            raise VerificationError("consistency", f"no proof from size {c.size}", origin=origin,
                                    member=PROOFS)
        try:
            verify_consistency(c.size, cover.size, c.checkpoint.root, cover.root, proofs.consistency[c.size])
        except VerificationError as exc:
            raise exc.with_member(PROOFS) from None


def _receipts(zf, manifest: _Manifest, plan: KeyPlan, erasures: dict, listed: list[Listed]) -> int:
    data = read_small(zf, RECEIPTS)
    if hashlib.sha256(data).hexdigest() != manifest.digests[RECEIPTS]:
        raise VerificationError("digest", "SHA-256 differs from the manifest", member=RECEIPTS)
    notes, seen = {c.note for c in listed}, set()
    for line in data.splitlines():
        try:
            receipt = loads(line)
            seq = receipt["record"]["seq"]
            record = verify_receipt(receipt, plan.key_at(seq))
        except (ValueError, KeyError, TypeError) as exc:
            raise VerificationError("format", f"malformed receipt: {exc}", member=RECEIPTS) from None
        except VerificationError as exc:
            raise exc.with_member(RECEIPTS) from None
        if erasures.get(seq) != record or receipt["checkpoint"] not in notes or seq in seen:
            raise VerificationError(
                "receipt", "receipt is not for an erasure record of this bundle, or cites an unlisted "
                "checkpoint", origin=manifest.origin, seq=seq, member=RECEIPTS)
        seen.add(seq)
    missing = sorted(set(erasures) - seen)
    if missing:
        raise VerificationError("receipt", "erasure record has no receipt", origin=manifest.origin,
                                seq=missing[0], member=RECEIPTS)
    return len(seen)


def _previous(path, plan: KeyPlan, proofs, cover: Listed) -> int:
    name = f"previous:{CHECKPOINTS}"
    with open_zip(os.fspath(path), member="previous") as zf:
        try:
            manifest = _manifest(zf, plan.all(), "a key of this bundle's log")
        except VerificationError as exc:
            raise exc.with_member(f"previous:{MANIFEST}") from None
        try:
            old = parse_checkpoints(_member_json(zf, CHECKPOINTS, manifest), manifest.origin, manifest.first,
                                    manifest.size)[-1]
        except VerificationError as exc:
            raise exc.with_member(name) from None
    origin = cover.checkpoint.origin
    if manifest.origin != origin or old.size > cover.size:
        raise VerificationError("consistency", f"previous bundle ({manifest.origin}@{old.size}) is not an "
                                f"earlier state of {origin}@{cover.size}", member=name)
    _signed_by(manifest, plan.key_at(old.size), f"previous:{MANIFEST}")
    try:
        open_checkpoint(old.note, plan.key_at(old.size), origin)
    except VerificationError as exc:
        raise exc.with_member(name) from None
    if old.size == cover.size:
        proof = []
    elif old.size in proofs.consistency:
        proof = proofs.consistency[old.size]
    else:
        raise VerificationError("consistency", f"no consistency proof from size {old.size}: export the new "
                                f"bundle from a seq at or before {old.size}", origin=origin, member=PROOFS)
    try:
        verify_consistency(old.size, cover.size, old.checkpoint.root, cover.checkpoint.root, proof)
    except VerificationError as exc:
        raise exc.with_member(PROOFS) from None
    return old.size
