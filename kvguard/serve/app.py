"""The OpenAI-compatible HTTP API over the engine: /v1/chat/completions, /v1/completions,
/v1/models, /healthz, /readyz, /metrics.

Every error is problem+json (RFC 9457); nothing a client sends makes a 500. The API key
names the tenant (no header can change it), the OpenAI `user` field the end user, the
`X-Session-ID` header the session (else one per request). Bodies are bounded; a client that
disconnects has its sequence freed at the next step, and is no error. The chat template and
the tokenizer run on a few threads of their own, never on the event loop, and a prompt longer
than the context could hold is refused before it is tokenized. /metrics is the operators':
it takes a token that the sidecar's /metrics takes (audit:read or admin), not an API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..client import SidecarUnavailable
from ..errors import InputError
from ..request_ids import with_request_id
from ..types import Subject
from .engine import Engine
from .keys import Key, KeyChecker, KeyError_
from .protocol import ChatRequest, CompletionRequest
from .scheduler import PoolFull, SamplingParams
from .scheduler import Request as EngineRequest

log = structlog.get_logger("kvguard.serve")
SESSION = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
TITLES = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
          408: "Request Timeout", 410: "Gone", 413: "Content Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Content",
          429: "Too Many Requests", 499: "Client Closed Request", 500: "Internal Server Error",
          503: "Service Unavailable"}
METRICS_SCOPE = "audit:read"  # what the sidecar's own /metrics asks for; admin implies it
PROMPT_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # a CPU left to the event loop
QUEUE_BODIES = 32  # bytes of bodies and prompts waiting for the prompt threads, in largest bodies; past it 503
INLINE_PARSE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (a hop costs more)


class Problem(Exception):
    def __init__(self, status: int, detail: str, headers: dict | None = None, **extra):
        super().__init__(detail)
        self.status, self.detail, self.headers, self.extra = status, detail, headers or {}, extra


def problem(status: int, detail: str, headers: dict | None = None, **extra) -> JSONResponse:
    body = {"type": "about:blank", "title": TITLES.get(status, "Error"), "status": status, "detail": detail,
            # the shape the openai client reads an error's message from
            "error": {"message": detail, "type": TITLES.get(status, "error"), "code": status}} | extra
    return JSONResponse(body, status_code=status, headers=headers, media_type="application/problem+json")


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvguard_llm_requests", "Completion requests by route and status",
                                ["route", "status"], registry=r)
        self.tokens = Gauge("kvguard_llm_output_tokens", "Output tokens generated since start", registry=r)
        self.prefill = Gauge("kvguard_llm_prefill_tokens", "Prompt tokens prefilled since start", registry=r)
        self.running = Gauge("kvguard_llm_running", "Requests decoding", registry=r)
        self.waiting = Gauge("kvguard_llm_waiting", "Requests waiting for their prefill", registry=r)
        self.pages = Gauge("kvguard_llm_pages_used", "KV pages in use per pool", ["pool"], registry=r)
        self.ttft = Histogram("kvguard_llm_ttft_seconds", "Time to first token", registry=r)


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token of the tokenizer can stand for (its longest vocabulary
    entry: a byte-level or SentencePiece entry has a character per byte or character it
    covers), or None when the tokenizer does not list its vocabulary."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    return max(map(len, vocab), default=0) or None


def create_app(engine: Engine, keys: KeyChecker, *, model_name: str, policy_name: str,
               default_user: str | None = None, max_body_bytes: int = 1 << 20, client=None,
               default_max_tokens: int = 1024) -> FastAPI:
    # large bodies are parsed, and prompts templated and tokenized, on threads of their own
    prompt_threads = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="kvguard-prompt")
    queued, most_queued = 0, QUEUE_BODIES * max_body_bytes  # bytes (characters) handed to them, not done

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        try:
            yield
        finally:
            prompt_threads.shutdown(wait=False, cancel_futures=True)
            await keys.aclose()

    # redirect_slashes off: a trailing slash is a 404, not a 307 to a Location built from the Host header
    app = FastAPI(title="kvguard serve-llm", lifespan=lifespan, description="OpenAI-compatible inference over kvguard's KV cache. "
                  "Authenticate with 'Authorization: Bearer <key>' (kvguard token create --scope infer).",
                  openapi_url=None, docs_url=None, redoc_url=None, redirect_slashes=False)
    metrics = Metrics()
    app.state.engine, app.state.metrics = engine, metrics
    # no prompt of more characters than this fits the context, whatever its tokens
    per_token = longest_token_chars(engine.tokenizer)
    max_prompt_chars = None if per_token is None else engine.max_model_len * per_token

    @app.exception_handler(Problem)
    async def _problem(_, exc: Problem):
        return problem(exc.status, exc.detail, exc.headers, **exc.extra)

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):
        return problem(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return problem(422, "the request is invalid", errors=_errors(exc.errors()))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_, exc: ClientDisconnect):  # a client going away is no error: the answer goes nowhere
        return problem(499, "the client disconnected")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        # this handler runs outside the request-id middleware: name the request here
        log.error("unhandled error", error=type(exc).__name__,
                  request_id=getattr(request.state, "request_id", None))
        return problem(500, "the server failed; the error is logged")

    @app.middleware("http")
    async def _request_id(request: Request, call_next):
        response, rid = await with_request_id(request, call_next)
        if request.url.path not in ("/healthz", "/readyz"):
            log.info("request", method=request.method, path=request.url.path, status=response.status_code,
                     request_id=rid)
        return response

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

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        ready = engine._thread.is_alive() and (client is None or client.connected)
        if not ready:
            return problem(503, "not ready: the engine is not running or the audit sidecar has not confirmed "
                                "events", {"Retry-After": "5"})
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics_route(request: Request):
        await authenticate(request, METRICS_SCOPE)
        metrics.tokens.set(engine.tokens_out)
        metrics.prefill.set(engine.prefill_tokens)
        metrics.running.set(len(engine.scheduler.running))
        metrics.waiting.set(len(engine.scheduler.waiting))
        for pool, p in engine.manager.pools.items():
            metrics.pages.labels(pool).set(p.used_count)
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

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

    async def complete(request: Request, schema, kind: str):
        route = request.url.path
        try:
            response = await _complete(request, schema, kind)
        except Problem as p:
            metrics.requests.labels(route, str(p.status)).inc()
            raise
        metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    async def _complete(request: Request, schema, kind: str):
        key = await authenticate(request)
        body = await _read_body(request, max_body_bytes)
        if len(body) > INLINE_PARSE_BYTES:  # parsing a large body takes milliseconds: not on the event loop
            data = await off_loop(len(body), _parse, schema, body)
        else:
            data = _parse(schema, body)
        if data.model != model_name:
            raise Problem(404, f"no model {data.model!r} here; GET /v1/models lists it")
        user = data.user or default_user
        if user is None:
            raise Problem(400, "name the end user in the 'user' field: their cache pages and audit records are "
                               "kept under it, and an erasure finds them by it")
        session = request.headers.get("x-session-id") or uuid.uuid4().hex
        if not SESSION.match(session):
            raise Problem(400, "X-Session-ID must be 1 to 128 letters, digits or . _ : -")
        prompt = await tokenize(data, kind)
        max_tokens = data.limit()
        if max_tokens is None:  # what is left of the context, within the default
            max_tokens = max(1, min(default_max_tokens, engine.max_model_len - len(prompt)))
        params = SamplingParams(max_tokens=max_tokens, temperature=data.temperature, top_p=data.top_p,
                                seed=data.seed, stop=data.stops())
        req = EngineRequest(uuid.uuid4().hex, Subject(key.tenant, user, session), prompt, params,
                            asyncio.get_running_loop(), asyncio.Queue(),
                            request_id=getattr(request.state, "request_id", None))
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(engine.submit, req)
        except InputError as e:
            raise Problem(400, str(e)) from None
        except PoolFull as e:
            raise Problem(429, f"{e}; running requests finish first, retry later", {"Retry-After": "1"}) from None
        except SidecarUnavailable:
            raise Problem(503, "the audit sidecar has not recorded recent events; no request runs unaudited, "
                               "retry later", {"Retry-After": "5"}) from None
        headers = {"X-KVGuard-Policy": policy_name, "X-Session-ID": session}
        created = int(time.time())
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        rid = prefix + req.id
        if data.stream:
            usage = bool(data.stream_options and data.stream_options.include_usage)
            return StreamingResponse(_sse(req, rid, created, kind, usage, t0), media_type="text/event-stream",
                                     headers=headers | {"Cache-Control": "no-store"})
        return await _collect(request, req, rid, created, kind, headers, t0)

    async def off_loop(size: int, fn, *args):
        """fn(*args) on the prompt threads (a long prompt holds one of them, never the event loop);
        503 when more than QUEUE_BODIES largest bodies' worth of work (`size`: bytes or
        characters) waits for them."""
        nonlocal queued
        if queued + size > most_queued:
            raise Problem(503, "too many prompts are waiting to be read; retry later", {"Retry-After": "1"})
        queued += size
        try:
            return await asyncio.get_running_loop().run_in_executor(prompt_threads, fn, *args)
        finally:
            queued -= size

    async def tokenize(data, kind: str) -> list[int]:
        """The prompt's token ids, made off the event loop; 400 for a prompt the context could
        never hold, found before tokenizing it where its length in characters tells."""
        chars = sum(len(m.text()) for m in data.messages) if kind == "chat" else len(data.prompt)
        if max_prompt_chars is not None and chars > max_prompt_chars:
            raise Problem(400, f"the prompt is longer than the context limit of {engine.max_model_len} tokens "
                               "could hold: shorten it")
        return await off_loop(chars, _prompt_ids, engine.tokenizer, data, kind)

    def _choice(kind: str, text: str | None, finish: str | None, *, chunk: bool) -> dict:
        if kind == "text":
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if chunk:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish,
                    "logprobs": None}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": None}

    def _usage(u: dict) -> dict:
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"], "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    async def _collect(request: Request, req: EngineRequest, rid: str, created: int, kind: str, headers: dict,
                       t0: float):
        async def result():
            parts = []
            while True:
                item = await req.queue.get()
                if item[0] == "text":
                    if not parts:
                        metrics.ttft.observe(time.perf_counter() - t0)
                    parts.append(item[1])
                elif item[0] == "done":
                    return "".join(parts), item[1], item[2]
                else:
                    return item

        waiter = asyncio.ensure_future(result())
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            engine.cancel(req, "the client disconnected")
            waiter.cancel()
            return Response(status_code=499)
        gone.cancel()
        out = waiter.result()
        if out[0] == "error":
            raise Problem(out[1], out[2], headers)
        text, finish, usage = out
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": [_choice(kind, text, finish, chunk=False)], "usage": _usage(usage)},
                            headers=headers)

    async def _sse(req: EngineRequest, rid: str, created: int, kind: str, include_usage: bool, t0: float):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def event(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                          "choices": choices} | extra) + "\n\n"

        try:
            if kind == "chat":
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}])
            first = True
            while True:
                item = await req.queue.get()
                if item[0] == "text":
                    if first:
                        metrics.ttft.observe(time.perf_counter() - t0)
                        first = False
                    yield event([_choice(kind, item[1], None, chunk=True)])
                elif item[0] == "done":
                    yield event([_choice(kind, None if kind == "chat" else "", item[1], chunk=True)])
                    if include_usage:
                        yield event([], usage=_usage(item[2]))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    status, detail = item[1], item[2]
                    yield "data: " + json.dumps({"error": {"message": detail, "type": TITLES.get(status, "error"),
                                                           "code": status}}) + "\n\n"
                    return
        finally:
            if not req.finished:  # the client left mid-stream: free its sequence now
                engine.cancel(req, "the client disconnected")

    return app


def _parse(schema, body: bytes):
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors()
        if any(err["type"] == "json_invalid" for err in errors):
            raise Problem(400, "the body is not valid JSON") from None
        raise Problem(422, "the request is invalid", errors=_errors(errors)) from None


def _prompt_ids(tok, data, kind: str) -> list[int]:
    if kind == "text":
        return tok(data.prompt).input_ids
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in data.messages]
    if not getattr(tok, "chat_template", None):
        raise Problem(400, "this model has no chat template (a base model, such as gemma3): send the text to "
                           "/v1/completions")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses these messages (jinja raise_exception)
        raise Problem(400, "the model's chat template refuses these messages (their roles or order)") from None
    return tok(text, add_special_tokens=False).input_ids


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _read_body(request: Request, limit: int) -> bytes:
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


def _errors(errors: list[dict[str, Any]]) -> list[dict]:
    """Validation errors without the values sent: they may hold prompt text."""
    return [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in errors[:20]]
