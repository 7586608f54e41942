"""Liveness, readiness and metrics.

On the admin API (loopback), /healthz and /readyz are open and /metrics needs a token with
audit:read. The metrics listener (`open_router`, on the pod's IP) serves all three without a
token for the kubelet's probes and Prometheus: its /readyz names the failing checks but not why
(an error text may name a host or a schema), and its /metrics is rendered at most once a second.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from .deps import AuditRead, SidecarDep
from .problems import documented, problem_response

router = APIRouter(tags=["health"])
open_router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is alive")
@open_router.get("/healthz", summary="The process is alive")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Database reachable, signing key loaded, migrations current, KEK present (and each "
            "witness's state, which does not fail readiness)",
            responses=documented(503))
def readyz(sidecar: SidecarDep, request: Request):
    checks = sidecar.readiness()
    detail = {"witnesses": w} if (w := sidecar.witness_status()) else {}  # informs, never fails readiness
    if (warning := sidecar.witness_warning()) is not None:
        detail["witness_warning"] = warning
    if all(v == "ok" for v in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks, **detail})
    return problem_response(503, "Service Unavailable", "not ready", request, checks=checks, **detail)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses=documented(401, 403, 503))
def metrics(sidecar: SidecarDep, _: AuditRead) -> Response:
    return Response(sidecar.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@open_router.get("/readyz", summary="Database reachable, signing key loaded, migrations current, KEK present",
                 responses=documented(503))
def open_readyz(sidecar: SidecarDep, request: Request):
    checks = {name: "ok" if v == "ok" else "failing" for name, v in sidecar.readiness().items()}
    if all(v == "ok" for v in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    return problem_response(503, "Service Unavailable", "not ready: the admin API's /readyz says why", request,
                            checks=checks)


@open_router.get("/metrics", summary="Prometheus metrics", response_class=Response, responses=documented(503))
def open_metrics(sidecar: SidecarDep) -> Response:
    return Response(sidecar.metrics.scrape(), media_type="text/plain; version=0.0.4; charset=utf-8")
