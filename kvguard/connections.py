"""The connections of the HTTP servers (the sidecar's and serve-llm's): a deadline on reading
each request, and a bound on connections that are not running a request, kept apart from the
bound on requests in flight.

uvicorn times out idle keep-alive connections only: a client that connects and sends nothing,
or sends its headers or body a byte at a time, or less body than its Content-Length, would hold
a connection (and its buffers) for as long as it liked. Its `limit_concurrency` counts every
open connection, so a few hundred such sockets turn every request, health checks included,
into a plain-text 503. Here a request's headers and body must arrive within `read_timeout_s`
(else 408, and the connection is closed); connections waiting for a request (new, kept alive,
or still sending one) are at most `max_waiting`, past which the oldest of them is closed, so
the newest client is always heard; requests in flight are at most `max_requests`, past which
the answer is a problem+json 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024


def _problem(status: int, reason: str, detail: str, headers: bytes = b"") -> bytes:
    body = json.dumps({"type": "about:blank", "title": reason, "status": status, "detail": detail},
                      separators=(",", ":")).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/problem+json\r\nconnection: close\r\n%s"
            b"content-length: %d\r\n\r\n%s" % (status, reason.encode(), headers, len(body), body))


_TIMEOUT = _problem(408, "Request Timeout", "the request was too slow")
_SHED = _problem(503, "Service Unavailable", "too many connections are waiting; retry", b"retry-after: 1\r\n")
OVERLOADED_DETAIL = "too many requests are in flight; retry later"


async def overloaded(scope, receive, send) -> None:
    """The answer past `max_requests`: the connection closes after it."""
    body = json.dumps({"type": "about:blank", "title": "Service Unavailable", "status": 503,
                       "detail": OVERLOADED_DETAIL,
                       "error": {"message": OVERLOADED_DETAIL, "type": "Service Unavailable", "code": 503}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/problem+json"), (b"retry-after", b"1"),
                            (b"connection", b"close"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class TimedProtocol(H11Protocol):
    """h11 with a deadline on reading each request and the two bounds above; `protocol()`
    makes one class per server (the waiting connections are counted per class)."""

    read_timeout_s = 10.0
    max_waiting: int | None = None
    max_requests: int | None = None
    _waiting: dict[TimedProtocol, None] = {}  # in the order they began to wait: the oldest first
    _read_timer: asyncio.TimerHandle | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.max_requests is not None:
            app, tasks, limit = self.app, self.tasks, self.max_requests

            async def admitted(scope, receive, send):
                # the request's own task is among `tasks` already
                if scope["type"] == "http" and len(tasks) > limit:
                    return await overloaded(scope, receive, send)
                return await app(scope, receive, send)

            self.app = admitted

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        self._wait()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the whole request is in (or the connection is done)
        if self.cycle is not None and not self.cycle.response_complete:
            self._waiting.pop(self, None)  # a request now: bounded by max_requests

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._wait()  # kept alive, waiting for its next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._waiting.pop(self, None)
        super().connection_lost(exc)

    def _wait(self) -> None:
        waiting = self._waiting
        waiting.pop(self, None)
        waiting[self] = None
        if self.max_waiting is not None and len(waiting) > self.max_waiting:
            self._shed(next(iter(waiting)))

    @staticmethod
    def _shed(oldest: TimedProtocol) -> None:
        oldest._waiting.pop(oldest, None)
        oldest._disarm()
        if oldest.transport.is_closing():
            return
        if oldest.cycle is None or oldest.conn.trailing_data[0]:
            oldest.transport.write(_SHED)  # it connected, or began a request, and is told why it is cut
        oldest.transport.close()  # else an idle kept-alive connection: closed as its keep-alive timeout would

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        self._waiting.pop(self, None)
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # answered without the rest of the body (401, 413): done
            return
        if self.cycle is not None:  # the app sees the client gone, and its answer goes nowhere
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(_TIMEOUT)
        self.transport.close()


def protocol(read_timeout_s: float, *, max_waiting: int | None = None,
             max_requests: int | None = None) -> type[H11Protocol]:
    """The protocol class of one server (uvicorn's `http=`); give uvicorn no `limit_concurrency`
    where `max_waiting` or `max_requests` is set: that one counts idle connections too."""
    return type("TimedProtocol", (TimedProtocol,), {"read_timeout_s": read_timeout_s, "max_waiting": max_waiting,
                                                    "max_requests": max_requests, "_waiting": {}})
