"""Dependencies of the routes: the sidecar, bearer-token authentication with scopes, and
JSON bodies read strictly."""

from __future__ import annotations

import codecs
import json
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..auth import Principal, authenticate
from ..service import Sidecar
from .problems import Problem

bearer = HTTPBearer(auto_error=False, description="An API token from 'kvguard token create'")


def get_sidecar(request: Request) -> Sidecar:
    return request.app.state.sidecar


SidecarDep = Annotated[Sidecar, Depends(get_sidecar)]


def authenticate_header(sidecar: Sidecar, authorization: str | None) -> Principal:
    """The principal of an Authorization header, or Problem 401."""
    scheme, _, token = (authorization or "").partition(" ")
    if not token or scheme.lower() != "bearer":
        raise Problem(401, "Unauthorized", "send 'Authorization: Bearer <token>'",
                      headers={"WWW-Authenticate": "Bearer"})
    with sidecar.db() as db:
        principal = authenticate(db, token.strip())
    if principal is None:
        raise Problem(401, "Unauthorized", "the token is unknown, revoked or expired",
                      headers={"WWW-Authenticate": "Bearer"})
    return principal


def require(scope: str):
    def check(request: Request, sidecar: SidecarDep,
              creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        # a request with a body was authenticated before its body was read (limits.py)
        principal = getattr(request.state, "principal", None)
        if principal is None:
            if creds is None or creds.scheme.lower() != "bearer":
                raise Problem(401, "Unauthorized", "send 'Authorization: Bearer <token>'",
                              headers={"WWW-Authenticate": "Bearer"})
            principal = authenticate_header(sidecar, f"Bearer {creds.credentials}")
        if not principal.allows(scope):
            raise Problem(403, "Forbidden", f"this token lacks the '{scope}' scope")
        return principal

    return check


def json_body(request: Request) -> None:
    """A body sent as anything but JSON (curl -d sends a form), or without a Content-Type, gets
    a 415 that says what to send, not a 422 about fields the body seems to lack. A request with no
    body at all is left to the route: its credentials are checked first (401, 403), then its
    missing body (422); a body was authenticated before it was read (limits.py)."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise Problem(415, "Unsupported Media Type",
                      "send the body as JSON with the header 'Content-Type: application/json'",
                      headers={"Accept-Post": "application/json"})


JsonBody = Depends(json_body)


class _Repeated(Exception):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Repeated
    return obj


def strict_json(body: bytes) -> Any:
    """A body's JSON as RFC 8259 asks of JSON between systems, or JSONDecodeError (a 422): UTF-8
    with no byte order mark, and no name twice in one object. Python's json takes a BOM, and
    the last of a repeated name, where another reader of the same bytes may take the first."""
    if body.startswith(codecs.BOM_UTF8):
        raise json.JSONDecodeError("the body starts with a byte order mark", "", 0)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise json.JSONDecodeError("the body is not UTF-8", "", e.start) from None
    try:
        return json.loads(text, object_pairs_hook=_unique)
    except _Repeated:
        raise json.JSONDecodeError("a name repeats within an object", text, 0) from None


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_json(await self.body())
        return self._json


class StrictJsonRoute(APIRoute):
    """A route whose JSON body is read by strict_json (the routers with bodies use it)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(_StrictJsonRequest(request.scope, request.receive, request._send))

        return strict
ErasureWrite = Annotated[Principal, Depends(require("erasure:write"))]
ErasureRead = Annotated[Principal, Depends(require("erasure:read"))]
AuditRead = Annotated[Principal, Depends(require("audit:read"))]
Ingest = Annotated[Principal, Depends(require("ingest"))]
Admin = Annotated[Principal, Depends(require("admin"))]
