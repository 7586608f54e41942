"""Errors as RFC 9457 problem details (application/problem+json), mapped in one place, and
documented in the OpenAPI schema as what they are."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvguard.audit.errors import TamperedLogError

from ...errors import InputError, KVGuardError, UnknownSequence
from .. import outage
from ..logs import log
from ..registry import ClientIdTaken

MEDIA = "application/problem+json"


class Problem(Exception):
    def __init__(self, status: int, title: str, detail: str, headers: dict | None = None, **extra):
        self.status, self.title, self.detail, self.headers, self.extra = status, title, detail, headers, extra


class ProblemDetails(BaseModel):
    """An error (RFC 9457). Quote `request_id` when asking about it: the sidecar's log lines
    of the request carry it."""
    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str
    request_id: str | None = None
    errors: list[dict] | None = None  # 422: which input, and what is wrong with it


WHY = {
    401: "No usable token: missing, unknown, revoked or expired",
    403: "The token lacks the scope this route needs",
    404: "No such resource",
    409: "Another run of the same operation is in progress (here or on another sidecar): try again when it is done",
    415: "The body is not JSON: send 'Content-Type: application/json'",
    422: "A parameter or the body is not valid",
    503: "The audit store is unreachable or the sidecar is not ready",
}


def documented(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI `responses` for these error statuses, as the problem+json they are sent as."""
    ref = {"$ref": "#/components/schemas/ProblemDetails"}
    return {s: {"description": WHY[s], "content": {MEDIA: {"schema": ref}}} for s in statuses}


def with_problem_schema(app: FastAPI) -> None:
    """Put ProblemDetails into the schema's components, where `documented` points, and document
    the 422 that FastAPI adds to every route with input as the problem+json it is sent as."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for default in ("HTTPValidationError", "ValidationError"):
                schemas.pop(default, None)
            schemas["ProblemDetails"] = ProblemDetails.model_json_schema()
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    if "422" in op.get("responses", {}):
                        op["responses"]["422"] = documented(422)[422]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def problem_response(status: int, title: str, detail: str, request: Request, headers=None, **extra) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail,
            "instance": str(request.url.path), **extra}
    rid = getattr(request.state, "request_id", None)
    if rid:
        body["request_id"] = rid
        headers = {**(headers or {}), "X-Request-ID": rid}
    return JSONResponse(body, status_code=status, media_type=MEDIA, headers=headers)


def outage_response(request: Request) -> JSONResponse:
    """503: the database is unreachable; nothing of the request was stored."""
    return problem_response(503, "Service Unavailable", "the audit database is unreachable; nothing of this "
                            "request was stored: retry later", request,
                            {"Retry-After": str(outage.RETRY_AFTER_S)})


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem):
        return problem_response(exc.status, exc.title, exc.detail, request, exc.headers, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", "")} for e in exc.errors()]
        return problem_response(422, "Unprocessable Content", "the request is not valid", request, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return problem_response(exc.status_code, _title(exc.status_code), str(exc.detail), request,
                                getattr(exc, "headers", None))

    @app.exception_handler(InputError)
    async def _input(request: Request, exc: InputError):
        return problem_response(422, "Unprocessable Content", str(exc), request)

    @app.exception_handler(UnknownSequence)
    async def _unknown(request: Request, exc: UnknownSequence):
        return problem_response(404, "Not Found", str(exc), request)

    @app.exception_handler(ClientIdTaken)
    async def _taken(request: Request, exc: ClientIdTaken):
        return problem_response(403, "Forbidden", str(exc), request)

    @app.exception_handler(KVGuardError)
    async def _kvguard(request: Request, exc: KVGuardError):
        return problem_response(400, "Bad Request", str(exc), request)

    @app.exception_handler(TamperedLogError)
    async def _halted(request: Request, exc: TamperedLogError):
        f = exc.failure
        return problem_response(503, "Service Unavailable", "the audit writer stopped: a stored record it did "
                                "not write fails verification; nothing of this request was recorded until an "
                                "operator repairs the store and restarts the sidecar", request,
                                record=f.record, check=f.check)

    @app.exception_handler(SQLAlchemyError)  # here, not as a crash below, which uvicorn logs again
    async def _database(request: Request, exc: SQLAlchemyError):
        return await _crash(request, exc)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        if outage.is_outage(exc):  # a passing state of the database, not a bug: no traceback
            outage.note(request.url.path, exc)
            return outage_response(request)
        # this handler runs outside the request-id middleware: name the request here
        log.exception("unhandled error", request_id=getattr(request.state, "request_id", None),
                      method=request.method, path=request.url.path)
        return problem_response(500, "Internal Server Error", "see the sidecar's log for this request id", request)


def _title(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
