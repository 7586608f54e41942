"""The FastAPI application: routes, problem+json errors, request ids, background loops."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import structlog
from fastapi import FastAPI, Request

from .. import __version__
from .api import audit as audit_routes
from .api import erasure as erasure_routes
from .api import health, ingest, problems
from .erasure import ErasureService
from .limits import BodyLimit
from .logs import log
from .retention import retention_loop
from .service import Sidecar


def create_app(sidecar: Sidecar) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        sidecar.registry.start(asyncio.get_running_loop())
        tasks = [asyncio.create_task(app.state.erasure.run_forever(), name="erasure")]
        if sidecar.settings.retention_max_age_s:
            tasks.append(asyncio.create_task(retention_loop(sidecar, app.state.erasure), name="retention"))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="kvguard sidecar", version=__version__, lifespan=lifespan,
                  description="Admin API of kvguard: erasure requests with signed receipts, audit records, "
                              "checkpoints and proofs. Authenticate with 'Authorization: Bearer <token>'.")
    app.state.sidecar = sidecar
    app.state.erasure = ErasureService(sidecar)
    problems.install(app)
    for r in (health.router, erasure_routes.router, audit_routes.router, ingest.router):
        app.include_router(r)

    app.add_middleware(BodyLimit, sidecar=sidecar)  # inside request_id below: its answers carry the id

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = request.headers.get("x-request-id", "")
        if not (0 < len(rid) <= 64 and rid.replace("-", "").isalnum()):
            rid = uuid.uuid4().hex
        request.state.request_id = rid
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            response = await call_next(request)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
        response.headers["X-Request-ID"] = rid
        if request.url.path == "/internal/v1/events" and response.status_code >= 400:
            sidecar.metrics.batches_refused.labels(str(response.status_code)).inc()
        if request.url.path != "/healthz":
            log.info("request", method=request.method, path=request.url.path, status=response.status_code,
                     request_id=rid)
        return response

    return app
