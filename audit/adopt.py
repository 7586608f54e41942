"""What the log writer checks before it chains onto records it did not write.

A writer signs over its tree and chains each new record onto the last one, so
adopting a stored row unchecked would put the log's own key behind whatever an
attacker with database access inserted. Every row the writer loads is checked
as a verifier would (docs/audit-format.md §7: format, origin, sequence, chain,
key, signature) plus its stored leaf hash and query columns, before its leaf
joins the tree. The first failure raises TamperedLogError naming the record.

On open the writer starts from the latest checkpoint that its own key signed
and whose root the stored leaf hashes reproduce: that signature vouches for
every leaf below it, so only the records after it are read back and verified
(and the one before it, whose digest is the chain's tail). Without such a
checkpoint every record is verified from #0 under the keys table's first key.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

from .checkpoint import open_checkpoint
from .errors import RecordFormatError, TamperedLogError, VerificationError
from .fields import ZERO_HASH
from .keys import PublicKey
from .record import Record
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


def open_tail(store: AuditStore, origin: str, own: PublicKey,
              new_tree: Callable[[], HashTree]) -> tuple[HashTree, Tail]:
    """A tree of the leaves that the latest checkpoint by `own` vouches for, and the tail there."""
    for cp in reversed(store.checkpoints(origin)):
        try:
            signed = open_checkpoint(cp.note, [own], origin)
        except VerificationError:
            continue  # another key's (before a rotation), or edited: `kvguard audit check` names it
        tree = new_tree()
        tree.extend(leaf for _, leaf in store.iter_leaves(origin, 0, signed.size))
        stored = store.size(origin)
        if stored < signed.size:  # records cut below a checkpoint this key signed: never sign them anew
            raise _tampered("truncation", f"checkpoint {origin}@{signed.size}, signed by this writer's key, "
                            f"covers records up to #{signed.size - 1} but the log ends at #{stored - 1}",
                            origin, stored)
        if tree.size == signed.size and tree.root() == signed.root:
            return tree, Tail(signed.size, _digest_at(store, origin, tree, signed.size), KeySchedule([own], own),
                              CheckpointEntry(origin, signed.size, signed.root, cp.time_ms, own.key_id, cp.note))
        break  # leaf hashes edited under a signed checkpoint: verify every record from #0
    first = [k.key for k in store.keys(origin) if k.valid_from_seq == 0][:1] or [own]
    return new_tree(), Tail(0, ZERO_HASH, KeySchedule(first, first[0]))


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


def adopt(store: AuditStore, origin: str, tail: Tail, tree: HashTree) -> None:
    """Verify every stored record from `tail.size` on and append its leaf to `tree`,
    advancing `tail`; raises TamperedLogError at the first that fails."""
    start = tail.size
    with closing(store.iter_rows(origin, tail.size)) as rows:  # a failure ends the read at once
        for row in rows:
            _adopt_row(origin, tail, tree, row)
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
    tail.size, tail.prev = seq + 1, record.digest


def _tampered(check: str, message: str, origin: str, seq: int) -> TamperedLogError:
    return TamperedLogError(VerificationError(check, message, origin=origin, seq=seq))
