"""Admin API tokens: bearer tokens with scopes, stored as SHA-256 digests.

A token is 256 random bits, so a plain SHA-256 is enough to store it: there is
nothing to brute-force. It is printed once, at creation, and never logged.
A token may expire (`expires_ms`) and may be revoked; either way it no longer
authenticates, and it no longer counts as the admin token production needs.

An `ingest` token may be bound to tenants: its processes may then send events of
those tenants only, and receive only their erase commands (which carry raw ids).
The token row keeps the tenants' keyed indexes (HMAC under the index key), never
their names.

An `infer` token is an API key of the inference server (`kvguard serve-llm`), bound
to exactly one tenant, whose requests it makes. The serving process needs that
tenant's name (its cache subjects are raw ids), which the row does not keep: the
token carries it, `kvg_<base64url(tenant)>.<secret>`, and since only the whole
token's digest is stored, an altered tenant part authenticates nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvguard.audit.errors import RecordFormatError
from kvguard.audit.pseudonym import index_of, subject_data

from ..errors import ConfigError
from .models import ApiToken

SCOPES = ("erasure:write", "erasure:read", "audit:read", "admin", "ingest", "infer")
PREFIX = "kvg_"
MAX_TOKEN_CHARS = 200
MAX_INFER_TENANT_BYTES = 96  # so that an infer token stays within MAX_TOKEN_CHARS
# scopes that "admin" does not imply: a process's event stream, and an end-user API key of one tenant
OWN_SCOPES = ("ingest", "infer")
MAX_LIFETIME_S = 10 * 365 * 86_400


@dataclass(frozen=True)
class Principal:
    token_id: str
    name: str
    scopes: frozenset[str]
    tenants: frozenset[str] | None = None  # an ingest token's tenants (their indexes); None: all

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes and scope not in OWN_SCOPES


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenant_index(index_key: bytes, tenant: str) -> str:
    """A tenant's keyed index (hex), as token rows and the registry keep it."""
    return index_of(index_key, subject_data("tenant", tenant)).hex()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def create_token(session: Session, name: str, scopes: list[str], *, tenants: list[str] | None = None,
                 index_key: bytes | None = None, expires_in_s: float | None = None) -> str:
    bad = [s for s in scopes if s not in SCOPES]
    if not scopes or bad:
        raise ConfigError(f"unknown scope(s) {bad}; choose from {', '.join(SCOPES)}" if bad else "give --scope")
    if not name or len(name) > 100:
        raise ConfigError("a token needs a name of 1 to 100 characters")
    if expires_in_s is not None and not 0 < expires_in_s <= MAX_LIFETIME_S:
        raise ConfigError("--expires-in must be more than 0 s and at most 10 years")
    bound = None
    infer = "infer" in scopes
    if infer and (set(scopes) != {"infer"} or tenants is None or len(set(tenants)) != 1):
        raise ConfigError("an infer token is bound to exactly one tenant: give --scope infer alone and one --tenant")
    if infer and not 0 < len(tenants[0].encode()) <= MAX_INFER_TENANT_BYTES:
        raise ConfigError(f"an infer token's tenant id must be 1 to {MAX_INFER_TENANT_BYTES} bytes")
    if tenants is not None:
        if set(scopes) not in ({"ingest"}, {"infer"}):
            raise ConfigError("only an ingest token can be bound to tenants (--tenant), or an infer token to one: "
                              "give --scope ingest or --scope infer alone")
        if not tenants or len(tenants) > 1000 or index_key is None:
            raise ConfigError("bind a token to 1 to 1000 tenants")
        try:
            bound = " ".join(sorted({tenant_index(index_key, t) for t in tenants}))
        except RecordFormatError:
            raise ConfigError("a tenant id must be a non-empty string without NUL") from None
    token = PREFIX + secrets.token_urlsafe(32)
    if infer:
        token = PREFIX + base64.urlsafe_b64encode(tenants[0].encode()).decode().rstrip("=") + "." + token[len(PREFIX):]
    now = _now_ms()
    expires = None if expires_in_s is None else now + int(expires_in_s * 1000)
    session.add(ApiToken(id=uuid.uuid4().hex, name=name, token_sha256=digest(token),
                         scopes=" ".join(sorted(set(scopes))), tenants=bound, created_ms=now, expires_ms=expires))
    session.commit()
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    if not token.startswith(PREFIX) or len(token) > MAX_TOKEN_CHARS:
        return None
    d = digest(token)
    row = session.scalar(select(ApiToken).where(ApiToken.token_sha256 == d))
    if row is None or not _usable(row, _now_ms()) or not hmac.compare_digest(row.token_sha256, d):
        return None
    return Principal(row.id, row.name, frozenset(row.scopes.split()),
                     None if row.tenants is None else frozenset(row.tenants.split()))


def token_tenant(token: str) -> str | None:
    """The tenant an infer token carries (see the module's docstring), or None for a token of
    another kind or one that is malformed. Trust it only once the token has authenticated."""
    head, dot, _ = token.removeprefix(PREFIX).partition(".")
    if not token.startswith(PREFIX) or not dot or not head:
        return None
    try:
        tenant = base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return tenant if tenant and "\x00" not in tenant else None


def _usable(row: ApiToken, now_ms: int) -> bool:
    return not row.revoked and (row.expires_ms is None or now_ms < row.expires_ms)


def any_admin_token(session: Session) -> bool:
    """Whether a usable (neither revoked nor expired) token with the admin scope exists; an
    ingest or read-only token does not let anyone run erasures or read the log."""
    now = _now_ms()
    rows = session.scalars(select(ApiToken).where(ApiToken.revoked.is_(False), ApiToken.scopes.contains("admin")))
    return any("admin" in row.scopes.split() and _usable(row, now) for row in rows)


@dataclass(frozen=True)
class TokenInfo:
    """What `kvguard token list` shows: never the token nor its digest, nor the tenants' indexes."""
    id: str
    name: str
    scopes: str
    tenants: int | None  # how many tenants an ingest token is bound to; None: every tenant
    created_ms: int
    expires_ms: int | None
    revoked: bool


def list_tokens(session: Session) -> list[TokenInfo]:
    rows = session.scalars(select(ApiToken).order_by(ApiToken.created_ms, ApiToken.id))
    return [TokenInfo(r.id, r.name, r.scopes, None if r.tenants is None else len(r.tenants.split()),
                      r.created_ms, r.expires_ms, r.revoked) for r in rows]


def revoke_token(session: Session, token_id: str) -> None:
    """Revoke a token by its id (as `kvguard token list` shows it); it gets 401 from the next request."""
    row = session.get(ApiToken, token_id) if 0 < len(token_id) <= 32 else None
    if row is None:
        raise ConfigError(f"no token with id {token_id!r}: see 'kvguard token list'")
    row.revoked = True
    session.commit()
