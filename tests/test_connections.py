"""The servers' connection bounds (kvguard/connections.py) on a small app: the oldest waiting
connection gives way to a new one, requests past the bound in flight get a problem+json 503,
and a request that stops half-way gets 408 within the read deadline."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect

from kvguard.connections import protocol
from tests.sidecar.conftest import free_port


def serve(app, **bounds) -> tuple[uvicorn.Server, int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=protocol(1.0, **bounds), server_header=False))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, port


def answer(s: socket.socket, wait_s: float = 5.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of the answer on a connection (0 when it closed without one)."""
    s.settimeout(wait_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep and b"content-length" in head.lower():
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                if len(body) >= length:
                    break
    except OSError:
        pass
    if not out:
        return 0, {}, b""
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_waiting_connections_and_requests_in_flight_are_bounded_apart():
    app = FastAPI()

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(1.5)
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request):
        try:
            return {"n": len(await request.body())}
        except ClientDisconnect:  # cut by the deadline: the answer goes nowhere
            return None

    server, port = serve(app, max_waiting=3, max_requests=2)
    where = ("127.0.0.1", port)
    try:
        idle = [socket.create_connection(where) for _ in range(3)]
        time.sleep(0.1)
        newest = socket.create_connection(where)  # the oldest waiting one gives way
        status, headers, body = answer(idle[0])
        assert status == 503 and headers["retry-after"] == "1"
        assert headers["content-type"] == "application/problem+json" and json.loads(body)["status"] == 503
        newest.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        assert answer(newest)[0] == 200

        slow = [socket.create_connection(where) for _ in range(2)]
        for s in slow:
            s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        extra = socket.create_connection(where)
        extra.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = answer(extra)
        assert status == 503 and headers["retry-after"] == "1" and json.loads(body)["detail"].startswith("too many")
        assert [answer(s)[0] for s in slow] == [200, 200]

        short = socket.create_connection(where)  # less body than its Content-Length
        t0 = time.monotonic()
        short.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        status, _, body = answer(short)
        assert status == 408 and time.monotonic() - t0 < 2.0 and json.loads(body)["status"] == 408
        for s in [*idle, newest, *slow, extra, short]:
            s.close()
    finally:
        server.should_exit = True
