"""What the log writer holds true of its store besides the records it adopts, and checks
before it signs anything and again periodically (docs/audit-format.md §11.2).

The writer relies on more than its chain: it hands out checkpoint rows (receipts,
proofs), names keys from the keys table, and turns subject ids into pseudonyms with the
secrets of subject_keys. An attacker with database access could change any of them and
leave every record intact, so on open (audit.log) the writer checks, as a failure names
origin#seq and the check:

  (1) records: every row from #0. Below the newest checkpoint its own key signed, the
      signed root vouches for the leaf hashes, so each body must hash to its stored leaf
      (`leaf_hash`) and its query columns be the body's (`columns`); after it, every
      record gets every check of §7 (audit.adopt);
  (2) checkpoints: each row's columns are those of its signed note, the note verifies
      under the key in force at its size, and its root is the writer's tree's there
      (`checkpoint_columns`, `checkpoint_signature`, `merkle_root`), checked as the tree
      reaches its size, so nothing is read twice;
  (3) keys: the keys table holds exactly the key that signed #0 (whose body the signed
      root vouches for: the pinned first key) and one row per rotation record (`keys`);
  (4) erasure: no stored secret has a shred tag that an erase record lists (`erasure`).

Periodically (`AuditLog.check_state`) it checks the records stored since (as on every
catch-up), the checkpoint rows up to its tree size not checked yet, the whole keys table,
the erase records of the other logs of the database, and every stored secret.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from .check import check_checkpoint_row, check_keys, key_rows, shred_tags
from .errors import TamperedLogError, VerificationError
from .keys import PublicKey
from .ops import ERASE_OPS, KEY_ROTATION
from .pseudonym import ShreddedTags, shred_tag
from .record import Record
from .store import AuditStore, CheckpointEntry
from .tree import HashTree


def tampered(check: str, message: str, origin: str, seq: int) -> TamperedLogError:
    return TamperedLogError(VerificationError(check, message, origin=origin, seq=seq))


class LogState:
    """What the writer learnt from its log's records: the key of #0, the rotations, the shred
    tags of the erase records (of every log it read), and how far the checkpoint rows are
    checked. Fed by the writer's threads (`observe`), read by `check_*`."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.shredded = ShreddedTags()
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget what was read: the records are read again from #0."""
        self.first_key_id: str | None = None
        self.rotations: list[Record] = []
        self.checkpoints_checked = -1  # every checkpoint row of a size up to this one is checked
        self._others: set[tuple[str, int]] = set()  # erase records of other logs read

    def observe(self, record: Record) -> None:
        """A record of the log, verified (or vouched for by a signed root)."""
        if record.seq == 0:
            self.first_key_id = record.key_id
        if record.op == KEY_ROTATION:
            with self._lock:
                self.rotations.append(record)
        elif record.op in ERASE_OPS:
            self.shredded.add(shred_tags(record), record.origin, record.seq)

    def schedule(self, first: PublicKey) -> list[tuple[int, PublicKey]]:
        """(first seq, key) of each key in force, `first` signing from #0."""
        with self._lock:
            rotations = list(self.rotations)
        return [(0, first)] + [(r.seq + 1, _new_key(r)) for r in rotations]

    # -- (2) checkpoint rows -----------------------------------------------------------

    def check_checkpoints(self, store: AuditStore, tree: HashTree, first: PublicKey, size: int) -> None:
        """The checkpoint rows of sizes after the last checked, up to `size` (<= the tree's)."""
        rows = store.checkpoints(self.origin, self.checkpoints_checked + 1, size)
        schedule = self.schedule(first)
        for cp in rows:
            check_checkpoint(cp, schedule, tree.root(cp.size))
        self.checkpoints_checked = max(self.checkpoints_checked, size)

    # -- (3) keys ----------------------------------------------------------------------

    def first_key(self, store: AuditStore, own: PublicKey) -> PublicKey:
        """The key that signed #0, from its row, once (3) passed; `own` before any record."""
        if self.first_key_id is None:
            return own
        if own.key_id == self.first_key_id:
            return own
        for row in key_rows(store, self.origin):
            if row.key_id == self.first_key_id:
                return PublicKey.from_raw(bytes(row.public_key))
        raise tampered("keys", "no key row holds the key that signed #0", self.origin, 0)

    def check_keys(self, store: AuditStore, size: int) -> None:
        if self.first_key_id is None:  # no record yet: the row is the one create_log wrote
            return
        with self._lock:
            rotations = list(self.rotations)
        try:
            check_keys(store, self.origin, key_rows(store, self.origin), self.first_key_id, rotations, size)
        except VerificationError as exc:
            raise TamperedLogError(exc) from None

    # -- (4) erasure -------------------------------------------------------------------

    def read_other_logs(self, store: AuditStore) -> None:
        """Shred tags of the erase records of the database's other logs (a fleet shreds once,
        and a sidecar that joined later holds none of its own). Not verified here: a tag
        only ever makes a secret refused."""
        for origin, seq, body in store.other_erase_bodies(self.origin):
            if (origin, seq) in self._others:
                continue
            self._others.add((origin, seq))
            try:
                record = Record.from_leaf_bytes(body.encode("utf-8"))
            except ValueError:
                continue  # `kvguard audit check` names it; its own log's writer halts on it
            self.shredded.add(shred_tags(record), origin, seq)

    def check_secrets(self, store: AuditStore) -> int:
        n = 0
        for secret in store.iter_subject_secrets():
            n += 1
            found = self.shredded.get(shred_tag(secret))
            if found is not None:
                raise tampered("erasure", "a subject secret this erase record destroyed is stored again (put back "
                               "from a backup or by hand): its pseudonyms would link to the person again", *found)
        return n


class OpenCheckpoints:
    """(2) on open: the log's checkpoint rows, each checked once the tree reaches its size,
    while the records are read. A failure is kept, not raised, while the rows below the
    writer's own checkpoint are read on the strength of its root: a record edited with
    its leaf hash breaks the roots of the checkpoints above it, and the record is the
    first cause, named by the full verification that then runs."""

    def __init__(self, rows: Iterable[CheckpointEntry], state: LogState) -> None:
        self.rows = sorted(rows, key=lambda c: c.size)
        self.state, self.i = state, 0
        self.failure: TamperedLogError | None = None

    def reach(self, tree: HashTree, key: PublicKey | None, *, defer: bool) -> None:
        while self.i < len(self.rows) and self.rows[self.i].size <= tree.size:
            cp = self.rows[self.i]
            self.i += 1
            self.state.checkpoints_checked = cp.size
            if key is None or cp.size < tree.size:  # no key row for #0: (3) names it
                continue
            try:
                check_checkpoint(cp, [(0, key)], tree.root())
            except TamperedLogError as exc:
                if not defer:
                    raise
                self.failure = self.failure or exc


def check_checkpoint(cp: CheckpointEntry, schedule: list[tuple[int, PublicKey]], root: bytes) -> None:
    try:
        check_checkpoint_row(cp, schedule)
    except VerificationError as exc:
        raise TamperedLogError(exc) from None
    if cp.root != root:  # the columns are the note's (checked above)
        raise tampered("merkle_root", f"checkpoint {cp.origin}@{cp.size} does not carry the root of the records "
                       "stored below it", cp.origin, max(cp.size - 1, 0))


def _new_key(record: Record) -> PublicKey:
    import base64

    return PublicKey.from_raw(base64.b64decode(record.details["new_public_key"]))
