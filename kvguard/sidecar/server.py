"""Runs the sidecar: the admin API on TCP, the ingest API on a Unix socket, the metrics
listener on TCP when `metrics_port` is set, one process.

One server per data directory: an exclusive lock on a file in it is taken before
anything else, so a second `kvguard serve` on the same directory exits with an
error instead of unlinking the live server's socket. Slow clients are cut: a
request's headers and body must arrive within `request_read_timeout_s` (kvguard/connections.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..connections import MAX_HEADER_BYTES, protocol
from ..errors import ConfigError
from .app import create_app
from .logs import configure, log
from .service import Sidecar
from .settings import Settings


class _Server(uvicorn.Server):
    """Signals are handled once for both servers, by `serve` below."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _protocol(settings: Settings) -> type[H11Protocol]:
    return protocol(settings.request_read_timeout_s)


# Prometheus and the kubelet need a few connections; whoever else reaches the pod's IP gets 503 past this
METRICS_MAX_CONNECTIONS = 32


def _config(settings: Settings, app, *, max_connections: int | None = None, **where) -> uvicorn.Config:
    return uvicorn.Config(app, log_config=None, access_log=False, server_header=False, http=_protocol(settings),
                          timeout_keep_alive=settings.keep_alive_s,
                          limit_concurrency=max_connections or settings.max_connections,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **where)


def lock_data_dir(settings: Settings) -> list[int]:
    """Take the data directory (and the socket's directory, when elsewhere) for this process,
    or raise ConfigError naming the directory another server holds. The locks last as long
    as the returned descriptors stay open, and end with the process however it ends."""
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = [settings.data_dir / "serve.lock"]
    sock = settings.socket_path
    if sock.parent.resolve() != settings.data_dir.resolve():
        paths.append(sock.with_name(sock.name + ".lock"))
    fds = []
    for path in paths:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            for other in fds:
                os.close(other)
            raise ConfigError(f"another kvguard serve is running on {path.parent} (it holds {path.name}); "
                              "stop it first, or give this one a data directory of its own") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        fds.append(fd)
    return fds


def _socket_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


async def _serve(settings: Settings) -> None:
    locks = lock_data_dir(settings)  # before the socket is touched, or the database opened
    try:
        sidecar = Sidecar(settings)
    except BaseException:
        for fd in locks:  # a caller that goes on (tests, an embedding) may start again
            os.close(fd)
        raise
    app = create_app(sidecar)
    servers = [_Server(_config(settings, app, host=settings.host, port=settings.port))]
    sock = settings.socket_path
    if sock:
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        servers.append(_Server(_config(settings, app.state.ingest_app, uds=str(sock), lifespan="off")))
    if settings.metrics_port is not None:
        servers.append(_Server(_config(settings, app.state.metrics_app, host=settings.metrics_host,
                                       port=settings.metrics_port, lifespan="off",
                                       max_connections=min(METRICS_MAX_CONNECTIONS, settings.max_connections))))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: [setattr(s, "should_exit", True) for s in servers])
    metrics = f"http://{settings.metrics_host}:{settings.metrics_port}" if settings.metrics_port else None
    log.info("serving", admin=f"http://{settings.host}:{settings.port}", ingest_socket=str(sock), metrics=metrics)
    try:
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        if sock:
            while not servers[1].started and not tasks[1].done():
                await asyncio.sleep(0.01)
            if sock.exists():
                os.chmod(sock, 0o660)  # the pod's shared volume: owner and group only
                sidecar.socket_bound(sock, _socket_id(sock))
        await asyncio.gather(*tasks)
    finally:
        sidecar.close()
        for fd in locks:
            os.close(fd)
        log.info("stopped")


def serve(settings: Settings) -> int:
    configure(settings.log_format, settings.log_level)
    asyncio.run(_serve(settings))
    return 0
