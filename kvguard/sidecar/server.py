"""Runs the sidecar: the admin API on TCP, the ingest API on a Unix socket, one process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import uvicorn

from .app import create_app
from .logs import configure, log
from .service import Sidecar
from .settings import Settings


class _Server(uvicorn.Server):
    """Signals are handled once for both servers, by `serve` below."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _serve(settings: Settings) -> None:
    sidecar = Sidecar(settings)
    app = create_app(sidecar)
    servers = [_Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                                      access_log=False, server_header=False))]
    sock = settings.socket_path
    if sock:
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        servers.append(_Server(uvicorn.Config(app.state.ingest_app, uds=str(sock), lifespan="off", log_config=None,
                                              access_log=False, server_header=False)))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: [setattr(s, "should_exit", True) for s in servers])
    log.info("serving", admin=f"http://{settings.host}:{settings.port}", ingest_socket=str(sock))
    try:
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        if sock:
            while not servers[1].started and not tasks[1].done():
                await asyncio.sleep(0.01)
            if sock.exists():
                os.chmod(sock, 0o660)  # the pod's shared volume: owner and group only
        await asyncio.gather(*tasks)
    finally:
        sidecar.close()
        log.info("stopped")


def serve(settings: Settings) -> int:
    configure(settings.log_format, settings.log_level)
    asyncio.run(_serve(settings))
    return 0
