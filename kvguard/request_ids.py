"""X-Request-ID for the HTTP servers (the sidecar's and serve-llm's): the caller's id when it is
short, ASCII and alphanumeric (dashes allowed), else a fresh one; bound into the log context for
the request and echoed in the answer."""

from __future__ import annotations

import uuid

import structlog


def request_id_of(value: str) -> str:
    """The caller's id when it is short, ASCII and alphanumeric (dashes allowed), else a fresh one."""
    if 0 < len(value) <= 64 and value.replace("-", "").isalnum() and value.isascii():
        return value
    return uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: each HTTP request under its id (in `request.state.request_id`, bound in
    the log context while the app runs, echoed as X-Request-ID) and one log line per request
    with its status, once it is answered (`quiet` paths: none); `on_status(path, status)`, if
    given, is told each answer's status. Pure ASGI, so the chunks of a streamed answer go straight
    through: Starlette's `@app.middleware("http")` moves each through a memory stream between two
    tasks, which a stream of one chunk per token pays on every token."""

    def __init__(self, app, log, quiet: tuple[str, ...] = (), on_status=None):
        self.app, self.log, self.quiet, self.on_status = app, log, quiet, on_status

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        rid = request_id_of(given.decode("latin-1"))
        scope.setdefault("state", {})["request_id"] = rid
        status = 500  # what the client gets when the app fails before it answers

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
            if self.on_status is not None:
                self.on_status(scope["path"], status)
            if scope["path"] not in self.quiet:
                self.log.info("request", method=scope["method"], path=scope["path"], status=status, request_id=rid)
