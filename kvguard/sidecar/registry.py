"""Connected inference processes: liveness, their cache statistics, the subjects they
hold, and the commands (erasures) waiting for them.

A client is one start of a process: the id it chose and a random instance it draws
at start (`name/instance`). A process restarted under the same id, or two processes
sharing one, are distinct clients: each numbers its events from 0 without its events
being taken for another's resent ones, and each receives and acknowledges every erase
command itself.

A client id belongs to the ingest token that registered it while any process start
under it is live: another token naming it is refused (`ClientIdTaken`), so one
token cannot read another's erase commands, acknowledge them in its name or send
events as it. A client whose token is bound to tenants receives the erase commands
of those tenants only.

Everything here is memory only: raw subject ids reported by a process stay in
this process and are rebuilt from the clients' next reports after a restart.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import KVGuardError

LIVE_S = 30.0
FORGET_S = 20 * LIVE_S  # a client not seen for this long is dropped (a process restarted long ago)


class ClientIdTaken(KVGuardError):
    """Another ingest token holds this client id; each token's processes need ids of their own."""


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
    id: str  # name/instance
    name: str  # the client id the process chose
    token_id: str  # the ingest token that registered it
    tenants: frozenset[str] | None = None  # its token's tenants (keyed indexes); None: every tenant
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict[str, Any] = field(default_factory=dict)
    # open sessions: (tenant, user, session) -> wall-clock ms the process opened it
    sessions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    pending: list[Command] = field(default_factory=list)
    wake: asyncio.Event | None = None
    last_event_no: int = -1  # every event numbered up to this is recorded; resent ones are dropped
    # last_event_no was read back from the store in this run, and no batch failed since
    numbered: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one batch of a client at a time


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

    def touch(self, name: str, instance: str, token_id: str, tenants: frozenset[str] | None = None) -> Client:
        key = self._check(name, instance, token_id)
        c = self.clients.get(key)
        if c is None:
            now = time.monotonic()
            self.clients = {k: o for k, o in self.clients.items() if now - o.last_seen < FORGET_S}
            c = self.clients[key] = Client(key, name, token_id)
        c.last_seen = time.monotonic()
        c.tenants = tenants  # as the token says now (one token, one binding)
        return c

    def _check(self, name: str, instance: str, token_id: str) -> str:
        """The client's key, once sure that no other token holds the id (raises ClientIdTaken)."""
        key, now = f"{name}/{instance}", time.monotonic()
        for k, o in self.clients.items():
            if o.token_id != token_id and (k == key or o.name == name and now - o.last_seen < LIVE_S):
                raise ClientIdTaken(f"client id {name!r} is in use by another ingest token; "
                                    "give each token's processes client ids of their own")
        return key

    def leave(self, name: str, instance: str, token_id: str) -> bool:
        """A process that closed cleanly said goodbye: it is no longer live, so erasures
        neither send it commands nor wait for its acknowledgement. Its command poll, if one
        waits, returns at once (empty)."""
        c = self.clients.pop(self._check(name, instance, token_id), None)
        if c is not None and c.wake is not None:
            c.wake.set()
        return c is not None

    def live(self) -> list[Client]:
        """Processes seen within the liveness window, or waiting for commands right now."""
        now = time.monotonic()
        return [c for c in self.clients.values() if now - c.last_seen < self.live_s or c.wake is not None]

    # --- commands -------------------------------------------------------------------------------

    def broadcast(self, scope: str, tenant: str, target: str,
                  tenant_index: str | None = None) -> tuple[Command, list[str]]:
        """Send an erase command to every live process that may hold the tenant's data (all
        but those whose token is bound to other tenants); returns it and who must answer."""
        cmd = Command(uuid.uuid4().hex, "erase", scope, tenant, target)
        targets = []
        for c in self.live():
            if c.tenants is not None and tenant_index not in c.tenants:
                continue
            c.pending.append(cmd)
            targets.append(c.id)
            if c.wake is not None:
                c.wake.set()
        return cmd, targets

    async def wait_acks(self, cmd: Command, targets: list[str], timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        # a target that left (goodbye) will not answer: stop waiting; the attempt is retried without it
        while any(t not in cmd.acks and t in self.clients for t in targets) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return dict(cmd.acks)

    def ack(self, name: str, instance: str, token_id: str, command_id: str, result: dict) -> bool:
        c = self.clients.get(self._check(name, instance, token_id))
        if c is None:
            return False
        for cmd in list(c.pending):
            if cmd.id == command_id:
                cmd.acks[c.id] = result
                c.pending.remove(cmd)
                return True
        return False

    async def take_commands(self, name: str, instance: str, token_id: str, wait_s: float,
                            tenants: frozenset[str] | None = None) -> list[dict]:
        c = self.touch(name, instance, token_id, tenants)
        if not c.pending and wait_s > 0:
            c.wake = asyncio.Event()
            try:  # asyncio.timeout: Python 3.11's wait_for swallows a cancel that comes as the wait ends
                async with asyncio.timeout(wait_s):
                    await c.wake.wait()
            except TimeoutError:
                pass
            finally:
                c.wake = None
            c.last_seen = time.monotonic()
        return [cmd.wire() for cmd in c.pending]
