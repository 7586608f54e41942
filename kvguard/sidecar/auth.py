"""Admin API tokens: bearer tokens with scopes, stored as SHA-256 digests.

A token is 256 random bits, so a plain SHA-256 is enough to store it: there is
nothing to brute-force. It is printed once, at creation, and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import ConfigError
from .models import ApiToken

SCOPES = ("erasure:write", "erasure:read", "audit:read", "admin", "ingest")
PREFIX = "kvg_"


@dataclass(frozen=True)
class Principal:
    token_id: str
    name: str
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes and scope != "ingest"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str, scopes: list[str]) -> str:
    bad = [s for s in scopes if s not in SCOPES]
    if not scopes or bad:
        raise ConfigError(f"unknown scope(s) {bad}; choose from {', '.join(SCOPES)}" if bad else "give --scope")
    if not name or len(name) > 100:
        raise ConfigError("a token needs a name of 1 to 100 characters")
    token = PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(id=uuid.uuid4().hex, name=name, token_sha256=digest(token),
                         scopes=" ".join(sorted(set(scopes))), created_ms=int(time.time() * 1000)))
    session.commit()
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    if not token.startswith(PREFIX) or len(token) > 100:
        return None
    d = digest(token)
    row = session.scalar(select(ApiToken).where(ApiToken.token_sha256 == d))
    if row is None or row.revoked or not hmac.compare_digest(row.token_sha256, d):
        return None
    return Principal(row.id, row.name, frozenset(row.scopes.split()))


def any_admin_token(session: Session) -> bool:
    return session.scalar(select(ApiToken.id).where(ApiToken.revoked.is_(False)).limit(1)) is not None
