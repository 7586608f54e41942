"""X-Request-ID for the HTTP servers (the sidecar's and serve-llm's): the caller's id when it is
short, ASCII and alphanumeric (dashes allowed), else a fresh one; bound into the log context for
the request and echoed in the answer."""

from __future__ import annotations

import uuid

import structlog


async def with_request_id(request, call_next):
    """Run `call_next(request)` under the request's id; returns (response, id)."""
    rid = request.headers.get("x-request-id", "")
    if not (0 < len(rid) <= 64 and rid.replace("-", "").isalnum() and rid.isascii()):
        rid = uuid.uuid4().hex
    request.state.request_id = rid
    structlog.contextvars.bind_contextvars(request_id=rid)
    try:
        response = await call_next(request)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    response.headers["X-Request-ID"] = rid
    return response, rid
