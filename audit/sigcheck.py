"""Ed25519 checks of a record stream, on worker threads.

The cryptography library releases the GIL while it verifies, so batches checked
on worker threads overlap with parsing and hashing the next records: verifying a
log runs at about the raw verify rate of one core or better, instead of well
below it. Failures still come out in seq order: a verifier asks for the
earliest failure before it reports any later one (audit.verify.LogVerifier).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from .errors import VerificationError
from .keys import PublicKey

Check = tuple[int, PublicKey, bytes, bytes]  # seq, key, signature, signed bytes


def default_workers() -> int:
    return min(4, os.cpu_count() or 1) if (os.cpu_count() or 1) > 1 else 0


def _run(batch: list[Check]) -> tuple[int, str] | None:
    for seq, key, sig, data in batch:
        try:
            key.verify(sig, data)
        except VerificationError as exc:
            return seq, exc.message
    return None


class SignatureChecks:
    def __init__(self, workers: int | None = None, batch: int = 256) -> None:
        workers = default_workers() if workers is None else workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="audit-verify") if workers else None
        self._size, self._limit = batch, 2 * max(workers, 1)
        self._batch: list[Check] = []
        self._inflight: deque[Future] = deque()
        self._failure: tuple[int, str] | None = None

    def check(self, seq: int, key: PublicKey, sig: bytes, data: bytes) -> tuple[int, str] | None:
        """Queue one check; returns a failure already known (the earliest), if any."""
        if self._pool is None:
            return _run([(seq, key, sig, data)])
        self._batch.append((seq, key, sig, data))
        if len(self._batch) >= self._size:
            self._inflight.append(self._pool.submit(_run, self._batch))
            self._batch = []
            while self._inflight and (self._inflight[0].done() or len(self._inflight) > self._limit):
                self._note(self._inflight.popleft().result())
        return self._failure

    def drain(self) -> tuple[int, str] | None:
        """Finish every queued check; the earliest failure, if any."""
        if self._batch:
            self._note(_run(self._batch))
            self._batch = []
        while self._inflight:
            self._note(self._inflight.popleft().result())
        return self._failure

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _note(self, failure: tuple[int, str] | None) -> None:
        if failure and (self._failure is None or failure[0] < self._failure[0]):
            self._failure = failure
