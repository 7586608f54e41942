"""The log writer: validates, signs and durably stores records in group commits.

Callers' threads validate, so a bad record fails at the call. A signer thread
drains the queue, signs everything queued as one batch and hands it to a
committer thread, which stores it in one transaction and then answers every
caller of the batch; the two overlap (Ed25519 signing releases the GIL while the
previous batch commits). A write is acknowledged only after its commit, so
acknowledged records survive kill -9.

If another writer appended first, the committer loads its records and re-signs
the batch on the new tail; the signer then restarts from the committed tail.
Records the writer did not write are verified before it chains onto them
(audit.adopt); one that fails halts the writer (TamperedLogError, `halted`).
Key rotations and forced checkpoints wait for the committer to go idle, so they
act on a settled tail. Checkpoints are issued every `checkpoint_every` records
or `checkpoint_interval_ms`, and before a rotation (so every record has a
checkpoint signed by its own key).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from . import fields, ops
from .adopt import adopt, open_tail
from .checkpointer import Checkpointer
from .errors import AuditError, ChainConflictError, StoreError, TamperedLogError
from .keys import SigningKey, rotation_details
from .pending import STOP, Item, Waiter, refuse_all, resolve_all, take_batch
from .pseudonym import ShreddedTags
from .record import Record, encode_parts
from .signproc import SignerProcess, sign_chain
from .state import LogState, OpenCheckpoints
from .store import AuditStore, CheckpointEntry
from .tree import HashTree

_log = logging.getLogger("kvguard.audit.log")
_OBSERVED = ops.ERASE_OPS | {ops.KEY_ROTATION}  # what audit.state keeps of the records written


@dataclass(frozen=True, slots=True)
class LogConfig:
    checkpoint_every: int = 1000
    checkpoint_interval_ms: int = 1000
    max_batch: int = 4096  # records per transaction, at most
    sign_slice: int = 256  # records signed before the committer may start on them
    tail_slice: int = 64  # the last slice of a burst: what is stored after its last signature
    # Records queued for the signer, at most: past it callers wait (a caller that never waits
    # for its futures must not grow the queue until memory runs out). A larger call is let
    # in alone, when the queue is empty.
    max_queued: int = 65536
    cache_level: int = 8  # tree levels below this are re-read from the store (audit.tree)
    conflict_retries: int = 20
    # Build and sign records in a child process (audit.signproc): the GIL then serves only
    # validation and storage, which roughly doubles the rate on two or more cores. Costs a
    # spawned interpreter per log; off for short-lived logs and tests of the writer itself.
    sign_process: bool = False


def _item(op: str, subject: dict | None, details: dict | None, future: Future | None = None) -> Item:
    """A caller's record, validated on the caller's thread, so a bad record fails at the call.
    Its chain-independent parts are encoded there too (`_encode`), so the signer only
    assembles and signs."""
    subject, details = fields.check_subject(subject), fields.check_details(details)
    return Item(fields.check_known_op(op), subject, details, future)


def _encode(items: list[Item]) -> list[Item]:
    for item in items:
        item.encoded = encode_parts(item.subject, item.details)
    return items


def _slices(n: int, size: int, tail: int) -> list[tuple[int, int]]:
    """(start, end) of slices of at most `size`; the last at most `tail` long when there
    is more than that, so little is left to store once the last signature is made."""
    bounds = [(start, min(start + size, n)) for start in range(0, n, size)]
    start, end = bounds[-1]
    if n > tail and end - start > tail:
        bounds[-1:] = [(start, end - tail), (end - tail, end)]
    return bounds


def _parts(items: list[Item]) -> list:
    return [(item.op, item.subject, item.details, item.encoded) for item in items]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class AuditLog:
    def __init__(self, store: AuditStore, origin: str, key: SigningKey,
                 config: LogConfig = LogConfig(), *, clock: Callable[[], int] = _now_ms,
                 on_halt: Callable[[TamperedLogError], None] | None = None) -> None:
        self.store, self.origin, self.config = store, fields.check_origin(origin), config
        self._key, self._clock = key, clock
        if not store.has_log(origin):
            try:
                store.create_log(origin, key.public_key, clock())
            except Exception:
                if not store.has_log(origin):  # not a lost creation race: a real failure
                    raise
        self._halted: TamperedLogError | None = None
        self._on_halt = on_halt
        def new_tree() -> HashTree:
            return HashTree(config.cache_level, lambda a, b: store.leaf_hashes(origin, a, b))

        # the whole state it relies on, checked before anything is signed (audit.state)
        self._state = LogState(origin)
        try:
            self.tree, self._tail, checks = open_tail(store, origin, key.public_key, new_tree, self._state)
        except TamperedLogError as exc:
            self._halt(exc)
            raise
        self._prev, self._active_key_id = self._tail.prev, ""
        self._catch_up(checks)
        if self._active_key_id != key.key_id:
            raise StoreError(
                f"log {origin} is signed by key {self._active_key_id} now; open it with that key")
        self._check_state(self.tree.size, checkpoints=False)  # (2) ran as the tree grew
        # the latest checkpoint its own key signed, as verified on open: never a row it did not check
        self._checkpoints = Checkpointer(origin, config.checkpoint_every, config.checkpoint_interval_ms,
                                         self._tail.checkpoint, clock())
        self._next_seq, self._next_prev = self.tree.size, self._prev  # the signer's (tentative) tail
        self._resync = threading.Event()
        self._failed: BaseException | None = None
        self._gate, self._closed = threading.Lock(), False
        self._room, self._queued = threading.Condition(), 0  # records in self._queue
        self._signproc = SignerProcess() if config.sign_process else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._commits: queue.Queue = queue.Queue(maxsize=64)
        self._committer = threading.Thread(target=self._commit_loop, name=f"audit-commit[{origin}]",
                                           daemon=True)
        self._signer = threading.Thread(target=self._sign_loop, name=f"audit-sign[{origin}]", daemon=True)
        self._committer.start()
        self._signer.start()

    @classmethod
    def open(cls, url: str, origin: str, key: SigningKey, config: LogConfig = LogConfig()) -> AuditLog:
        return cls(AuditStore(url), origin, key, config)

    # -- callers' side -------------------------------------------------------------

    @property
    def size(self) -> int:
        """Records durably stored (and in the tree) so far."""
        return self.tree.size

    @property
    def key(self) -> SigningKey:
        return self._key

    def submit(self, op: str, subject: dict[str, str] | None = None,
               details: dict[str, Any] | None = None) -> Future[Record]:
        """Queue a record without waiting; the future resolves to it once it is durably stored."""
        item = _item(op, subject, details, Future())
        self._enqueue([item])
        return item.future

    def append(self, op: str, subject: dict[str, str] | None = None,
               details: dict[str, Any] | None = None) -> Record:
        """Store one record; returns once it is durable."""
        return self.append_many([(op, subject, details)])[0]

    def append_many(self, items: Iterable[tuple[str, dict | None, dict | None]]) -> list[Record]:
        """Store records in order, one after another in the log; returns once all are
        durable. Every record is validated before any is queued, so a bad one fails the
        call and stores nothing."""
        batch = [_item(op, subject, details) for op, subject, details in items]
        if not batch:
            return []
        waiter = Waiter(len(batch))
        for item in batch:
            item.waiter = waiter
        self._enqueue(batch)
        waiter.wait()
        return [item.result for item in batch]

    def rotate_key(self, new_key: SigningKey) -> Record:
        """The current key signs a key_rotation record naming `new_key`, which signs onward."""
        item = Item(ops.KEY_ROTATION, {}, rotation_details(new_key.public_key), Future(), new_key=new_key)
        self._enqueue([item])
        return item.future.result()

    def checkpoint(self) -> CheckpointEntry:
        """A signed checkpoint of everything stored so far (issued now if needed)."""
        item = Item("", {}, {}, Future(), checkpoint=True)
        self._enqueue([item])
        return item.future.result()

    def verify_tail(self, timeout: float | None = None) -> int:
        """Adopt, verifying each, the records stored past this writer's tail (by another writer
        of the log, or forged): the size then. Raises TamperedLogError, halting the writer, if
        one fails, and concurrent.futures.TimeoutError if the writer is too busy to look."""
        item = Item("", {}, {}, Future(), sync=True)
        self._enqueue([item])
        return item.future.result(timeout)

    def check_state(self, timeout: float | None = None) -> None:
        """Verify what the writer relies on besides its chain (audit.state): the records stored
        past its tail (as verify_tail), the checkpoint rows up to its size not checked yet, the
        keys table, and every stored subject secret against the erase records' shred tags.
        Raises TamperedLogError, halting the writer, naming the first failure."""
        self.verify_tail(timeout)
        self._check_state(self.tree.size)

    @property
    def shredded(self) -> ShreddedTags:
        """The shred tags of the erase records this writer has read, kept up to date: what a
        Pseudonymizer refuses (audit.pseudonym)."""
        return self._state.shredded

    def _check_state(self, size: int, *, checkpoints: bool = True) -> None:
        state = self._state
        try:
            if self._halted is not None:
                raise self._halted
            state.check_keys(self.store, size)
            if checkpoints:
                state.check_checkpoints(self.store, self.tree, state.first_key(self.store, self._key.public_key), size)
            state.read_other_logs(self.store)
            state.check_secrets(self.store)
        except TamperedLogError as exc:
            if self._halted is None:
                self._halt(exc)
            raise

    def root(self, size: int | None = None) -> bytes:
        return self.tree.root(size)

    def inclusion_proof(self, seq: int, size: int | None = None) -> list[bytes]:
        return self.tree.inclusion_proof(seq, size)

    def consistency_proof(self, size1: int, size2: int | None = None) -> list[bytes]:
        return self.tree.consistency_proof(size1, size2)

    def close(self) -> None:
        if self._signer.is_alive():
            self._queue.put(STOP)
            self._signer.join()
        self._committer.join()
        if self._signproc is not None:
            self._signproc.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _enqueue(self, items: list[Item]) -> None:
        """Queue a call's items, contiguous in the log, once there is room (max_queued). They
        are encoded and queued a slice at a time, so the first slice of a long call is being
        signed while this thread encodes the rest."""
        n, queued = len(items), 0
        with self._room:
            self._room.wait_for(lambda: self._queued == 0 or self._queued + n <= self.config.max_queued)
            self._queued += n
        try:
            with self._gate:  # against _refuse: an item is either drained or refused, never stranded
                if self._halted is not None:
                    raise self._halted
                if self._failed is not None:
                    raise StoreError(f"audit writer for {self.origin} stopped: {self._failed}")
                if self._closed:
                    raise StoreError(f"audit log {self.origin} is closed")
                size = self.config.sign_slice
                for start in range(0, n, size):
                    part = items[start:start + size]
                    self._queue.put(_encode(part))
                    queued += len(part)
                    if start == 0 and n > size:
                        time.sleep(0)  # let the signer thread take the GIL and start on it
        finally:
            if queued < n:
                self._took(n - queued)

    def _took(self, n: int) -> None:
        """`n` records left the queue (taken by the signer, refused, or never queued)."""
        with self._room:
            self._queued -= n
            self._room.notify_all()

    # -- signer thread -------------------------------------------------------------

    def _sign_loop(self) -> None:
        try:
            while True:
                pending = self._next_seq > self._checkpoints.size and self._halted is None
                timeout = self._checkpoints.wait_s(self._clock()) if pending else None
                try:
                    first = self._queue.get(timeout=timeout)
                except queue.Empty:
                    self._settle()
                    self._answer([], self._checkpoint)
                    continue
                batch = take_batch(self._queue, first, self.config.max_batch)
                self._took(len(batch) - (batch[-1] is STOP))
                run: list[Item] = []
                for i, item in enumerate(batch):
                    if item is STOP:
                        self._hand_over(run)
                        self._refuse(batch[i + 1:])
                        return
                    if not item.control:
                        run.append(item)
                        continue
                    self._hand_over(run)
                    run = []
                    self._settle()
                    self._answer([item], self._control, item)
                self._hand_over(run)
        finally:
            if self._signproc is not None:
                self._signproc.wait_idle()  # its slices reach the committer before STOP
            self._commits.put(STOP)
            self._refuse([])

    def _refuse(self, items: list) -> None:
        """Fail whatever was queued after close() or a fatal error, so no caller waits forever."""
        with self._gate:
            self._closed = True
        taken = len(items)  # already counted out by the signer
        refuse_all(self._queue, items, StoreError(f"audit log {self.origin} is closed"))
        self._took(len(items) - taken)  # what the drain took off the queue

    def _hand_over(self, items: list[Item]) -> None:
        # In slices, so the committer starts on the first while the rest is signed; it
        # merges whatever slices queue up meanwhile into one transaction (group commit).
        if not items:
            return
        # a short last slice only when nothing else is queued: then someone waits for it
        tail = self.config.tail_slice if self._queue.empty() else len(items)
        for start, end in _slices(len(items), self.config.sign_slice, tail):
            part = items[start:end]
            if self._resync.is_set():  # a batch was re-signed: restart from the committed tail
                self._settle()
            if self._signproc is not None:
                # pipelined: the child signs this slice while earlier ones are stored; None
                # tells it to chain from its own last record, which the parent learns later
                future = self._answer(part, self._signproc.submit, self._key, self.origin, self._next_seq,
                                      fields.format_time(self._clock()), self._next_prev, _parts(part))
                if future is not None:
                    self._next_seq, self._next_prev = self._next_seq + len(part), None
                    future.add_done_callback(lambda f, part=part: self._signed(part, f))
                continue
            records = self._answer(part, self._sign, part, self._next_seq, self._next_prev)
            if records:
                self._next_seq, self._next_prev = records[-1].seq + 1, records[-1].digest
                self._commits.put((part, records))

    def _signed(self, part: list[Item], future: Future) -> None:
        """A slice signed by the child (on its receiver thread, in order): to the committer."""
        try:
            records = future.result()
        except BaseException as exc:
            for item in part:
                if not item.done:
                    item.resolve(error=exc)
            self._resync.set()
            return
        self._commits.put((part, records))

    def _settle(self) -> None:
        """Wait until every handed-over batch is committed; then the signer's tail is the log's."""
        if self._signproc is not None:
            self._signproc.wait_idle()
        self._commits.join()
        self._resync.clear()
        self._next_seq, self._next_prev = self.tree.size, self._prev

    def _control(self, item: Item) -> None:
        if item.sync:
            self._catch_up()
            self._next_seq, self._next_prev = self.tree.size, self._prev
            item.resolve(self.tree.size)
            return
        if item.checkpoint:
            item.resolve(self._checkpoint(force=True))
            return
        self._checkpoint(force=True)  # every record gets a checkpoint by its own key
        self._commit([item], self._sign([item], self.tree.size, self._prev))
        self._next_seq, self._next_prev = self.tree.size, self._prev

    def _sign(self, items: list[Item], seq: int, prev: str, here: bool = False) -> list[Record]:
        """Sign `items` as records seq, seq + 1, ... chained from prev; `here` signs in this
        thread even with a signer process (the committer must never wait on the process,
        whose answers wait on the committer's queue)."""
        if self._halted is not None:
            raise self._halted
        when = fields.format_time(self._clock())
        if self._signproc is not None and not here:
            return self._signproc.sign(self._key, self.origin, seq, when, prev, _parts(items))
        return sign_chain(self._key, self.origin, seq, when, prev, _parts(items))

    # -- committer thread ----------------------------------------------------------

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            jobs = [self._commits.get()]
            while jobs[-1] is not STOP and len(jobs) * self.config.sign_slice < self.config.max_batch:
                try:
                    jobs.append(self._commits.get_nowait())
                except queue.Empty:
                    break
            stop = jobs[-1] is STOP
            work = [job for job in jobs if job is not STOP]
            try:
                if work:
                    items = [item for part, _ in work for item in part]
                    self._answer(items, self._commit, items, [r for _, records in work for r in records])
            finally:
                for _ in jobs:
                    self._commits.task_done()

    def _commit(self, items: list[Item], records: list[Record]) -> None:
        for _ in range(self.config.conflict_retries):
            if self._halted is not None:
                raise self._halted
            if self._active_key_id != self._key.key_id:
                raise StoreError(
                    f"log {self.origin} was rotated to key {self._active_key_id} by another writer")
            if records[0].seq != self.tree.size or records[0].prev != self._prev:
                records = self._sign(items, self.tree.size, self._prev, here=True)  # signed on a stale tail
                self._resync.set()
            rotation = items[-1].new_key
            last = records[-1].seq
            new_key = None if rotation is None else (rotation.public_key, last + 1, last)
            # a due checkpoint goes into the same transaction (one fsync, never a tail
            # without one); after a rotation it is the new key's, issued below
            size, now = self.tree.size + len(records), self._clock()
            cp = None
            if rotation is None and self._checkpoints.due(size, now):
                root = self.tree.root_with([r.leaf_hash for r in records])
                cp = self._checkpoints.sign(self._key, size, root, now)
            try:
                self.store.append(self.origin, records, self.tree.size, new_key, cp)
                break
            except ChainConflictError:
                self._catch_up()
        else:
            raise ChainConflictError(
                f"log {self.origin}: gave up after {self.config.conflict_retries} conflicts")
        self.tree.extend([r.leaf_hash for r in records])
        for r in records:
            if r.op in _OBSERVED or r.seq == 0:
                self._state.observe(r)
        self._prev = records[-1].digest
        self._tail.size, self._tail.prev = self.tree.size, self._prev  # ours: verified by making them
        if rotation is not None:
            self._tail.keys.observe(records[-1])
        if cp is not None:
            self._checkpoints.issued(cp)
        if rotation is not None:
            self._key, self._active_key_id = rotation, rotation.key_id
        resolve_all(items, records)
        if rotation is not None:
            self._checkpoint()

    def _catch_up(self, checks: OpenCheckpoints | None = None) -> None:
        """Adopt what other writers appended since our tail (or the whole log on open), each
        record verified first (audit.adopt): leaf hashes into the tree, the last record's
        digest, the active key. A record that fails halts the writer for good."""
        if self._halted is not None:
            raise self._halted
        try:
            adopt(self.store, self.origin, self._tail, self.tree, self._state, checks)
        except TamperedLogError as exc:
            self._halt(exc)
            raise
        finally:
            self._prev = self._tail.prev
            self._active_key_id = self._tail.keys.active.key_id if self._tail.keys.active else ""

    def _halt(self, exc: TamperedLogError) -> None:
        self._halted = exc
        f = exc.failure
        _log.critical("audit writer halted: record %s#%s fails %s (%s); nothing more is signed",
                      f.origin, f.seq, f.check, f.message)
        if self._on_halt is not None:
            self._on_halt(exc)

    @property
    def halted(self) -> TamperedLogError | None:
        """Why the writer stopped signing, naming the record; None while it signs."""
        return self._halted

    def _checkpoint(self, force: bool = False) -> CheckpointEntry | None:
        """A checkpoint of its own (idle timer, forced, around a rotation), if due or forced."""
        if self._halted is not None:
            raise self._halted
        size, now, cps = self.tree.size, self._clock(), self._checkpoints
        if cps.latest is not None and cps.latest.size == size:
            return cps.latest
        if not force and not cps.due(size, now):
            return None
        entry = cps.sign(self._key, size, self.tree.root(), now)
        self.store.add_checkpoint(entry)
        cps.issued(entry)
        return entry

    def _answer(self, items: list[Item], step: Callable[..., Any], *args: Any) -> Any:
        """Run one step; on failure, fail its callers and keep serving (a database outage
        or conflict is the callers' error, not the writer's death)."""
        try:
            return step(*args)
        except BaseException as exc:
            for item in items:
                if not item.done:
                    item.resolve(error=exc)
            self._resync.set()  # the signer's tentative tail may include the failed batch
            if not isinstance(exc, (AuditError, OSError, SQLAlchemyError)):
                self._failed = exc
                raise
            return None
