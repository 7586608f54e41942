"""Liveness, readiness and metrics. /healthz and /readyz are open for the kubelet's
probes and reveal nothing; /metrics needs a token with audit:read."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from .deps import AuditRead, SidecarDep
from .problems import documented, problem_response

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is alive")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Database reachable, signing key loaded, migrations current, KEK present",
            responses=documented(503))
def readyz(sidecar: SidecarDep, request: Request):
    checks = sidecar.readiness()
    if all(v == "ok" for v in checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    return problem_response(503, "Service Unavailable", "not ready", request, checks=checks)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses=documented(401, 403, 503))
def metrics(sidecar: SidecarDep, _: AuditRead) -> Response:
    return Response(sidecar.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
