"""Bearer API keys: `infer` tokens of the sidecar (`kvguard token create --scope infer --tenant T`).

The sidecar holds the token store; the serving process asks it, over the ingest socket, who a
key is, one question per key at a time (a burst of requests with one key waits for one answer).
An answer is fresh for `ttl_s`; a key found valid is then still accepted, for up to `stale_s`
after its last answer, while one question in the background asks again, so a busy key never
waits for the sidecar and a sidecar that stops answering for a moment refuses no known key. A
revoked key stops working once an answer after its revocation arrives: within `ttl_s` plus a
question's round trip while it is in use, and within `stale_s` in every case. Unknown keys are
asked again after `ttl_s`. Only the key's SHA-256 is kept here, never the key. Operators' routes (`/metrics`) take the sidecar's
own scopes instead: a token that the sidecar's `/metrics` takes (`audit:read`, or `admin`, which
implies it), never an end user's `infer` key.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
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
    def __init__(self, *, token: str, socket: str | Path | None = None, url: str | None = None, ttl_s: float = 5.0,
                 stale_s: float = 30.0):
        transport = httpx.AsyncHTTPTransport(uds=str(socket)) if socket else None
        self._http = httpx.AsyncClient(base_url=url or "http://sidecar", transport=transport, timeout=10.0,
                                       headers={"Authorization": f"Bearer {token}"})
        self.ttl_s, self.stale_s = ttl_s, max(ttl_s, stale_s)
        self._known: dict[str, tuple[float, Key | None]] = {}  # digest -> (when answered, the key or None)
        self.questions = 0  # asked of the sidecar since start
        # one question to the sidecar per key at a time: a burst of requests with one key, as its
        # answer expires, waits for one answer instead of sending the sidecar a question each
        self._asking: dict[str, asyncio.Future] = {}

    async def check(self, token: str, scope: str = "infer") -> Key:
        """The key of a token with `scope` (an `infer` token: bound to a tenant), or KeyError_
        (401 unknown, 403 another scope, 503 when the sidecar cannot say)."""
        if not token.startswith("kvg_") or len(token) > 200:  # not a kvguard token: no need to ask
            raise KeyError_(401, "the API key is unknown, revoked or expired")
        digest = hashlib.sha256(token.encode()).hexdigest()
        age = math.inf
        hit = self._known.get(digest)
        if hit is not None:
            age = time.monotonic() - hit[0]
        if age < self.ttl_s:
            key = hit[1]
        elif hit is not None and hit[1] is not None and age < self.stale_s:
            key = hit[1]  # a valid key's answer, getting old: accepted while one question asks again
            self._question(token, digest)
        else:
            # a waiter that leaves does not cancel the others' answer
            key = await asyncio.shield(self._question(token, digest))
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

    def _question(self, token: str, digest: str) -> asyncio.Future:
        """The question in flight about a key, asked now if none is; its answer is kept."""
        asking = self._asking.get(digest)
        if asking is None:
            asking = self._asking[digest] = asyncio.ensure_future(self._ask(token))
            asking.add_done_callback(lambda f: self._answered(digest, f))
        return asking

    def _answered(self, digest: str, f: asyncio.Future) -> None:
        self._asking.pop(digest, None)
        if f.cancelled() or f.exception() is not None:  # retrieved: never "unhandled"
            return
        if len(self._known) >= MAX_CACHED:
            self._known.clear()
        self._known[digest] = (time.monotonic(), f.result())

    async def _ask(self, token: str) -> Key | None:
        self.questions += 1
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
