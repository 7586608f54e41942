"""The fleet: every sidecar of one database, registered and heartbeating in it, and the
wake-ups that carry a new erasure request (or a change to one) to all of them.

A sidecar registers when it starts and heartbeats every `fleet_heartbeat_s`; one whose
last heartbeat is older than `fleet_deadline_s` is down. One that stops cleanly leaves
(its inference processes have ended with its pod): new requests do not wait for it.
One that is down has not left: new requests get a part for it and wait, naming it.

On PostgreSQL a change to a request is announced with NOTIFY on `CHANNEL`, inside the
transaction that makes it (so it arrives once the change is visible); every sidecar
LISTENs on a connection of its own and wakes its erasure loop. Polling (the loop's own
round each second) is the fallback, and the only mode on SQLite.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from .logs import log
from .models import FleetSidecar

CHANNEL = "kvguard_erasure"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def notify(db: Session, request_id: str) -> None:
    """Announce a change to request `request_id` when `db` commits (PostgreSQL only)."""
    if db.get_bind().dialect.name == "postgresql":
        db.execute(text("SELECT pg_notify(:c, :r)"), {"c": CHANNEL, "r": request_id})


def is_down(row: FleetSidecar, deadline_s: float, at_ms: int | None = None) -> bool:
    return row.left_ms is None and (at_ms or now_ms()) - row.heartbeat_ms > deadline_s * 1000


class Fleet:
    def __init__(self, sessions: Callable[[], Session], origin: str, key_id: str, *,
                 heartbeat_s: float, deadline_s: float) -> None:
        self._db, self.origin, self.key_id = sessions, origin, key_id
        self.heartbeat_s, self.deadline_s = heartbeat_s, deadline_s
        self.instance = uuid.uuid4().hex
        self.started_ms = 0
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()

    # --- membership -----------------------------------------------------------------------------

    def register(self) -> None:
        """Join (or rejoin) the fleet. A sidecar that comes back keeps the parts it missed:
        they were created for it while it was down, and it carries them out before /readyz
        says ready."""
        self.started_ms = now_ms()
        with self._db() as db:
            row = db.get(FleetSidecar, self.origin)
            if row is None:
                row = FleetSidecar(origin=self.origin)
                db.add(row)
            row.instance, row.key_id = self.instance, self.key_id
            row.started_ms = row.heartbeat_ms = self.started_ms
            row.left_ms = None
            db.commit()
        log.info("joined the fleet", origin=self.origin, instance=self.instance)

    def heartbeat(self) -> None:
        with self._db() as db:
            row = db.get(FleetSidecar, self.origin)
            if row is None or row.instance != self.instance:  # removed, or another start took the origin
                log.warning("fleet registration replaced: registering again", origin=self.origin)
                db.rollback()
                self.register()
                return
            row.heartbeat_ms, row.left_ms = now_ms(), None
            db.commit()

    def leave(self) -> None:
        """A clean stop: new requests no longer get a part for this sidecar."""
        with self._db() as db:
            row = db.get(FleetSidecar, self.origin)
            if row is not None and row.instance == self.instance:
                row.left_ms = now_ms()
                db.commit()

    def members(self, db: Session) -> list[FleetSidecar]:
        """The sidecars that get a part of a new request: every one that has not left."""
        return list(db.scalars(select(FleetSidecar).where(FleetSidecar.left_ms.is_(None))))

    # --- wake-ups -------------------------------------------------------------------------------

    def listen(self, url: str, wake: Callable[[str | None], None]) -> None:
        """LISTEN for changes on PostgreSQL in a thread; each calls `wake` (thread-safe) with
        the request's id, or None for a look at every request (after a (re)connection)."""
        if make_url(url).get_backend_name() != "postgresql":
            return
        self._listener = threading.Thread(target=self._listen, args=(url, wake), name="fleet-listen", daemon=True)
        self._listener.start()

    def _listen(self, url: str, wake: Callable[[str | None], None]) -> None:
        import psycopg

        conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    wake(None)  # anything announced while not listening is found by this round
                    backoff = 0.5
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=1.0):
                            wake(n.payload)
            except Exception as exc:  # noqa: BLE001 - polling carries on; listen again later
                log.warning("fleet listener lost its connection; polling meanwhile", error=type(exc).__name__)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=3)
