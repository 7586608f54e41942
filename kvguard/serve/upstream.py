"""The OpenAI front before a vLLM server (`kvguard serve-llm --upstream URL`).

The same front as kvguard's own engine (front.py: `infer` keys bound to a tenant, `user` as
the subject, X-Session-ID, problem+json errors, bounded bodies, the same request schemas).
What it sends vLLM it builds itself from the validated fields, never a client's body:

- `cache_salt`: a keyed hash from the sidecar under the secret of the subject at the
  sharing scope (tenant, user or session), so prefix blocks are shared within that scope
  only, no client can choose or guess a salt, and an erasure that shreds the secret makes
  the old blocks unreachable to every later request;
- `kv_transfer_params.kvguard`: the raw subject, for kvguard's connector inside vLLM
  (kvguard.vllm.connector), which accounts for the request's blocks under it.

Streams pass through chunk by chunk with the served model's name and nothing of vLLM's
transfer parameters. The front is an inference process of the sidecar: an erase command
ends the subject's requests in flight (the stream ends with the erasure's error, and vLLM
aborts the request when the front closes it) and forgets its salts; the connector erases
the blocks inside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid

import httpx
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..cache import events as ev
from ..types import Subject
from .engine import ERASED
from .front import (
    TITLES,
    UNAUDITED,
    Problem,
    bearer,
    new_app,
    openai_routes,
    parse,
    problem,
    read_body,
    subject_of,
)
from .keys import KeyChecker

log = structlog.get_logger("kvguard.serve.upstream")
SCOPES = ("tenant", "user", "session")
DROP = ("kv_transfer_params", "prompt_token_ids", "prompt_logprobs")  # vLLM's, never a client's
_END, _FAILED = object(), object()  # a stream's end, and vLLM's failure mid-stream


class Inflight:
    """Requests in flight by subject; an erasure (on the sidecar client's command thread) ends
    those of its subject and waits until each has closed its connection to vLLM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reqs: dict[str, tuple[Subject, asyncio.AbstractEventLoop, asyncio.Event, threading.Event]] = {}

    @contextlib.contextmanager
    def track(self, subject: Subject):
        rid, ended, closed = uuid.uuid4().hex, asyncio.Event(), threading.Event()
        with self._lock:
            self._reqs[rid] = (subject, asyncio.get_running_loop(), ended, closed)
        try:
            yield ended
        finally:
            closed.set()
            with self._lock:
                self._reqs.pop(rid, None)

    def end(self, match, timeout_s: float = 10.0) -> int:
        with self._lock:
            hit = [v for v in self._reqs.values() if match(v[0])]
        for _, loop, ended, _ in hit:
            loop.call_soon_threadsafe(ended.set)
        for *_, closed in hit:
            closed.wait(timeout_s)
        return len(hit)


class Salts:
    """Cache salts from the sidecar, kept `ttl_s` per (scope, tenant, target). An erasure drops
    its subject's at once, and for `fresh_s` after it they are asked anew at every request: the
    sidecar shreds the secret only after every process acknowledged, so a salt fetched between
    the acknowledgement and the shredding must not outlive it here."""

    def __init__(self, http: httpx.AsyncClient, ttl_s: float = 5.0, fresh_s: float = 120.0) -> None:
        self._http, self.ttl_s, self.fresh_s = http, ttl_s, fresh_s
        self._known: dict[tuple[str, str, str], tuple[float, str]] = {}
        self._erased: dict[tuple[str, str], float] = {}  # (tenant, user or session) -> until
        self._lock = threading.Lock()

    @staticmethod
    def key(subject: Subject, scope: str) -> tuple[str, str, str]:
        return scope, subject.tenant, {"tenant": "", "user": subject.user, "session": subject.session}[scope]

    async def salt(self, subject: Subject, scope: str) -> str:
        key, now = self.key(subject, scope), time.monotonic()
        with self._lock:
            hit = self._known.get(key)
            recent = any(self._erased.get((subject.tenant, who), 0) > now for who in (subject.user, subject.session))
        if hit is not None and hit[0] > now and not recent:
            return hit[1]
        body = {"subject": {"tenant": subject.tenant, "user": subject.user, "session": subject.session},
                "scope": scope}
        try:
            r = await self._http.post("/internal/v1/salt", json=body)
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.TimeoutException):
                raise
            # a kept-alive connection the sidecar closed as it was taken (its idle timeout): the
            # salt is a keyed hash, so asking again on a fresh connection is safe
            r = await self._http.post("/internal/v1/salt", json=body)
        r.raise_for_status()
        salt = r.json()["salt"]
        if not recent:
            with self._lock:
                if len(self._known) > 10_000:
                    self._known.clear()
                self._known[key] = (now + self.ttl_s, salt)
        return salt

    def forget(self, tenant: str, scope: str, target: str) -> None:
        """An erasure of a user (and so of her sessions) or of a session; the tenant's salt stays."""
        def dropped(k: tuple[str, str, str]) -> bool:
            kscope, ktenant, ktarget = k
            if ktenant != tenant or kscope == "tenant":
                return False
            if scope == "user":  # her sessions' salts too: the session keys carry no user
                return kscope == "session" or ktarget == target
            return kscope == "session" and ktarget == target

        with self._lock:
            self._known = {k: v for k, v in self._known.items() if not dropped(k)}
            self._erased[(tenant, target)] = time.monotonic() + self.fresh_s
            if len(self._erased) > 10_000:
                now = time.monotonic()
                self._erased = {k: t for k, t in self._erased.items() if t > now}


class FrontProcess:
    """The front as kvguard.client sees an inference process: no cache of its own; an erase
    ends the subject's requests in flight and forgets its salts."""

    codec = None

    def __init__(self, inflight: Inflight, salts: Salts) -> None:
        self.inflight, self.salts = inflight, salts
        self.events = ev.EventQueue()
        self.pages_used: dict = {}
        self.pages_offloaded: dict = {}
        self.tokens_held = 0

    def sequences(self) -> list:
        return []

    def stats(self):
        return self

    def _erase(self, scope: str, tenant: str, target: str) -> ev.SubjectErased:
        def match(s: Subject) -> bool:
            return s.tenant == tenant and (s.user if scope == "user" else s.session) == target

        self.salts.forget(tenant, scope, target)
        ended = self.inflight.end(match)
        subject = Subject(tenant, target if scope == "user" else "*", target if scope == "session" else "*")
        event = ev.SubjectErased(None, subject, (), 0, 0, scope=scope, sequences=ended)
        self.events.emit(event)
        return event

    def erase_user(self, tenant: str, user: str) -> ev.SubjectErased:
        return self._erase("user", tenant, user)

    def erase_session(self, tenant: str, session: str) -> ev.SubjectErased:
        return self._erase("session", tenant, session)


def create_upstream_app(upstream: str, keys: KeyChecker, salts: Salts, inflight: Inflight, *, model_name: str,
                        upstream_model: str, scope: str = "tenant", default_user: str | None = None,
                        max_body_bytes: int = 1 << 20, client=None, timeout_s: float = 600.0) -> FastAPI:
    if scope not in SCOPES:
        raise ValueError(f"the prefix-sharing scope is one of {SCOPES}")
    http = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=5.0),
                             limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await http.aclose()
        await keys.aclose()

    app = new_app("kvguard serve-llm (vLLM upstream)", lifespan, log)
    authenticate = bearer(keys)

    @app.get("/readyz")
    async def readyz():
        try:
            up = (await http.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            up = False
        if not up or (client is not None and not client.connected):
            return problem(503, "not ready: vLLM does not answer /health, or the audit sidecar has not "
                                "confirmed events", {"Retry-After": "5"})
        return {"status": "ready"}

    async def complete(request: Request, schema, kind: str):
        key = await authenticate(request)
        data = parse(schema, await read_body(request, max_body_bytes))
        subject = subject_of(request, key, data, model_name, default_user)
        try:
            salt = await salts.salt(subject, scope)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
            log.warning("salt_unavailable", error=type(exc).__name__, sidecar_status=status)
            raise Problem(503, "the audit sidecar cannot give this request its cache salt; no request runs "
                               "unaudited, retry later", {"Retry-After": "5"}) from None
        if client is not None and not client.connected:
            raise Problem(503, UNAUDITED, {"Retry-After": "5"})
        out = {"model": upstream_model, "temperature": data.temperature, "top_p": data.top_p,
               "stream": data.stream, "cache_salt": salt,
               "kv_transfer_params": {"kvguard": {"tenant": subject.tenant, "user": subject.user,
                                                  "session": subject.session}}}
        if kind == "chat":
            out["messages"] = [{"role": m.role, "content": m.text()} for m in data.messages]
        else:
            out["prompt"] = data.prompt
        for name, value in (("max_tokens", data.limit()), ("seed", data.seed), ("stop", data.stop)):
            if value is not None:
                out[name] = value
        if data.stream and data.stream_options is not None:
            out["stream_options"] = {"include_usage": data.stream_options.include_usage}
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        headers = {"X-Session-ID": subject.session}
        if data.stream:
            return await _stream(path, out, subject, headers)
        return await _once(path, out, subject, headers)

    def _clean(obj: dict) -> dict:
        for k in DROP:
            obj.pop(k, None)
        if "model" in obj:
            obj["model"] = model_name
        for c in obj.get("choices") or ():
            if isinstance(c, dict):
                for k in DROP:
                    c.pop(k, None)
        return obj

    def _upstream_error(status: int, raw: bytes) -> Problem:
        try:
            body = json.loads(raw)
            msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
        except (ValueError, AttributeError):
            msg = None
        if status >= 500:  # vLLM's own failure: no internals to the client
            return Problem(502, "the model server failed on this request", {"Retry-After": "1"})
        return Problem(status if status in TITLES else 400, str(msg or "the model server refused the request")[:500])

    async def _once(path: str, out: dict, subject: Subject, headers: dict):
        with inflight.track(subject) as ended:
            call = asyncio.ensure_future(http.post(path, json=out))
            stop = asyncio.ensure_future(ended.wait())
            try:
                await asyncio.wait({call, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if not call.done():  # erased meanwhile: closing the connection makes vLLM abort the request
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await call
                raise Problem(410, ERASED)
            try:
                r = call.result()
            except httpx.HTTPError:
                raise Problem(502, "the model server is unreachable", {"Retry-After": "1"}) from None
        if r.status_code != 200:
            raise _upstream_error(r.status_code, r.content)
        return JSONResponse(_clean(r.json()), headers=headers)

    async def _stream(path: str, out: dict, subject: Subject, headers: dict):
        cm = inflight.track(subject)
        ended = cm.__enter__()
        try:
            resp = await http.send(http.build_request("POST", path, json=out), stream=True)
        except httpx.HTTPError:
            cm.__exit__(None, None, None)
            raise Problem(502, "the model server is unreachable", {"Retry-After": "1"}) from None
        if resp.status_code != 200:
            raw = await resp.aread()
            await resp.aclose()
            cm.__exit__(None, None, None)
            raise _upstream_error(resp.status_code, raw)

        async def relay():
            # vLLM's lines come through a bounded queue that an erasure can also end: a reader
            # task per request, not a task and a wait per line (one line per token)
            queue: asyncio.Queue = asyncio.Queue(maxsize=64)

            async def read():
                try:
                    async for line in resp.aiter_lines():
                        await queue.put(line)
                    await queue.put(_END)
                except httpx.HTTPError:
                    await queue.put(_FAILED)

            async def watch():
                await ended.wait()
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(_END)  # a full queue is read on, and the relay sees `ended` next

            tasks = (asyncio.ensure_future(read()), asyncio.ensure_future(watch()))
            try:
                while True:
                    line = await queue.get()
                    if ended.is_set():
                        yield "data: " + json.dumps({"error": {"message": ERASED, "type": TITLES[410],
                                                               "code": 410}}) + "\n\n"
                        return
                    if line is _END:
                        return
                    if line is _FAILED:
                        yield "data: " + json.dumps({"error": {"message": "the model server failed mid-stream",
                                                               "type": TITLES[500], "code": 502}}) + "\n\n"
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        if line:
                            yield line + "\n\n"
                        continue
                    try:
                        chunk = json.loads(line[6:])
                    except ValueError:
                        continue
                    yield "data: " + json.dumps(_clean(chunk)) + "\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await tasks[0]
                await resp.aclose()  # vLLM aborts a request whose client went away
                cm.__exit__(None, None, None)

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers=headers | {"Cache-Control": "no-store"})

    openai_routes(app, authenticate, model_name, complete)
    return app
