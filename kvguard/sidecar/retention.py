"""Retention: sessions held longer than the policy allows are erased automatically
(PIPL Art. 47: the retention period has expired), each as its own request and
its own signed erase record."""

from __future__ import annotations

import asyncio
import time

from kvguard.audit.pseudonym import subject_data

from . import outage
from .erasure import ErasureService, NewRequest
from .logs import log
from .service import Sidecar

PRINCIPAL = "retention"


def expired_sessions(sidecar: Sidecar, now_ms: int) -> dict[tuple[str, str], int]:
    """(tenant, session) -> when the session was opened (the earliest, if several processes
    hold it), for the sessions held past the retention limit."""
    limit_ms = sidecar.settings.retention_max_age_s * 1000
    out: dict[tuple[str, str], int] = {}
    for c in sidecar.registry.live():
        for (tenant, _user, session), opened in c.sessions.items():
            if now_ms - opened > limit_ms:
                out[(tenant, session)] = min(opened, out.get((tenant, session), opened))
    return out


def sweep(sidecar: Sidecar, service: ErasureService) -> int:
    n = 0
    for (tenant, session), opened in expired_sessions(sidecar, time.time_ns() // 1_000_000).items():
        # One request per time the session expires: a session id opened again later expires
        # again, and gets its own request. A failed one is replaced while the session is held.
        # The key names the session by its keyed index, not its raw ids: the request keeps only a
        # hash of the key, which a guess of short ids must not be able to reproduce.
        index = sidecar.pseudonyms.index(subject_data("session", session, tenant)).hex()
        _, new = service.create(NewRequest(tenant, None, session, "pipl-art47", "retention period expired"),
                                f"retention:{index}\x00{opened}", PRINCIPAL, renew_failed=True)
        n += new
    if n:
        log.info("retention erasures requested", count=n)
    return n


async def retention_loop(sidecar: Sidecar, service: ErasureService) -> None:
    while True:
        await asyncio.sleep(sidecar.settings.retention_check_s)
        try:
            await asyncio.to_thread(sweep, sidecar, service)
        except Exception as exc:  # noqa: BLE001 - log and try again next round
            if outage.is_outage(exc):
                outage.note("retention sweep", exc)
            else:
                log.exception("retention sweep failed")
