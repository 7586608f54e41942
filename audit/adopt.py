"""What the log writer checks before it chains onto records it did not write.

A writer signs over its tree and chains each new record onto the last one, so
adopting a stored row unchecked would put the log's own key behind whatever an
attacker with database access inserted. Every row the writer loads is checked
as a verifier would (docs/audit-format.md §7: format, origin, sequence, chain,
key, signature) plus its stored leaf hash and query columns, before its leaf
joins the tree. The first failure raises TamperedLogError naming the record.

On open the writer starts from the latest checkpoint that its own key signed
and whose root the stored leaf hashes reproduce: that signature vouches for
every leaf below it, so the rows below it are read back and each body checked
against its leaf and its query columns (no signature verified), and only the
records after it get every check (audit.state says what else is checked on
open). Without such a checkpoint every record is verified from #0 under the
keys table's first key.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

from .checkpoint import open_checkpoint
from .errors import RecordFormatError, TamperedLogError, VerificationError
from .fields import ZERO_HASH
from .keys import PublicKey
from .merkle import leaf_hash
from .record import Record
from .state import LogState, OpenCheckpoints
from .store import AuditStore, CheckpointEntry, _row, stored_columns
from .tree import HashTree
from .verify import KeySchedule


@dataclass
class Tail:
    """The verified end of a log: its size, last digest and the key schedule in force."""

    size: int
    prev: str
    keys: KeySchedule
    checkpoint: CheckpointEntry | None = None  # the one by the writer's key that open_tail started from
    last: Record | None = None  # the record adopted last


def open_tail(store: AuditStore, origin: str, own: PublicKey, new_tree: Callable[[], HashTree],
              state: LogState) -> tuple[HashTree, Tail, OpenCheckpoints]:
    """A tree of the leaves that the latest checkpoint by `own` vouches for, and the tail
    there; every row below it read and checked on the strength of that root (audit.state
    (1)), and the checkpoint rows it reaches (2). Without such a checkpoint, or when the
    stored leaves do not give its root, an empty tree: the caller verifies from #0."""
    rows = store.checkpoints(origin)
    for cp in reversed(rows):
        try:
            signed = open_checkpoint(cp.note, [own], origin)
        except VerificationError:
            continue  # another key's (before a rotation), or edited: (2) names it
        stored = store.size(origin)
        if stored < signed.size:  # records cut below a checkpoint this key signed: never sign them anew
            raise _tampered("truncation", f"checkpoint {origin}@{signed.size}, signed by this writer's key, "
                            f"covers records up to #{signed.size - 1} but the log ends at #{stored - 1}",
                            origin, stored)
        tree, checks = new_tree(), OpenCheckpoints(rows, state)
        _read_vouched(store, origin, signed.size, tree, state, checks, own)
        if tree.size == signed.size and tree.root() == signed.root:
            if checks.failure is not None:
                raise checks.failure
            return tree, Tail(signed.size, _digest_at(store, origin, tree, signed.size), KeySchedule([own], own),
                              CheckpointEntry(origin, signed.size, signed.root, cp.time_ms, own.key_id, cp.note)), checks
        state.reset()
        break  # leaf hashes edited under a signed checkpoint: verify every record from #0
    first = [k.key for k in store.keys(origin) if k.valid_from_seq == 0][:1] or [own]
    return new_tree(), Tail(0, ZERO_HASH, KeySchedule(first, first[0])), OpenCheckpoints(rows, state)


def _read_vouched(store: AuditStore, origin: str, size: int, tree: HashTree, state: LogState,
                  checks: OpenCheckpoints, own: PublicKey) -> None:
    """Rows #0 to size - 1, whose leaf hashes a root signed by `own` vouches for (the caller
    compares the roots once all are read): each body must hash to its leaf and its columns be
    the body's; no signature is verified. The keys in force, for the checkpoints, follow the
    key of #0 and the rotation records."""
    keys: KeySchedule | None = None
    checks.reach(tree, None, defer=True)
    with closing(store.iter_rows(origin, 0, size)) as rows:
        for row in rows:
            try:
                record = _vouched_row(origin, tree.size, row)
            except TamperedLogError as exc:  # kept: an edited leaf is named by the full verification
                checks.failure = checks.failure or exc
                if row.seq != tree.size:
                    return  # a missing row: the roots differ, and everything is verified from #0
                tree.append(bytes(row.leaf_hash))
                checks.reach(tree, keys.active if keys else None, defer=True)
                continue
            state.observe(record)
            if keys is None:
                try:
                    first = state.first_key(store, own)
                    keys = KeySchedule([first], first)
                except TamperedLogError:  # no key row holds it: (3) names the keys table
                    keys = KeySchedule([])
            keys.observe(record)
            tree.append(bytes(row.leaf_hash))
            checks.reach(tree, keys.active, defer=True)


def _vouched_row(origin: str, expected: int, row) -> Record:
    seq = row.seq
    if seq != expected:
        raise _tampered("sequence", f"record {origin}#{expected} is missing (found #{seq})", origin, expected)
    data = row.body.encode("utf-8")
    try:
        record = Record.from_leaf_bytes(data)
    except RecordFormatError as exc:
        raise _tampered("format", str(exc), origin, seq) from None
    if record.origin != origin or record.seq != seq:
        raise _tampered("sequence", f"the body is record {record.origin}#{record.seq}", origin, seq)
    if leaf_hash(data) != bytes(row.leaf_hash):
        raise _tampered("leaf_hash", "the body does not hash to its stored leaf, which a signed checkpoint "
                        "covers", origin, seq)
    if stored_columns(row) != _row(record):
        raise _tampered("columns", "stored columns disagree with the signed body", origin, seq)
    return record


def _digest_at(store: AuditStore, origin: str, tree: HashTree, size: int) -> str:
    """The digest of record size - 1, whose leaf hash the checkpoint vouches for."""
    if size == 0:
        return ZERO_HASH
    seq = size - 1
    try:
        record = store.record(origin, seq)
    except RecordFormatError as exc:
        raise _tampered("format", str(exc), origin, seq) from None
    if record.leaf_hash != tree.leaf(seq):
        raise _tampered("leaf_hash", "the body does not hash to the leaf a signed checkpoint covers", origin, seq)
    return record.digest


def adopt(store: AuditStore, origin: str, tail: Tail, tree: HashTree, state: LogState,
          checks: OpenCheckpoints | None = None) -> None:
    """Verify every stored record from `tail.size` on and append its leaf to `tree`,
    advancing `tail`; raises TamperedLogError at the first that fails. `state` observes each;
    `checks` (on open) checks the checkpoint rows the tree reaches."""
    start = tail.size
    with closing(store.iter_rows(origin, tail.size)) as rows:  # a failure ends the read at once
        for row in rows:
            _adopt_row(origin, tail, tree, row)
            state.observe(tail.last)
            if checks is not None:
                checks.reach(tree, tail.keys.active, defer=False)
    if tail.size == start and start and store.size(origin) < start:
        raise _tampered("truncation", f"records this writer holds from #{store.size(origin)} on are gone",
                        origin, store.size(origin))


def _adopt_row(origin: str, tail: Tail, tree: HashTree, row) -> None:
    seq = row.seq
    if seq != tail.size:
        raise _tampered("sequence", f"record {origin}#{tail.size} is missing (found #{seq})", origin, tail.size)
    try:
        record = Record.from_leaf_bytes(row.body.encode("utf-8"))
    except RecordFormatError as exc:
        raise _tampered("format", str(exc), origin, seq) from None
    try:
        if record.origin != origin or record.seq != seq:
            raise VerificationError("sequence", f"the body is record {record.origin}#{record.seq}")
        if record.prev != tail.prev:
            raise VerificationError("chain", "prev is not the hash of the previous record")
        tail.keys.key_for(record).verify(record.signature, record.signing_bytes_from_leaf())
        if stored_columns(row) != _row(record):
            check = "leaf_hash" if bytes(row.leaf_hash) != record.leaf_hash else "columns"
            raise VerificationError(check, "stored columns disagree with the signed body")
        tail.keys.observe(record)
    except VerificationError as exc:
        raise _tampered(exc.check, exc.message, origin, seq) from None
    tree.append(record.leaf_hash)
    tail.size, tail.prev, tail.last = seq + 1, record.digest, record


def _tampered(check: str, message: str, origin: str, seq: int) -> TamperedLogError:
    return TamperedLogError(VerificationError(check, message, origin=origin, seq=seq))
