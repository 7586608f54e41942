"""The key-encryption key's scheduled rotation (audit.keyring): checked every minute, or
four times a period when that is shorter, so a KEK lives at most a little longer than
kek_rotation_s."""

from __future__ import annotations

import asyncio

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
