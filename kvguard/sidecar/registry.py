"""Connected inference processes: liveness, their cache statistics, the subjects they
hold, and the commands (erasures) waiting for them.

Everything here is memory only: raw subject ids reported by a process stay in
this process and are rebuilt from the clients' next reports after a restart.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

LIVE_S = 30.0


@dataclass
class Command:
    id: str
    kind: str  # "erase"
    scope: str  # "user" | "session"
    tenant: str
    target: str  # the user or session id
    acks: dict[str, dict] = field(default_factory=dict)

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "scope": self.scope, "tenant": self.tenant, "target": self.target}


@dataclass
class Client:
    id: str
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict[str, Any] = field(default_factory=dict)
    # open sessions: (tenant, user, session) -> wall-clock ms the process opened it
    sessions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    pending: list[Command] = field(default_factory=list)
    wake: asyncio.Event | None = None
    last_event_no: int = -1  # highest event number recorded, to drop resent duplicates


class Registry:
    def __init__(self, live_s: float = LIVE_S) -> None:
        self.live_s = live_s  # a process counts as live this long after its last contact
        self.clients: dict[str, Client] = {}
        self._ack_waiters: dict[str, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = time.monotonic()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The API starts serving now: processes can reconnect from here on."""
        self.loop, self.started = loop, time.monotonic()

    def reconnect_wait_s(self) -> float:
        """Seconds until every process that was live before a (re)start has had one full
        liveness window to reconnect. Until then the registry cannot tell "no process
        holds data" from "the processes have not reconnected yet"."""
        return max(0.0, self.started + self.live_s - time.monotonic())

    def touch(self, client_id: str) -> Client:
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = Client(client_id)
        c.last_seen = time.monotonic()
        return c

    def live(self) -> list[Client]:
        """Processes seen within the liveness window, or waiting for commands right now."""
        now = time.monotonic()
        return [c for c in self.clients.values() if now - c.last_seen < self.live_s or c.wake is not None]

    # --- commands -------------------------------------------------------------------------------

    def broadcast(self, scope: str, tenant: str, target: str) -> tuple[Command, list[str]]:
        """Send an erase command to every live process; returns it and who must answer."""
        cmd = Command(uuid.uuid4().hex, "erase", scope, tenant, target)
        targets = []
        for c in self.live():
            c.pending.append(cmd)
            targets.append(c.id)
            if c.wake is not None:
                c.wake.set()
        return cmd, targets

    async def wait_acks(self, cmd: Command, targets: list[str], timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while set(targets) - set(cmd.acks) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return dict(cmd.acks)

    def ack(self, client_id: str, command_id: str, result: dict) -> bool:
        c = self.clients.get(client_id)
        if c is None:
            return False
        for cmd in list(c.pending):
            if cmd.id == command_id:
                cmd.acks[client_id] = result
                c.pending.remove(cmd)
                return True
        return False

    async def take_commands(self, client_id: str, wait_s: float) -> list[dict]:
        c = self.touch(client_id)
        if not c.pending and wait_s > 0:
            c.wake = asyncio.Event()
            try:
                await asyncio.wait_for(c.wake.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                c.wake = None
            self.touch(client_id)
        return [cmd.wire() for cmd in c.pending]
