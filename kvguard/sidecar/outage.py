"""The database gone away: what counts as that, and one log line per failure, rate-limited.

While the database is unreachable every request that needs it fails the same way;
a traceback each time says nothing new and floods the log. Callers answer 503 with
Retry-After (api/problems.py) and log through `note`, which writes at most one line
per `every_s` per place, with how many it left out.
"""

from __future__ import annotations

import threading
import time

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from .logs import log

RETRY_AFTER_S = 5


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) says the database cannot be reached."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (OperationalError, InterfaceError)):
            return True
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _Throttle:
    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def note(self, where: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(where, -self.every_s) < self.every_s:
                self._left_out[where] = self._left_out.get(where, 0) + 1
                return
            self._last[where] = now
            left_out = self._left_out.pop(where, 0)
        # the error's type only: a driver's message can carry the host, the user, a statement
        log.warning("database unavailable", where=where, error=type(exc).__name__, not_logged_since=left_out)


note = _Throttle().note
