"""`kvguard audit check`: a whole store against itself, as an attacker who can write to
the database would leave it (docs/audit-format.md §11).

Per log, in one streamed pass over the records (memory bounded by one batch of rows
and the tree's O(log n) hashes, plus the log's checkpoint notes):

  (1) records: every check of §7 (format, origin, sequence, chain, key,
      signature, checkpoints' signatures and roots, truncation) and the query
      columns and stored leaf hash against the signed body (`columns`);
  (2) checkpoints: each row's size, root and key id columns against its signed
      note (`checkpoint_columns`);
  (3) keys: the keys table is exactly the log's first key plus one row per
      verified key_rotation record (`keys`);
then, across the logs checked:
  (4) erasure: no subject secret is stored whose shred tag an erase record
      lists as destroyed (`erasure`).

The first failure raises VerificationError naming the record (origin#seq) and the
check; a passing store returns a CheckSummary.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass

from sqlalchemy import select

from .checkpoint import open_checkpoint
from .errors import KeyFileError, StoreError, VerificationError
from .keys import PublicKey
from .models import LogKey
from .ops import ERASE_OPS, KEY_ROTATION
from .pseudonym import shred_tag
from .record import Record
from .store import AuditStore, CheckpointEntry
from .verify import _checked_rows, verify_records

PROGRESS_EVERY = 4096  # records between progress callbacks


@dataclass(frozen=True, slots=True)
class CheckSummary:
    origins: int
    records: int
    checkpoints: int
    keys: int
    erase_records: int
    secrets: int  # subject secrets checked against the erase records
    seconds: float


def check_store(store: AuditStore, origins: Iterable[str] | None = None,
                trusted: Iterable[PublicKey] = (), *,
                progress: Callable[[int], None] | None = None) -> CheckSummary:
    """Run checks (1)-(4) on `origins` (default: every log in the store). `trusted` are the
    keys a log may start with; without them the keys table's first key is taken on trust
    (a log rewritten whole under another key then passes: give the key, or use witnesses).
    `progress(n)` is told of every n records checked. Raises VerificationError."""
    started = time.perf_counter()
    known = store.origins()
    names = list(known if origins is None else origins)
    for origin in names:
        if origin not in known:
            raise StoreError(f"no log {origin!r} in this store (logs: {', '.join(known) or 'none'})")
    trusted = list(trusted)
    shredded: dict[str, tuple[str, int]] = {}  # shred tag -> the erase record that destroyed it
    totals = [0, 0, 0, 0]
    for origin in names:
        for i, n in enumerate(_check_log(store, origin, trusted, shredded, progress)):
            totals[i] += n
    secrets = _check_erasures(store, shredded)
    return CheckSummary(len(names), *totals, secrets=secrets, seconds=time.perf_counter() - started)


def store_size(store: AuditStore, origins: Iterable[str] | None = None) -> int:
    """Records in the logs a check would read: the progress bar's total."""
    return sum(store.size(o) for o in (store.origins() if origins is None else origins))


def _check_log(store: AuditStore, origin: str, trusted: list[PublicKey],
               shredded: dict[str, tuple[str, int]], progress) -> tuple[int, int, int, int]:
    rows = key_rows(store, origin)
    first = [r for r in rows if r.valid_from_seq == 0]
    if not first:
        raise _fail("keys", "no key row is valid from #0", origin, 0)
    first_key = _public(first[0], origin)
    if trusted and first_key not in trusted:
        raise _fail("keys", f"the first key row ({first_key.key_id[:16]}...) is none of the trusted keys",
                    origin, 0)
    checkpoints = store.checkpoints(origin)
    rotations: list[Record] = []
    erases = 0

    def records() -> Iterator[Record]:  # (1), noting what (3) and (4) need on the way
        nonlocal erases
        done = 0
        with closing(_checked_rows(store, origin)) as rows:
            for record in rows:
                if record.op == KEY_ROTATION:
                    rotations.append(record)
                elif record.op in ERASE_OPS:
                    erases += 1
                    for tag in shred_tags(record):
                        shredded.setdefault(tag, (origin, record.seq))
                yield record
                done += 1
                if progress is not None and done % PROGRESS_EVERY == 0:
                    progress(PROGRESS_EVERY)
        if progress is not None and done % PROGRESS_EVERY:
            progress(done % PROGRESS_EVERY)

    summary = verify_records(records(), trusted or [first_key], origin=origin,
                             checkpoints=[c.note for c in checkpoints])
    schedule = key_schedule(first_key, rotations)
    for cp in checkpoints:  # (2)
        check_checkpoint_row(cp, schedule)
    rows = key_rows(store, origin)  # again: a live writer may have rotated during the pass
    check_keys(store, origin, rows, first_key.key_id, rotations, summary.size)  # (3)
    return summary.size, len(checkpoints), len(rows), erases


def key_schedule(first: PublicKey, rotations: list[Record]) -> list[tuple[int, PublicKey]]:
    """(first seq, key) of each key in force, from the verified rotation records."""
    out = [(0, first)]
    for r in rotations:
        out.append((r.seq + 1, PublicKey.from_raw(base64.b64decode(r.details["new_public_key"]))))
    return out


def key_at(schedule: list[tuple[int, PublicKey]], size: int) -> PublicKey:
    """The key in force at tree size `size`: the one that signs record `size`."""
    return [key for start, key in schedule if start <= size][-1]


def check_checkpoint_row(cp: CheckpointEntry, schedule) -> None:
    """The note verifies under the key in force at the row's size (`checkpoint_signature`),
    then the row's columns are the note's (`checkpoint_columns`): an edited note is named by
    its signature, an edited column by the columns."""
    seq = max(cp.size - 1, 0)
    key = key_at(schedule, cp.size)
    try:
        note = open_checkpoint(cp.note, [key], cp.origin)
    except VerificationError as exc:
        raise _fail(exc.check, f"checkpoint {cp.origin}@{cp.size}: {exc.message}", cp.origin, seq) from None
    if (note.origin, note.size, note.root, cp.key_id) != (cp.origin, cp.size, cp.root, key.key_id):
        raise _fail("checkpoint_columns", f"the columns of checkpoint {cp.origin}@{cp.size} (tree size, root "
                    "hash, key id) disagree with its signed note", cp.origin, seq)


def key_rows(store: AuditStore, origin: str) -> list:
    with store.read() as conn:
        return list(conn.execute(
            select(LogKey.key_id, LogKey.public_key, LogKey.valid_from_seq, LogKey.rotation_seq)
            .where(LogKey.origin == origin).order_by(LogKey.valid_from_seq, LogKey.key_id)))


def _public(row, origin: str) -> PublicKey:
    try:
        key = PublicKey.from_raw(bytes(row.public_key))
    except (KeyFileError, ValueError) as exc:
        raise _fail("keys", f"key row {row.key_id[:16]}...: {exc}", origin, _row_seq(row)) from None
    if key.key_id != row.key_id:
        raise _fail("keys", f"key row {row.key_id[:16]}... holds another key ({key.key_id[:16]}...)",
                    origin, _row_seq(row))
    return key


def _row_seq(row) -> int:
    """The record a key row names: its rotation record, or #0 for the first key."""
    return row.rotation_seq if row.rotation_seq is not None else row.valid_from_seq


def check_keys(store: AuditStore, origin: str, rows: list, first_key_id: str, rotations: list[Record],
               size: int) -> None:
    """The keys table is the first key plus one row per rotation record, nothing else.
    A row for a rotation past the records checked (written meanwhile by a live writer) must
    name a stored key_rotation record for its key; the next run verifies that record."""
    expected = [(first_key_id, 0, None)] + [(r.details["new_key_id"], r.seq + 1, r.seq) for r in rotations]
    actual = []
    for row in rows:
        _public(row, origin)
        if row.rotation_seq is not None and row.rotation_seq >= size:
            _check_later_row(store, origin, row)
            continue
        actual.append((row.key_id, row.valid_from_seq, row.rotation_seq))
    for i, want in enumerate(expected):
        have = actual[i] if i < len(actual) else None
        if have != want:
            if have is None:
                raise _fail("keys", f"the key named by key_rotation record #{want[2]} has no key row",
                            origin, want[2])
            raise _fail("keys", f"key row {have[0][:16]}... (valid from #{have[1]}) is not the key the "
                        "log's records put in force there", origin, have[2] if have[2] is not None else have[1])
    for key_id, start, rot in actual[len(expected):]:
        raise _fail("keys", f"key row {key_id[:16]}... (valid from #{start}) has no key_rotation record",
                    origin, rot if rot is not None else start)


def _check_later_row(store: AuditStore, origin: str, row) -> None:
    try:
        record = store.record(origin, row.rotation_seq)
        ok = record.op == KEY_ROTATION and record.details.get("new_key_id") == row.key_id \
            and row.valid_from_seq == row.rotation_seq + 1
    except StoreError:
        ok = False
    if not ok:
        raise _fail("keys", f"key row {row.key_id[:16]}... has no key_rotation record", origin, row.rotation_seq)


def shred_tags(record: Record) -> list[str]:
    tags = record.details.get("shredded")
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def _check_erasures(store: AuditStore, shredded: dict[str, tuple[str, int]]) -> int:
    n = 0
    for secret in store.iter_subject_secrets():
        n += 1
        found = shredded.get(shred_tag(secret))
        if found is not None:
            raise _fail("erasure", "a subject secret this erase record destroyed is stored again (put back "
                        "from a backup or by hand): its pseudonyms link to the person again", *found)
    return n


def _fail(check: str, message: str, origin: str, seq: int) -> VerificationError:
    return VerificationError(check, message, origin=origin, seq=seq)
