"""The queue between the log's callers and its writer: queued records and their answers.

Each call puts its records on the queue in order (append_many: in slices, back to
back), so a call's records are contiguous in the log; STOP ends the writer.
submit() answers with a Future; append() and append_many() share one Waiter per
call, because a Future per record costs more than signing it once thousands of
records are pending.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .keys import SigningKey
from .record import Record


class Waiter:
    """One event for all records of an append/append_many call: a Future per record
    costs more than signing it once thousands are pending."""

    __slots__ = ("_lock", "_done", "_pending", "error")

    def __init__(self, n: int) -> None:
        self._lock, self._done, self._pending, self.error = threading.Lock(), threading.Event(), n, None

    def finish(self, error: BaseException | None, count: int = 1) -> None:
        with self._lock:
            self.error = self.error or error
            self._pending -= count
            if self._pending == 0:
                self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


@dataclass(slots=True)
class Item:
    op: str
    subject: dict[str, str]
    details: dict[str, Any]
    future: Future | None = None  # submit()
    waiter: Waiter | None = None  # append(), append_many()
    result: Record | None = None
    new_key: SigningKey | None = None  # a key rotation
    checkpoint: bool = False  # a forced checkpoint
    sync: bool = False  # adopt what others stored past the tail (AuditLog.verify_tail)
    done: bool = False  # answered
    encoded: tuple[bytes, bytes] | None = None  # (details, subject) JSON, set as it is queued

    @property
    def control(self) -> bool:
        return self.new_key is not None or self.checkpoint or self.sync

    def resolve(self, record: Any = None, error: BaseException | None = None) -> None:
        """Answer the caller, once."""
        if self.done:
            return
        self.done = True
        if self.future is not None:
            self.future.set_exception(error) if error is not None else self.future.set_result(record)
            return
        self.result = record
        if self.waiter is not None:
            self.waiter.finish(error)


def resolve_all(items: list[Item], records: list[Record]) -> None:
    """Answer a committed batch: each waiter once for all its records, not once per record."""
    counts: dict[Waiter, int] = {}
    for item, record in zip(items, records):
        if item.future is not None or item.waiter is None:
            item.resolve(record)
        elif not item.done:
            item.done, item.result = True, record
            counts[item.waiter] = counts.get(item.waiter, 0) + 1
    for waiter, count in counts.items():
        waiter.finish(None, count)


STOP = object()


def take_batch(entries: queue.SimpleQueue, first: object, limit: int) -> list:
    """`first` and whatever else is queued, up to `limit` items or a STOP (kept, last)."""
    batch = [first] if first is STOP else list(first)
    while batch[-1] is not STOP and len(batch) < limit:
        try:
            more = entries.get_nowait()
        except queue.Empty:
            break
        batch.extend([more] if more is STOP else more)
    return batch


def refuse_all(entries: queue.SimpleQueue, items: list, error: BaseException) -> None:
    """Answer `items` and everything still queued with `error`."""
    while True:
        try:
            more = entries.get_nowait()
        except queue.Empty:
            break
        items.extend([] if more is STOP else more)
    for item in items:
        if item is not STOP and not item.done:
            item.resolve(error=error)
