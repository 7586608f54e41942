"""The inference side: streams a cache's events to the sidecar and carries out its
erase commands. It runs in the serving process, so it imports the cache and httpx,
never the daemon (kvguard.sidecar: its FastAPI app, its SQL store).

Events leave the decode loop through the cache's queue; a sender thread moves them
into a pending buffer and posts them in batches, removing each only once the
sidecar says it is durable. Nothing is dropped: when the sidecar is unreachable
the buffer grows, and once it holds `max_pending` events new sequences are
refused (`on_full="refuse"`) or wait (`on_full="block"`) until it drains, while
open sequences keep decoding. A command thread long-polls for erase commands,
erases under the cache's lock, waits until its own erase event is durable, and
acknowledges with what was overwritten.

Failures are logged (`logging`, logger `kvguard.client`) when they begin
and end, never with a subject id. An event the sidecar could not record as sent
comes back as `refused` in its answer (it recorded an `ingest_error` in its
place): it is logged as an error and counted in `refused`. A batch answered with
an error status is kept and sent again, since nothing of it was recorded.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import httpx

from .cache import CacheManager
from .errors import KVGuardError
from .threads import on_a_thread
from .types import SeqId, Subject

_log = logging.getLogger(__name__)


class SidecarUnavailable(KVGuardError):
    """The sidecar has not confirmed recent events; new sequences are refused until it does."""


class SidecarClient:
    def __init__(self, cache: CacheManager, *, token: str, socket: str | Path | None = None,
                 url: str | None = None, client_id: str | None = None, max_pending: int = 50_000,
                 on_full: Literal["block", "refuse"] = "block", batch: int = 1024, interval_s: float = 0.05,
                 block_timeout_s: float = 60.0, poll_wait_s: float = 5.0, heartbeat_s: float = 1.0):
        if (socket is None) == (url is None):
            # the sidecar serves the ingest API on its Unix socket only; a url must reach that API
            # (e.g. a proxy to the socket), never the admin API's TCP port, which answers it 404
            raise ValueError("give exactly one of socket (the sidecar's Unix socket) or url (an http:// address "
                             "that serves the sidecar's ingest API)")
        self.cache = cache
        self.client_id = client_id or f"proc-{uuid.uuid4().hex[:12]}"
        # Drawn at every start: with it the sidecar tells this process's events and commands from
        # those of an earlier run, or of another process, under the same client_id.
        self.instance = secrets.token_hex(8)
        transport = httpx.HTTPTransport(uds=str(socket)) if socket else None
        self._http = httpx.Client(base_url=url or "http://sidecar", transport=transport, timeout=40.0,
                                  headers={"Authorization": f"Bearer {token}"})
        self.max_pending, self.on_full, self.batch = max_pending, on_full, batch
        # events are looked for every interval_s and sent as soon as there are any; with none, the
        # process still reports (its statistics and open sessions: what keeps it live to the
        # sidecar) every heartbeat_s, not at every look: an idle sidecar is not kept busy
        self.interval_s, self.block_timeout_s, self.heartbeat_s = interval_s, block_timeout_s, heartbeat_s
        self._last_post = -math.inf
        self.poll_wait_s = poll_wait_s  # a command poll's wait (the sidecar ends it early when this process says goodbye)
        self._pending: deque[dict] = deque()
        self._next_no = 0
        self._durable_no = -1
        self._opened: dict[SeqId, tuple[Subject, int]] = {}
        self._opened_lock = threading.Lock()  # the serving thread opens, the sender and command threads prune
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.connected = False
        self.last_error: str | None = None  # why the last batch was not recorded, while that lasts
        self.refused = 0  # events the sidecar recorded as ingest_error
        self.erasures: list[dict] = []  # results of executed commands, for the serving process's own use
        self.command_errors = 0  # commands whose execution raised (each retried at the next poll)
        self._threads = [threading.Thread(target=self._send_loop, name="kvguard-events", daemon=True),
                         threading.Thread(target=self._command_loop, name="kvguard-commands", daemon=True)]

    def start(self) -> SidecarClient:
        for t in self._threads:
            t.start()
        return self

    def close(self, flush_timeout_s: float = 10.0) -> None:
        self.flush(flush_timeout_s)
        self._stop.set()
        # say goodbye, so the sidecar stops counting this process as live: an erasure would
        # otherwise wait for an acknowledgement that never comes, and fail; the sidecar also
        # ends the command poll in flight, so the threads end now rather than after its wait
        try:
            self._http.post("/internal/v1/goodbye", json={"client": self.client_id, "instance": self.instance},
                            timeout=5.0)
        except httpx.HTTPError:
            pass  # unreachable: it stops counting this process as live after its liveness window
        for t in self._threads:
            t.join(timeout=45)
        self._http.close()

    def __enter__(self) -> SidecarClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the serving process's side --------------------------------------------------------------

    def open(self, subject: Subject, tokens: Sequence[int] | None = None) -> SeqId:
        """Open a sequence, applying back-pressure when events are not being recorded."""
        with self._cond:
            if len(self._pending) >= self.max_pending:
                if self.on_full == "refuse":
                    raise SidecarUnavailable(f"{len(self._pending)} events await the sidecar; "
                                             "refusing new sequences until they are recorded")
                if not self._cond.wait_for(lambda: len(self._pending) < self.max_pending, self.block_timeout_s):
                    raise SidecarUnavailable("the sidecar did not record pending events in time")
        seq = self.cache.open(subject, tokens)
        with self._opened_lock:
            self._opened[seq] = (subject, time.time_ns() // 1_000_000)
        return seq

    def free(self, seq: SeqId) -> None:
        self.cache.free(seq)
        with self._opened_lock:
            self._opened.pop(seq, None)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event emitted so far is durable in the audit log."""
        with self._cond:
            self._collect()
            target = self._next_no - 1
            return self._cond.wait_for(lambda: self._durable_no >= target, timeout_s)

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- threads ----------------------------------------------------------------------------------

    def _collect(self) -> None:
        # Taken and numbered under one lock: an event the sender has taken is numbered before
        # `flush` reads the last number, or flush would not wait for it.
        with self._cond:
            for e in self.cache.events.take_events():
                s = e.subject
                self._pending.append({"n": self._next_no, "op": e.op,
                                      "subject": {"tenant": s.tenant, "user": s.user, "session": s.session},
                                      "details": e.details()})
                self._next_no += 1

    def _send_loop(self) -> None:
        backoff = self.interval_s
        while not self._stop.is_set():
            self._collect()
            with self._cond:
                batch = list(self._pending)[: self.batch]
            if not batch and self.connected and time.monotonic() - self._last_post < self.heartbeat_s:
                self._stop.wait(self.interval_s)
                continue
            self._last_post = time.monotonic()
            self._prune_opened()
            with self._opened_lock:
                opened = list(self._opened.values())
            body = {"client": self.client_id, "instance": self.instance, "events": batch,
                    "stats": self._stats(),
                    "sessions": [{"subject": {"tenant": sub.tenant, "user": sub.user, "session": sub.session},
                                  "opened_ms": t} for sub, t in opened]}
            try:
                r = self._http.post("/internal/v1/events", json=body)
                r.raise_for_status()
                ack = r.json()
                up_to, refused = int(ack["up_to"]), set(ack.get("refused") or ())
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                self._failing(exc, len(batch))
                backoff = min(backoff * 2, 2.0)
                self._stop.wait(backoff)
                continue
            for e in batch:
                if e["n"] in refused:  # a bug of this process or of the cache: say which event
                    _log.error("the sidecar could not record event %d (op %s) as sent and recorded an "
                               "ingest_error in its place", e["n"], e["op"])
            recovered = self.last_error is not None
            with self._cond:
                while self._pending and self._pending[0]["n"] <= up_to:
                    self._pending.popleft()
                self._durable_no = max(self._durable_no, up_to)
                self.refused += len(refused)
                self.connected, self.last_error = True, None  # set before flush wakes and reads them
                self._cond.notify_all()
            if recovered:
                _log.warning("the sidecar records events again (%d pending)", len(self._pending))
            backoff = self.interval_s
            if len(self._pending) < self.batch:  # a full batch more goes at once
                self._stop.wait(backoff)

    def _failing(self, exc: Exception, n: int) -> None:
        """Note why a batch was not recorded; logged when the reason changes, not at every retry."""
        self.connected = False
        if isinstance(exc, httpx.HTTPStatusError):  # the sidecar's own words (problem+json), no event content
            reason = f"the sidecar answered {exc.response.status_code}"
            try:
                detail = exc.response.json().get("detail")
            except (ValueError, AttributeError):
                detail = None
            if detail:
                reason += f" ({str(detail)[:200]})"
        elif isinstance(exc, httpx.HTTPError):
            reason = f"the sidecar is unreachable ({type(exc).__name__})"
        else:
            reason = "the sidecar's answer lacks up_to"
        if reason != self.last_error:
            level = logging.WARNING if isinstance(exc, httpx.TransportError) else logging.ERROR
            _log.log(level, "%s; %d events kept for the next attempt (%d pending)", reason, n,
                     len(self._pending))
        self.last_error = reason

    def _stats(self) -> dict:
        st = self.cache.stats()
        return {"codec": st.codec, "pages_used": st.pages_used, "pages_offloaded": st.pages_offloaded,
                "tokens_held": st.tokens_held}

    def _command_loop(self) -> None:
        while not self._stop.is_set():
            try:
                r = self._http.get("/internal/v1/commands",
                                   params={"client": self.client_id, "instance": self.instance,
                                           "wait": self.poll_wait_s})
                r.raise_for_status()
                for cmd in r.json():
                    self._execute(cmd)
            except httpx.HTTPError:
                self._stop.wait(1.0)
            except Exception as exc:  # noqa: BLE001 - e.g. a tier down (TierError): the thread must live on
                # unacknowledged, the command comes back with the next poll and is tried again; the
                # error's type only, as its text could name the subject
                self.command_errors += 1
                _log.error("kvguard: an erase command failed (%s); it will be retried", type(exc).__name__)
                self._stop.wait(1.0)

    def _prune_opened(self) -> None:
        """Forget the sequences the cache no longer holds (freed, erased). Under the lock: a
        sequence opened meanwhile by the serving thread is neither lost nor iterated over."""
        with self._opened_lock:
            held = set(self.cache.sequences())
            self._opened = {s: v for s, v in self._opened.items() if s in held}

    def _execute(self, cmd: dict) -> None:
        if cmd.get("kind") != "erase":
            return
        erase = self.cache.erase_user if cmd["scope"] == "user" else self.cache.erase_session
        # on a thread that ends with it: its torch work leaves no OpenMP team beside the model's
        event = on_a_thread(lambda: erase(cmd["tenant"], cmd["target"]), "kvguard-erase")
        self._prune_opened()
        # acknowledge only once our own erase event is durable in the log: a client closed before
        # that leaves the command unacknowledged, and the sidecar's attempt fails and is retried
        while not self.flush(5.0):
            if self._stop.is_set():
                return
        result = {"pages": len(event.pages), "bytes": event.bytes, "sequences": event.sequences,
                  "shared_pages": event.shared_pages, "tier_copies": event.tier_copies,
                  "prefix_entries": event.prefix_entries}
        self.erasures.append(result)
        body = {"client": self.client_id, "instance": self.instance, "result": result}
        self._http.post(f"/internal/v1/commands/{cmd['id']}/ack", json=body).raise_for_status()
