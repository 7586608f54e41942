"""The FastAPI applications: routes, problem+json errors, request ids, background loops.

Three applications share one sidecar: the admin API (health, erasure, audit, metrics),
served on TCP, the ingest API of the inference processes, served on the Unix socket
only, and, when `metrics_port` is set, the metrics listener (health, readiness and
metrics without a token, nothing else). None serves another's routes. The OpenAPI
schema is served at /openapi.json to a token with the admin scope; there are no /docs
or /redoc pages.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from .. import __version__
from ..request_ids import RequestIds
from .api import audit as audit_routes
from .api import erasure as erasure_routes
from .api import health, ingest, keys, problems
from .api.deps import Admin
from .erasure import ErasureService
from .limits import BodyLimit
from .logs import log
from .retention import retention_loop
from .rotation import audit_state_loop, kek_rotation_loop
from .service import Sidecar

AUTH = "Authenticate with 'Authorization: Bearer <token>' (kvguard token create)."


def create_app(sidecar: Sidecar) -> FastAPI:
    """The admin API; its `state.ingest_app` is the ingest API, for the Unix socket."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        sidecar.registry.start(asyncio.get_running_loop())
        tasks = [asyncio.create_task(app.state.erasure.run_forever(), name="erasure"),
                 asyncio.create_task(kek_rotation_loop(sidecar), name="kek-rotation"),
                 asyncio.create_task(audit_state_loop(sidecar), name="audit-state"),
                 asyncio.create_task(app.state.erasure.heartbeat_forever(), name="fleet-heartbeat")]
        if sidecar.settings.retention_max_age_s:
            tasks.append(asyncio.create_task(retention_loop(sidecar, app.state.erasure), name="retention"))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    app = _app(sidecar, "kvguard sidecar", "Admin API of kvguard: erasure requests with signed receipts, "
               "audit records, checkpoints and proofs. " + AUTH, lifespan=lifespan)
    for r in (health.router, erasure_routes.router, audit_routes.router, keys.router):
        app.include_router(r)
    app.state.erasure = ErasureService(sidecar)
    app.state.ingest_app = _app(sidecar, "kvguard sidecar ingest", "The inference processes' API, on the "
                                "sidecar's Unix socket: event batches in, erase commands out. " + AUTH)
    app.state.ingest_app.include_router(ingest.router)
    app.state.metrics_app = metrics_app(sidecar)
    return app


def metrics_app(sidecar: Sidecar) -> FastAPI:
    """The metrics listener: GET routes only (anything else is 404 or 405, no body read), no
    schema, no request log (the probes would fill it)."""
    app = FastAPI(title="kvguard sidecar metrics", version=__version__, openapi_url=None, docs_url=None,
                  redoc_url=None, redirect_slashes=False)
    app.state.sidecar = sidecar
    problems.install(app)
    app.include_router(health.open_router)
    return app


def _app(sidecar: Sidecar, title: str, description: str, lifespan=None) -> FastAPI:
    # redirect_slashes off: a trailing slash is a 404, not a 307 to a Location built from the Host header
    app = FastAPI(title=title, version=__version__, description=description, lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.sidecar = sidecar
    problems.install(app)
    problems.with_problem_schema(app)

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_: Admin) -> dict:
        return app.openapi()

    app.add_middleware(BodyLimit, sidecar=sidecar)  # inside request_id below: its answers carry the id

    def count_refused(path: str, status: int) -> None:
        if path == "/internal/v1/events" and status >= 400:
            sidecar.metrics.batches_refused.labels(str(status)).inc()

    app.add_middleware(RequestIds, log=log, quiet=("/healthz",), on_status=count_refused)

    return app
