"""The writer's signing stage in a child process, out of reach of the GIL.

A record's `prev` hashes the previous record's signed bytes, so the records of a
log are assembled, signed and hashed one after another. Ed25519 signing releases
the GIL, but the short Python steps around each signature do not: in one
process that chain competes for the GIL with the committer thread and the
service's own threads, and every signature hands the GIL away and waits to take
it back. `SignerProcess` runs the chain in a child process instead. The parent
sends each record's op with its details and subject already encoded (by the
callers' threads, `record.encode_parts`) and gets back, per record, the leaf
bytes, the signature, the leaf hash and the digest the next record chains to;
from these it builds the same `Record` objects (Ed25519 is deterministic: the
bytes are identical to signing in-process, and a test checks it).

Batches are pipelined: `submit` returns a future at once, and a batch may leave
`prev` to the child ("continue from your last record"), so the child signs
batch k+1 while the parent stores batch k. Replies are read by one receiver
thread, in order. At most `depth` batches are in flight.

The child is started with `spawn` (safe beside threads) and runs only this
module. The private key travels once per key over the anonymous pipe, never
through a file, an argument or the environment. The child exits when the pipe
closes, so a parent killed with -9 leaves no signer behind. If the child dies,
the parent signs in-process from then on (`fallen_back`), in the same order.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import multiprocessing
import threading
from concurrent.futures import Future
from typing import Any

from .errors import AuditError
from .keys import SigningKey
from .record import Record, build_signed, sign_leaf

_log = logging.getLogger(__name__)

# op, subject, details, (details JSON, subject JSON)
Part = tuple[str, dict[str, str], dict[str, Any], tuple[bytes, bytes]]


class SignerProcess:
    """A child process that builds and signs batches of records; thread-safe."""

    def __init__(self, depth: int = 4) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), name="kvguard-audit-signer", daemon=True)
        self._proc.start()
        child.close()
        self._send_lock = threading.Lock()  # one writer of the pipe; the order of `_inflight`
        self._slots = threading.BoundedSemaphore(depth)
        self._inflight: collections.deque = collections.deque()  # batches sent, in order
        self._idle = threading.Condition()
        self._key_id = ""
        self._last = ""  # digest of the last record signed (by the child or here)
        self.fallen_back = False
        self._closing = False
        self._receiver = threading.Thread(target=self._receive, name="audit-sign-receiver", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._proc.pid

    def submit(self, key: SigningKey, origin: str, seq: int, time: str, prev: str | None,
               parts: list[Part]) -> Future[list[Record]]:
        """Records seq, seq + 1, ... for `parts`, chained from `prev` (None: from the last
        record submitted before), signed by `key`: what `sign_chain` returns."""
        future: Future = Future()
        self._slots.acquire()
        with self._send_lock:
            batch = (key, origin, seq, time, prev, parts, future)
            if not self.fallen_back:
                try:
                    if key.key_id != self._key_id:
                        self._conn.send(("key", key.private_bytes_raw()))
                        self._key_id = key.key_id
                    with self._idle:
                        self._inflight.append(batch)
                    self._conn.send(("sign", origin, seq, time, prev, [(p[0], *p[3]) for p in parts]))
                    return future
                except (OSError, ValueError) as exc:  # the child is gone (ValueError: pipe closed)
                    self._fall_back(exc)
                    with self._idle:
                        if self._inflight and self._inflight[-1] is batch:
                            self._inflight.pop()
                    self._drain()
            self._sign_here(batch)
        return future

    def sign(self, key: SigningKey, origin: str, seq: int, time: str, prev: str | None,
             parts: list[Part]) -> list[Record]:
        return self.submit(key, origin, seq, time, prev, parts).result()

    def wait_idle(self) -> None:
        """Until every submitted batch is answered (its future resolved)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._inflight)

    def _receive(self) -> None:
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                with self._send_lock:
                    if not self._closing:
                        self._fall_back(exc)
                    self.fallen_back = True
                    self._drain()
                return
            with self._idle:
                key, origin, seq, time, prev, parts, future = self._inflight[0]
            if reply[0] == "error":
                future.set_exception(AuditError(f"audit signer process: {reply[1]}"))
            else:
                prev = self._last if prev is None else prev
                records = []
                for i, ((op, subject, details, _), (leaf, sig, leaf_hash, digest)) in enumerate(
                        zip(parts, reply[1])):
                    records.append(build_signed(origin, seq + i, time, op, subject, details, prev, key.key_id,
                                                sig, leaf, leaf_hash))
                    prev = digest
                self._last = prev
                future.set_result(records)
            self._done()

    def _done(self) -> None:
        with self._idle:
            self._inflight.popleft()
            self._idle.notify_all()
        self._slots.release()

    def _drain(self) -> None:
        """Sign here, in order, whatever the child took but never answered."""
        while True:
            with self._idle:
                if not self._inflight:
                    return
                batch = self._inflight[0]
            self._sign_here(batch, release=False)
            self._done()

    def _sign_here(self, batch: tuple, release: bool = True) -> None:
        key, origin, seq, time, prev, parts, future = batch
        try:
            records = sign_chain(key, origin, seq, time, self._last if prev is None else prev, parts)
            self._last = records[-1].digest if records else self._last
            future.set_result(records)
        except Exception as exc:
            future.set_exception(exc)
        finally:
            if release:
                self._slots.release()

    def _fall_back(self, exc: BaseException) -> None:
        self.fallen_back = True
        _log.error("audit signer process is gone (%s); signing in-process from now on", type(exc).__name__)

    def close(self) -> None:
        self.wait_idle()
        with self._send_lock:
            self._closing = True
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):  # the child is gone already: nothing to stop
                pass
        self._receiver.join(timeout=5)
        self._conn.close()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def sign_chain(key: SigningKey, origin: str, seq: int, time: str, prev: str,
               parts: list[Part]) -> list[Record]:
    """The chain of records for `parts`, built and signed in this process."""
    records = []
    for op, subject, details, (details_json, subject_json) in parts:
        leaf, sig, leaf_hash = sign_leaf(key, origin, seq, time, op, details_json, subject_json, prev)
        records.append(build_signed(origin, seq, time, op, subject, details, prev, key.key_id, sig, leaf,
                                    leaf_hash))
        seq, prev = seq + 1, hashlib.sha256(leaf).hexdigest()
    return records


def _serve(conn: Any) -> None:
    """The child: answer batches in order until the pipe closes or the parent says stop."""
    key: SigningKey | None = None
    last = ""  # digest of the last record this child signed
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "key":
            key = SigningKey.from_seed(msg[1])
            continue
        _, origin, seq, time, prev, parts = msg
        prev = last if prev is None else prev
        try:
            out = []
            for op, details_json, subject_json in parts:
                leaf, sig, leaf_hash = sign_leaf(key, origin, seq, time, op, details_json, subject_json, prev)
                seq, prev = seq + 1, hashlib.sha256(leaf).hexdigest()
                out.append((leaf, sig, leaf_hash, prev))
            last = prev
            reply: tuple = ("ok", out)
        except Exception as exc:  # answered, so the parent's caller gets an error, not a hang
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except OSError:
            return
