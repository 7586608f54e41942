"""Errors as RFC 9457 problem details (application/problem+json), mapped in one place."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import InputError, KVGuardError, UnknownSequence
from .. import outage
from ..logs import log
from ..registry import ClientIdTaken

MEDIA = "application/problem+json"


class Problem(Exception):
    def __init__(self, status: int, title: str, detail: str, headers: dict | None = None, **extra):
        self.status, self.title, self.detail, self.headers, self.extra = status, title, detail, headers, extra


def problem_response(status: int, title: str, detail: str, request: Request, headers=None, **extra) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail,
            "instance": str(request.url.path), **extra}
    rid = getattr(request.state, "request_id", None)
    if rid:
        body["request_id"] = rid
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

    @app.exception_handler(SQLAlchemyError)  # here, not as a crash below, which uvicorn logs again
    async def _database(request: Request, exc: SQLAlchemyError):
        return await _crash(request, exc)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        if outage.is_outage(exc):  # a passing state of the database, not a bug: no traceback
            outage.note(request.url.path, exc)
            return outage_response(request)
        log.exception("unhandled error")
        return problem_response(500, "Internal Server Error", "see the sidecar's log for this request id", request)


def _title(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
