"""Bounds on request bodies, and authentication before a body is read.

Each route class has its body limit (settings): event batches on the ingest API, and
every other route. A request that declares a longer body (Content-Length) is answered
413 before any of it is read; a chunked one is counted as it arrives and answered 413
at the first byte past the limit. A request with a body is authenticated before the
application reads it, so an unknown client never makes the server hold its body.
"""

from __future__ import annotations

from fastapi import HTTPException, Request
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import outage
from .api.deps import authenticate_header
from .api.problems import Problem, outage_response, problem_response
from .service import Sidecar

BATCH_PATHS = ("/internal/v1/events",)
BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


class BodyLimit:
    def __init__(self, app: ASGIApp, sidecar: Sidecar) -> None:
        self.app, self.sidecar = app, sidecar

    def limit(self, path: str) -> int:
        s = self.sidecar.settings
        return s.max_ingest_body_bytes if path in BATCH_PATHS else s.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit(scope["path"])
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared:
            try:
                size = int(declared[0])
            except ValueError:
                size = -1
            if len(declared) > 1 or size < 0:
                return await self._answer(scope, send, 400, "Bad Request", "the Content-Length is not valid")
            if size > limit:
                return await self._too_large(scope, send, limit)
        if scope["method"] in BODY_METHODS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                principal = await run_in_threadpool(authenticate_header, self.sidecar,
                                                    header.decode("latin-1") if header is not None else None)
            except Problem as p:
                return await self._answer(scope, send, p.status, p.title, p.detail, p.headers)
            except Exception as exc:
                if not outage.is_outage(exc):
                    raise
                outage.note("authentication", exc)
                return await outage_response(Request(scope))(scope, receive, send)
            scope.setdefault("state", {})["principal"] = principal
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # FastAPI passes this on from its body reading
                    raise HTTPException(413, f"the request body is over this route's limit of {limit} bytes")
            return message

        await self.app(scope, counted, send)

    async def _too_large(self, scope: Scope, send: Send, limit: int) -> None:
        await self._answer(scope, send, 413, "Content Too Large",
                           f"the request body is over this route's limit of {limit} bytes")

    async def _answer(self, scope: Scope, send: Send, status: int, title: str, detail: str,
                      headers: dict | None = None) -> None:
        # nothing of the body was read: the connection cannot carry another request
        response = problem_response(status, title, detail, Request(scope), {**(headers or {}), "Connection": "close"})

        async def nothing() -> Message:
            return {"type": "http.disconnect"}

        await response(scope, nothing, send)
