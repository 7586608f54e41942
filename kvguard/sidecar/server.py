"""Runs the sidecar: the admin API on TCP, the ingest API on a Unix socket, the metrics
listener on TCP when `metrics_port` is set, one process.

One server per data directory: an exclusive lock on a file in it is taken before
anything else, so a second `kvguard serve` on the same directory exits with an
error instead of unlinking the live server's socket. Slow clients are cut: a
request's headers and body must arrive within `request_read_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import ConfigError
from .app import create_app
from .logs import configure, log
from .service import Sidecar
from .settings import Settings

MAX_HEADER_BYTES = 16 * 1024
_TIMEOUT_BODY = b'{"type":"about:blank","title":"Request Timeout","status":408,"detail":"the request was too slow"}'
_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/problem+json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))


class _Server(uvicorn.Server):
    """Signals are handled once for both servers, by `serve` below."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _TimedProtocol(H11Protocol):
    """h11 with a deadline on reading each request: uvicorn times out idle keep-alive
    connections only, so a client sending its headers or body a byte at a time would hold
    a connection (and its buffers) for as long as it liked."""

    read_timeout_s = 10.0
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the whole request is in (or the connection is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # answered without the rest of the body (401, 413): done
            return
        if self.cycle is not None:  # the app sees the client gone, and its answer goes nowhere
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(_TIMEOUT)
        self.transport.close()


def _protocol(settings: Settings) -> type[H11Protocol]:
    return type("TimedProtocol", (_TimedProtocol,), {"read_timeout_s": settings.request_read_timeout_s})


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
