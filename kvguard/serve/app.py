"""The OpenAI-compatible HTTP API over the engine: /v1/chat/completions, /v1/completions,
/v1/models, /healthz, /readyz, /metrics (errors, keys, subjects and bodies: front.py).

A client that disconnects has its sequence freed at the next step, and is no error. The chat
template and the tokenizer run on a few threads of their own, never on the event loop, and a
prompt longer than the context could hold is refused before it is tokenized. /metrics is the
operators': it takes a token that the sidecar's /metrics takes (audit:read or admin), not an
API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..client import SidecarUnavailable
from ..errors import InputError
from .engine import Engine
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
from .scheduler import PoolFull, SamplingParams
from .scheduler import Request as EngineRequest

log = structlog.get_logger("kvguard.serve")
METRICS_SCOPE = "audit:read"  # what the sidecar's own /metrics asks for; admin implies it
PROMPT_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # a CPU left to the event loop
QUEUE_BODIES = 32  # bytes of bodies and prompts waiting for the prompt threads, in largest bodies; past it 503
INLINE_PARSE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (a hop costs more)


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

    app = new_app("kvguard serve-llm", lifespan, log, "OpenAI-compatible inference over kvguard's KV cache. "
                  "Authenticate with 'Authorization: Bearer <key>' (kvguard token create --scope infer).")
    metrics = Metrics()
    app.state.engine, app.state.metrics = engine, metrics
    # no prompt of more characters than this fits the context, whatever its tokens
    per_token = longest_token_chars(engine.tokenizer)
    max_prompt_chars = None if per_token is None else engine.max_model_len * per_token
    authenticate = bearer(keys)

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
        body = await read_body(request, max_body_bytes)
        if len(body) > INLINE_PARSE_BYTES:  # parsing a large body takes milliseconds: not on the event loop
            data = await off_loop(len(body), parse, schema, body)
        else:
            data = parse(schema, body)
        subject = subject_of(request, key, data, model_name, default_user)
        prompt = await tokenize(data, kind)
        max_tokens = data.limit()
        if max_tokens is None:  # what is left of the context, within the default
            max_tokens = max(1, min(default_max_tokens, engine.max_model_len - len(prompt)))
        params = SamplingParams(max_tokens=max_tokens, temperature=data.temperature, top_p=data.top_p,
                                seed=data.seed, stop=data.stops())
        req = EngineRequest(uuid.uuid4().hex, subject, prompt, params,
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
            raise Problem(503, UNAUDITED, {"Retry-After": "5"}) from None
        headers = {"X-KVGuard-Policy": policy_name, "X-Session-ID": subject.session}
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

    openai_routes(app, authenticate, model_name, complete)
    return app


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
