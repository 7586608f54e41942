"""Retention: sessions held longer than the policy allows are erased automatically
(PIPL Art. 47: the retention period has expired), each as its own request and
its own signed erase record."""

from __future__ import annotations

import asyncio
import time

from .erasure import ErasureService, NewRequest
from .logs import log
from .service import Sidecar

PRINCIPAL = "retention"


def expired_sessions(sidecar: Sidecar, now_ms: int) -> set[tuple[str, str, str]]:
    limit_ms = sidecar.settings.retention_max_age_s * 1000
    return {key for c in sidecar.registry.live() for key, opened in c.sessions.items() if now_ms - opened > limit_ms}


def sweep(sidecar: Sidecar, service: ErasureService) -> int:
    n = 0
    for tenant, _user, session in expired_sessions(sidecar, time.time_ns() // 1_000_000):
        _, new = service.create(NewRequest(tenant, None, session, "pipl-art47", "retention period expired"),
                                f"retention:{tenant}\x00{session}", PRINCIPAL)
        n += new
    if n:
        log.info("retention erasures requested", count=n)
    return n


async def retention_loop(sidecar: Sidecar, service: ErasureService) -> None:
    while True:
        await asyncio.sleep(sidecar.settings.retention_check_s)
        try:
            await asyncio.to_thread(sweep, sidecar, service)
        except Exception:  # noqa: BLE001 - log and try again next round
            log.exception("retention sweep failed")
