"""The writer's signing stage in a child process, out of reach of the GIL.

A record's `prev` hashes the previous record's signed bytes, so the records of a
log are encoded, signed and hashed one after another. Ed25519 signing releases
the GIL, but that chain of short Python steps around it does not: in one
process it competes for the GIL with the committer thread and the service's own
threads, and every signature hands the GIL away and waits to take it back.
`SignerProcess` runs the whole chain (`Record.sign_new`) in a child process
instead; the parent sends the validated parts of a batch and gets back, per
record, the leaf bytes, the signature and the leaf hash, from which it builds
the same `Record` objects (Ed25519 is deterministic: the bytes are identical
to signing in-process, and a test checks it).

The child is started with `spawn` (safe beside threads) and runs only this
module. The private key travels once per key over the anonymous pipe, never
through a file, an argument or the environment. The child exits when the pipe
closes, so a parent killed with -9 leaves no signer behind. If the child dies,
the parent signs in-process from then on (`fallen_back`).
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import threading
from typing import Any

from .errors import AuditError
from .keys import SigningKey
from .record import Record, build_signed, sign_leaf

_log = logging.getLogger(__name__)


class SignerProcess:
    """A child process that builds and signs batches of records; thread-safe."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), name="kvguard-audit-signer", daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._key_id = ""
        self.fallen_back = False

    def sign(self, key: SigningKey, origin: str, seq: int, time: str, prev: str,
             parts: list[tuple[str, dict[str, str], dict[str, Any]]]) -> list[Record]:
        """Records seq, seq + 1, ... for `parts` (op, subject, details; validated), chained
        from `prev`, all signed by `key`: exactly what `Record.sign_new` in a loop returns."""
        if not self.fallen_back:
            try:
                with self._lock:
                    if key.key_id != self._key_id:
                        self._conn.send(("key", key.private_bytes_raw()))
                        self._key_id = key.key_id
                    self._conn.send(("sign", origin, seq, time, prev, parts))
                    reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._fall_back(exc)
            else:
                if reply[0] == "error":
                    raise AuditError(f"audit signer process: {reply[1]}")
                return [build_signed(origin, seq + i, time, op, subject, details,
                                     prev if i == 0 else reply[1][i - 1][3], key.key_id, sig, leaf, leaf_hash)
                        for i, ((op, subject, details), (leaf, sig, leaf_hash, _)) in enumerate(zip(parts, reply[1]))]
        records = []
        for op, subject, details in parts:
            r = Record.sign_new(key, origin, seq, time, op, subject, details, prev)
            records.append(r)
            seq, prev = seq + 1, r.digest
        return records

    def _fall_back(self, exc: BaseException) -> None:
        self.fallen_back = True
        _log.error("audit signer process is gone (%s); signing in-process from now on", type(exc).__name__)

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            self._conn.close()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _serve(conn: Any) -> None:
    """The child: answer batches until the pipe closes or the parent says stop."""
    key: SigningKey | None = None
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
        try:
            out = []
            for op, subject, details in parts:
                leaf, sig, leaf_hash = sign_leaf(key, origin, seq, time, op, subject, details, prev)
                seq, prev = seq + 1, hashlib.sha256(leaf).hexdigest()
                out.append((leaf, sig, leaf_hash, prev))
            reply: tuple = ("ok", out)
        except Exception as exc:  # answered, so the parent's caller gets an error, not a hang
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except OSError:
            return
