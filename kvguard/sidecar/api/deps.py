"""Dependencies of the routes: the sidecar, and bearer-token authentication with scopes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
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
    """A body sent as anything but JSON (curl -d sends a form) gets a 415 that says what to send,
    not a 422 about fields the body seems to lack."""
    ctype = request.headers.get("content-type")
    if ctype is None:
        return  # read as JSON
    media = ctype.partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise Problem(415, "Unsupported Media Type",
                      "send the body as JSON with the header 'Content-Type: application/json'",
                      headers={"Accept-Post": "application/json"})


JsonBody = Depends(json_body)
ErasureWrite = Annotated[Principal, Depends(require("erasure:write"))]
ErasureRead = Annotated[Principal, Depends(require("erasure:read"))]
AuditRead = Annotated[Principal, Depends(require("audit:read"))]
Ingest = Annotated[Principal, Depends(require("ingest"))]
Admin = Annotated[Principal, Depends(require("admin"))]
