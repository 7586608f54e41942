"""Bearer API keys: `infer` tokens of the sidecar (`kvguard token create --scope infer --tenant T`).

The sidecar holds the token store; the serving process asks it, over the ingest socket, who a
key is, and keeps the answer for `ttl_s` (a revoked key stops working within that time). Only
the key's SHA-256 is kept here, never the key. Operators' routes (`/metrics`) take the sidecar's
own scopes instead: a token that the sidecar's `/metrics` takes (`audit:read`, or `admin`, which
implies it), never an end user's `infer` key.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

MAX_CACHED = 10_000


OWN_SCOPES = ("ingest", "infer")  # scopes that "admin" does not imply, as in the sidecar's auth.py


@dataclass(frozen=True)
class Key:
    id: str
    scopes: frozenset[str]
    tenant: str | None

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes and scope not in OWN_SCOPES


class KeyError_(Exception):
    """A key the server cannot accept: status 401, 403 or 503, and why."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


class KeyChecker:
    def __init__(self, *, token: str, socket: str | Path | None = None, url: str | None = None, ttl_s: float = 5.0):
        transport = httpx.AsyncHTTPTransport(uds=str(socket)) if socket else None
        self._http = httpx.AsyncClient(base_url=url or "http://sidecar", transport=transport, timeout=10.0,
                                       headers={"Authorization": f"Bearer {token}"})
        self.ttl_s = ttl_s
        self._known: dict[str, tuple[float, Key | None]] = {}
        # one question to the sidecar per key at a time: a burst of requests with one key, as its
        # answer expires, waits for one answer instead of sending the sidecar a question each
        self._asking: dict[str, asyncio.Future] = {}

    async def check(self, token: str, scope: str = "infer") -> Key:
        """The key of a token with `scope` (an `infer` token: bound to a tenant), or KeyError_
        (401 unknown, 403 another scope, 503 when the sidecar cannot say)."""
        if not token.startswith("kvg_") or len(token) > 200:  # not a kvguard token: no need to ask
            raise KeyError_(401, "the API key is unknown, revoked or expired")
        digest = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        hit = self._known.get(digest)
        if hit is None or hit[0] < now:
            asking = self._asking.get(digest)
            if asking is None:
                asking = self._asking[digest] = asyncio.ensure_future(self._ask(token))
                asking.add_done_callback(lambda f: (self._asking.pop(digest, None),
                                                    f.cancelled() or f.exception()))  # retrieved: never "unhandled"
            key = await asyncio.shield(asking)  # a waiter that leaves does not cancel the others' answer
            if len(self._known) >= MAX_CACHED:
                self._known.clear()
            self._known[digest] = (now + self.ttl_s, key)
        else:
            key = hit[1]
        if key is None:
            raise KeyError_(401, "the API key is unknown, revoked or expired")
        if scope != "infer":
            if not key.allows(scope):
                raise KeyError_(403, f"this key lacks the '{scope}' scope (an operator's token, not an API key)")
            return key
        if "infer" not in key.scopes or key.tenant is None:
            raise KeyError_(403, "this key lacks the 'infer' scope: create one with "
                                 "'kvguard token create --scope infer --tenant TENANT'")
        return key

    async def _ask(self, token: str) -> Key | None:
        try:
            r = await self._http.post("/internal/v1/keys/check", json={"token": token})
        except httpx.HTTPError:
            raise KeyError_(503, "the audit sidecar is unreachable; keys cannot be checked") from None
        if r.status_code in (404, 422):
            return None
        if r.status_code != 200:
            raise KeyError_(503, f"the audit sidecar answered {r.status_code} to a key check")
        body = r.json()
        return Key(str(body["id"]), frozenset(body["scopes"]), body.get("tenant"))

    async def aclose(self) -> None:
        await self._http.aclose()
