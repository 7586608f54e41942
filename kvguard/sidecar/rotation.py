"""The sidecar's scheduled audit work: the key-encryption key's rotation (audit.keyring),
checked every minute, or four times a period when that is shorter, so a KEK lives at most a
little longer than kek_rotation_s; and the writer's check of the store it relies on
(audit.state), every audit_state_check_s."""

from __future__ import annotations

import asyncio

from kvguard.audit.errors import TamperedLogError

from . import outage
from .logs import log
from .service import Sidecar


def check_interval_s(period_s: float) -> float:
    return min(60.0, period_s / 4)


async def kek_rotation_loop(sidecar: Sidecar) -> None:
    while True:
        await asyncio.sleep(check_interval_s(sidecar.settings.kek_rotation_s))
        try:
            await asyncio.to_thread(sidecar.rotate_kek_if_due)
        except Exception as exc:  # noqa: BLE001 - log and try again next round
            if outage.is_outage(exc):
                outage.note("key-encryption key rotation", exc)
            else:
                log.exception("key-encryption key rotation failed")


async def audit_state_loop(sidecar: Sidecar) -> None:
    while True:
        await asyncio.sleep(sidecar.settings.audit_state_check_s)
        if sidecar.log.halted is not None:
            return  # halted for good: /readyz and the metric say why
        try:
            await asyncio.to_thread(sidecar.check_audit_state)
        except TamperedLogError:
            return  # the writer halted and logged it (Sidecar._halted)
        except Exception as exc:  # noqa: BLE001 - log and try again next round
            if outage.is_outage(exc):
                outage.note("audit state check", exc)
            else:
                log.exception("audit state check failed")
