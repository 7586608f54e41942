"""What the two OpenAI fronts share (app.py over kvguard's engine, upstream.py before vLLM).

Every error is problem+json (RFC 9457) in the shape the openai client reads; nothing a
client sends makes a 500. Each request gets a request id and one log line (method, path,
status: never a body). A bearer `infer` key names the tenant; the OpenAI `user` field the
end user; `X-Session-ID` the session, else one per request. Bodies are JSON, bounded, and
read as they arrive; validation errors are returned without the values sent.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..request_ids import RequestIds
from ..types import Subject
from .keys import Key, KeyChecker, KeyError_

SESSION = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
TITLES = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
          408: "Request Timeout", 410: "Gone", 413: "Content Too Large", 415: "Unsupported Media Type",
          422: "Unprocessable Content", 429: "Too Many Requests", 499: "Client Closed Request",
          500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}
UNAUDITED = ("the audit sidecar has not recorded recent events; no request runs unaudited, retry later")


class Problem(Exception):
    def __init__(self, status: int, detail: str, headers: dict | None = None, **extra):
        super().__init__(detail)
        self.status, self.detail, self.headers, self.extra = status, detail, headers or {}, extra


def problem(status: int, detail: str, headers: dict | None = None, **extra) -> JSONResponse:
    body = {"type": "about:blank", "title": TITLES.get(status, "Error"), "status": status, "detail": detail,
            # the shape the openai client reads an error's message from
            "error": {"message": detail, "type": TITLES.get(status, "error"), "code": status}} | extra
    return JSONResponse(body, status_code=status, headers=headers, media_type="application/problem+json")


def new_app(title: str, lifespan, log, description: str | None = None) -> FastAPI:
    """A FastAPI app with the fronts' error handlers, request-id middleware and /healthz; no
    OpenAPI pages, and redirect_slashes off: a trailing slash is a 404, not a 307 to a Location
    built from the Host header."""
    app = FastAPI(title=title, lifespan=lifespan, description=description, openapi_url=None, docs_url=None,
                  redoc_url=None, redirect_slashes=False)

    @app.exception_handler(Problem)
    async def _problem(_, exc: Problem):
        return problem(exc.status, exc.detail, exc.headers, **exc.extra)

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):
        return problem(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return problem(422, "the request is invalid", errors=errors(exc.errors()))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_, exc: ClientDisconnect):  # a client going away is no error: the answer goes nowhere
        return problem(499, "the client disconnected")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        # this handler runs outside the request-id middleware: name the request here
        log.error("unhandled error", error=type(exc).__name__,
                  request_id=getattr(request.state, "request_id", None))
        return problem(500, "the server failed; the error is logged")

    app.add_middleware(RequestIds, log=log, quiet=("/healthz", "/readyz"))

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    return app


def bearer(keys: KeyChecker) -> Callable[..., Awaitable[Key]]:
    """authenticate(request, scope="infer") -> the key's tenant and scopes, or a Problem (401 for
    a missing or wrong credential, 403 for a scope it lacks, 503 when keys cannot be checked)."""

    async def authenticate(request: Request, scope: str = "infer") -> Key:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Problem(401, "send 'Authorization: Bearer <key>' with an infer key" if scope == "infer" else
                          f"send 'Authorization: Bearer <token>' with a token of the '{scope}' scope",
                          {"WWW-Authenticate": "Bearer"})
        try:
            return await keys.check(token.strip(), scope)
        except KeyError_ as e:
            headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {"Retry-After": "5"} \
                if e.status == 503 else None
            raise Problem(e.status, e.detail, headers) from None

    return authenticate


def openai_routes(app: FastAPI, authenticate, model_name: str, complete) -> None:
    """/v1/models, and /v1/chat/completions and /v1/completions through
    `complete(request, schema, kind)` (kind "chat" or "text")."""
    from .protocol import ChatRequest, CompletionRequest

    @app.get("/v1/models")
    async def models(request: Request):
        await authenticate(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "kvguard"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, ChatRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, CompletionRequest, "text")


def subject_of(request: Request, key: Key, data, model_name: str, default_user: str | None) -> Subject:
    """The request's subject: the key's tenant, the `user` field (or the front's default), the
    X-Session-ID header (or a new session); 404 for another model's name."""
    if data.model != model_name:
        raise Problem(404, f"no model {data.model!r} here; GET /v1/models lists it")
    user = data.user or default_user
    if user is None:
        raise Problem(400, "name the end user in the 'user' field: their cache and audit records are "
                           "kept under it, and an erasure finds them by it")
    session = request.headers.get("x-session-id") or uuid.uuid4().hex
    if not SESSION.match(session):
        raise Problem(400, "X-Session-ID must be 1 to 128 letters, digits or . _ : -")
    return Subject(key.tenant, user, session)


def parse(schema, body: bytes):
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        found = e.errors()
        if any(err["type"] == "json_invalid" for err in found):
            raise Problem(400, "the body is not valid JSON") from None
        raise Problem(422, "the request is invalid", errors=errors(found)) from None


async def read_body(request: Request, limit: int) -> bytes:
    ctype = request.headers.get("content-type", "application/json").partition(";")[0].strip().lower()
    if ctype != "application/json":
        raise Problem(415, "send the body as JSON with 'Content-Type: application/json'")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise Problem(413, f"the body is over {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Problem(413, f"the body is over {limit} bytes")
    except ClientDisconnect:  # gone, or cut by the read deadline (408): no error of ours
        raise Problem(499, "the client disconnected before its body arrived") from None
    return bytes(body)


def errors(found: list[dict[str, Any]]) -> list[dict]:
    """Validation errors without the values sent: they may hold prompt text."""
    return [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in found[:20]]
