"""The sidecar as an attacker and a failing machine would treat it: one table of figures.

    .venv/bin/python benchmarks/audit/sidecar_reliability.py [--small] [--db sqlite|postgresql|both]

Real `kvguard serve` processes on loopback (admin API on TCP, ingest API on a Unix
socket), production mode, every exchange bounded in count and time:

* the route x scope x credential matrix: every route of the OpenAPI schema with no
  token, a forged one and each scope's token; right = 401 without a valid token, 403
  with a valid one lacking the scope, anything else with the scope;
* a bad-input corpus on both APIs (malformed, oversized by Content-Length and chunked,
  deeply nested, NUL, invalid UTF-8, huge numbers, huge headers, slow clients): no 5xx,
  and the server's peak RSS stays under a stated cap;
* kill -9 of the server while a process streams events and while erasures run:
  acknowledged events lost, events recorded twice, erasures done other than once;
* a database outage (PostgreSQL only, through a TCP proxy that is cut, never by stopping
  the database): batches acknowledged but not stored, 503s while down, recovery time;
* a second server on the same data directory: refused, and the first keeps serving.

Exits 1 when a figure is off what it must be (the CI test runs `--small`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks._lib.reliability import Report, rss_mb, send_raw  # noqa: E402
from tests.sidecar.conftest import PG_ADMIN, ROOT, drop_pg_database, start_server  # noqa: E402
from tests.sidecar.netproxy import TcpProxy  # noqa: E402

RSS_CAP_MB = 300  # the server's peak RSS through the bad-input corpus must stay under this
ENV = {"KVGUARD_INFERENCE_LIVE_S": "1", "KVGUARD_REQUEST_READ_TIMEOUT_S": "2"}
SCOPES = ("admin", "ingest", "erasure:write", "erasure:read", "audit:read")


# --- plumbing ------------------------------------------------------------------------------------

def ingest_client(server) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket)), base_url="http://sidecar",
                        headers={"Authorization": f"Bearer {server.tokens['ingest']}"}, timeout=10)


def event(n: int) -> dict:
    return {"n": n, "op": "quantize", "subject": {"tenant": "acme", "user": f"u{n % 7}", "session": f"s{n % 13}"},
            "details": {"seq": n % 13, "pages": [f"main:{n % 256}"], "n_tokens": 16}}


def batch(instance: str, first: int, count: int) -> dict:
    return {"client": "bench", "instance": instance, "events": [event(n) for n in range(first, first + count)]}


def records_by_event(server, process: str) -> dict[int, int]:
    out, after = {}, -1
    with server.client("audit:read") as c:
        while after is not None:
            r = c.get("/v1/audit/records", params={"after": after, "limit": 1000})
            assert r.status_code == 200, r.text
            page = r.json()
            for r in page["records"]:
                d = r["details"]
                if d.get("process") == process:
                    out[d["event"]] = out.get(d["event"], 0) + 1
            after = page["next_after"]
    return out


def restart(server, tmp: Path, db_url: str, **env):
    return start_server(tmp, db_url, tokens=server.tokens,
                        extra_env={**ENV, "KVGUARD_ORIGIN": server.env["KVGUARD_ORIGIN"], **env})


def kill9(server) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)


# --- the checks ----------------------------------------------------------------------------------

def _clients(server) -> tuple[httpx.Client, httpx.Client]:
    """The admin API's listener (TCP) and the ingest API's (the Unix socket)."""
    return (httpx.Client(base_url=server.url),
            httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket)), base_url="http://s"))


def matrix(server, report: Report, label: str) -> None:
    admin = {"Authorization": "Bearer " + server.tokens["admin"]}
    tcp, unix = _clients(server)
    with tcp, unix:  # each listener's schema lists its own routes; the other answers them 404
        paths = {**tcp.get("/openapi.json", headers=admin).json()["paths"],
                 **unix.get("/openapi.json", headers=admin).json()["paths"]}
    right = wrong = 0
    for path, ops in paths.items():
        if not (path.startswith("/v1/") or path.startswith("/internal/") or path == "/metrics"):
            continue
        concrete = path.replace("{request_id}", "x").replace("{command_id}", "x")
        for method in ops:
            tcp, unix = _clients(server)
            with tcp, unix:
                other = tcp if path.startswith("/internal/") else unix
                r = other.request(method, concrete, headers=admin, timeout=10)
            right, wrong = right + (r.status_code == 404), wrong + (r.status_code != 404)
            needed = ("ingest" if path.startswith("/internal/") else "audit:read" if path == "/metrics"
                      else "admin" if path == "/v1/audit/check" or path.startswith("/v1/keys/")
                      else "erasure:write" if method == "post" else
                      "erasure:read" if path.startswith("/v1/erasure") else "audit:read")
            params = {"client": "m", "instance": "0" * 16, "wait": 0} if path.endswith("/commands") else None
            for cred in ("none", "forged", *SCOPES):
                headers = {} if cred == "none" else {
                    "Authorization": "Bearer " + ("kvg_" + "x" * 43 if cred == "forged" else server.tokens[cred])}
                tcp, unix = _clients(server)
                c = unix if path.startswith("/internal/") else tcp
                with tcp, unix:
                    r = c.request(method, concrete, headers=headers, params=params, timeout=10)
                allowed = cred == needed or cred == "admin" and needed != "ingest"
                expect = 401 if cred in ("none", "forged") else None if allowed else 403
                good = r.status_code == expect if expect else r.status_code not in (401, 403) and r.status_code < 500
                right, wrong = right + good, wrong + (not good)
    report.add(f"route x scope x credential ({label})", f"{right} right, {wrong} wrong", wrong == 0 and right > 0)


def corpus(server, report: Report, label: str, small: bool) -> None:
    tcp, unix = ("tcp", ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))), ("unix", str(server.socket))
    admin_auth = f"Authorization: Bearer {server.tokens['admin']}\r\n".encode()
    ingest_auth = f"Authorization: Bearer {server.tokens['ingest']}\r\n".encode()
    valid_erasure = {"tenant": "acme", "user": "u", "legal_basis": "gdpr-art17"}
    valid_batch = batch("c0" * 8, 0, 1)
    bodies = {
        "malformed": b'{"tenant": ',
        "deeply nested": b"[" * 200_000 + b"]" * 200_000,
        "nested in a field": json.dumps({**valid_batch, "events": [{**valid_batch["events"][0], "details": {
            "a": json.loads("[" * 500 + "]" * 500)}}]}).encode(),
        "NUL escaped": json.dumps({**valid_erasure, "tenant": "a\u0000b"}).encode(),
        "NUL raw": b'{"tenant": "a\x00b", "user": "u", "legal_basis": "gdpr-art17"}',
        "invalid UTF-8": b'{"tenant": "\xff\xfe\xc3", "user": "u", "legal_basis": "gdpr-art17"}',
        "huge float": b'{"tenant": "a", "user": "u", "legal_basis": "gdpr-art17", "reason": 1e999999}',
        "huge integer": b'{"client": "x", "instance": "' + b"0" * 16 + b'", "events": [{"n": ' + b"9" * 4000 + b"}]}",
        "huge n": json.dumps({**valid_batch, "events": [{**valid_batch["events"][0], "n": 10**30}]}).encode(),
        "wrong types": json.dumps({"client": ["x"], "instance": 7, "events": "all", "stats": [1]}).encode(),
        "many tiers": json.dumps({**valid_batch, "events": [], "stats": {
            "pages_offloaded": {f"t{i}": 1 for i in range(20_000)}}}).encode(),
    }
    targets = [("admin", tcp, b"POST /v1/erasure-requests", admin_auth + b"Idempotency-Key: corpus-key-1\r\n"),
               ("ingest", unix, b"POST /internal/v1/events", ingest_auth)]
    statuses: dict[int, int] = {}
    sent = 0
    _, peak0 = rss_mb(server.proc.pid)
    rounds = 1 if small else 5
    for _ in range(rounds):
        for _api, where, line, auth in targets:
            for body in bodies.values():
                for chunked in (False, True):
                    head = line + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                    if chunked:
                        data = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                    else:
                        data = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
                    code = send_raw(where, data)
                    statuses[code] = statuses.get(code, 0) + 1
                    sent += 1
            # oversized: declared (nothing sent), chunked (sent until cut), unauthenticated, huge headers
            for data in (line + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 104857600\r\n\r\n",
                         line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n",
                         line + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n"
                         + b"100000\r\n" + b"a" * 0x100000 * (24 if where is unix else 1) + b"\r\n0\r\n\r\n",
                         line + b" HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
                         b"GET /v1/audit/records?after=" + b"9" * 5000 + b" HTTP/1.1\r\nHost: x\r\n" + admin_auth
                         + b"\r\n",
                         b"GET /v1/audit/r\xffecords HTTP/1.1\r\nHost: x\r\n\r\n"):
                code = send_raw(where, data)
                statuses[code] = statuses.get(code, 0) + 1
                sent += 1
    five = sum(n for code, n in statuses.items() if code >= 500)
    shown = ", ".join(f"{code or 'closed'}: {n}" for code, n in sorted(statuses.items()))
    report.add(f"bad-input corpus, both APIs ({label})", f"{sent} requests, {five} × 5xx ({shown})", five == 0)

    # slow clients: each sends half a request line and nothing more
    n_slow = 30 if small else 300
    conns, t0 = [], time.monotonic()
    for i in range(n_slow):
        s = socket.create_connection(tcp[1]) if i % 2 else socket.socket(socket.AF_UNIX)
        if not i % 2:
            s.connect(unix[1])
        s.sendall(b"POST /v1/erasure-requests HTTP/1.1\r\nHo")
        s.settimeout(15)
        conns.append(s)
    served = httpx.get(server.url + "/healthz", timeout=5).status_code == 200
    held = []
    for s in conns:
        try:
            s.recv(4096)
            while s.recv(4096):
                pass
        except OSError:
            pass
        held.append(time.monotonic() - t0)
        s.close()
    limit = float(server.env.get("KVGUARD_REQUEST_READ_TIMEOUT_S", "10"))
    cut = sum(h < limit + 3 for h in held)
    report.add(f"slow clients ({label})", f"{cut}/{n_slow} cut, longest held {max(held):.1f} s "
                                          f"(timeout {limit:g} s); others served meanwhile: {served}",
               cut == n_slow and served)
    now, peak = rss_mb(server.proc.pid)
    report.add(f"server memory through the corpus ({label})",
               f"peak RSS {peak:.0f} MB (before {peak0:.0f} MB, now {now:.0f} MB; cap {RSS_CAP_MB} MB)",
               peak < RSS_CAP_MB)


def kill_during_ingestion(server, tmp: Path, db_url: str, report: Report, label: str, small: bool):
    inst, per = uuid.uuid4().hex[:16], 50
    acked, kills, resent = -1, 0, 0
    for _round in range(1 if small else 3):
        stop = threading.Event()
        killer = threading.Timer(random.uniform(0.3, 1.0), lambda: (kill9(server), stop.set()))
        killer.start()
        with ingest_client(server) as c:
            while not stop.is_set():
                try:
                    r = c.post("/internal/v1/events", json=batch(inst, acked + 1, per))
                except httpx.HTTPError:
                    break
                if r.status_code == 200:
                    acked = r.json()["up_to"]
        killer.join()
        kills += 1
        server = restart(server, tmp, db_url)
        with ingest_client(server) as c:  # the process resends what it has not seen acknowledged
            ack = c.post("/internal/v1/events", json=batch(inst, acked + 1, per)).json()
            resent += per - ack["recorded"]
            acked = ack["up_to"]
    counts = records_by_event(server, f"bench/{inst}")
    lost = sum(1 for n in range(acked + 1) if n not in counts)
    twice = sum(1 for n in counts.values() if n > 1)
    report.add(f"kill -9 during ingestion ({label})",
               f"{kills} kill(s), {acked + 1} events acknowledged: lost {lost}, recorded twice {twice} "
               f"({resent} resent events dropped as already recorded)", lost == 0 and twice == 0)
    return server


class SlowProcess(threading.Thread):
    """An inference process that takes its erase commands and acknowledges each after a
    pause, across server restarts (the socket's path stays): erasures are then mid-way for
    that long, waiting for it, and a kill lands inside one."""

    def __init__(self, server, pause_s: float = 0.4) -> None:
        super().__init__(daemon=True)
        self.server, self.pause_s, self.stop = server, pause_s, threading.Event()
        self.instance, self.acked = uuid.uuid4().hex[:16], 0

    def run(self) -> None:
        who = {"client": "bench-proc", "instance": self.instance}
        while not self.stop.is_set():
            try:
                with ingest_client(self.server) as c:
                    r = c.get("/internal/v1/commands", params={**who, "wait": 1})
                    for cmd in r.json() if r.status_code == 200 else ():
                        time.sleep(self.pause_s)
                        result = dict.fromkeys(("pages", "bytes", "sequences", "shared_pages", "tier_copies",
                                                "prefix_entries"), 0)
                        if c.post(f"/internal/v1/commands/{cmd['id']}/ack",
                                  json={**who, "result": result}).status_code == 200:
                            self.acked += 1
            except (httpx.HTTPError, ValueError):
                time.sleep(0.1)


def kill_during_erasure(server, tmp: Path, db_url: str, report: Report, label: str, small: bool):
    ids = []
    proc = SlowProcess(server)
    proc.start()
    time.sleep(1.5)  # live, and past the server's reconnect window
    for i in range(2 if small else 5):
        with server.client("erasure:write") as c:
            r = c.post("/v1/erasure-requests", json={"tenant": "acme", "user": f"erased-{i}",
                                                    "legal_basis": "gdpr-art17"},
                       headers={"Idempotency-Key": f"bench-kill-{i}-{uuid.uuid4().hex[:8]}"})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        time.sleep(random.uniform(0.05, 0.6))  # somewhere in the erasure: most of it waits for the process
        kill9(server)
        server = proc.server = restart(server, tmp, db_url)
        time.sleep(1.5)
    deadline = time.monotonic() + 60
    states = {}
    with server.client("erasure:read") as c:
        while time.monotonic() < deadline:
            states = {rid: c.get(f"/v1/erasure-requests/{rid}").json()["state"] for rid in ids}
            if all(s in ("completed", "failed") for s in states.values()):
                break
            time.sleep(0.3)
    erase_records: dict[str, int] = {}
    after = -1
    with server.client("audit:read") as c:
        while after is not None:
            page = c.get("/v1/audit/records", params={"after": after, "limit": 1000, "op": "erase"}).json()
            for r in page["records"]:
                rid = r["details"].get("request")
                if rid in ids:
                    erase_records[rid] = erase_records.get(rid, 0) + 1
            after = page["next_after"]
    proc.stop.set()
    once = sum(1 for rid in ids if erase_records.get(rid) == 1 and states.get(rid) == "completed")
    report.add(f"kill -9 during erasures ({label})",
               f"{len(ids)} requests, the server killed 0.05-0.6 s into each: {once} completed with exactly one "
               f"erase record ({proc.acked} process acknowledgements)", once == len(ids))
    return server


def outage(tmp: Path, db_url: str, report: Report, small: bool) -> None:
    proxy = TcpProxy(("127.0.0.1", 5432))
    server = start_server(tmp, db_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"), extra_env=ENV)
    inst, acked, codes, down_s = uuid.uuid4().hex[:16], -1, {}, 3.0 if small else 10.0
    ready_while_down = None
    try:
        with ingest_client(server) as c:
            def send() -> int:
                nonlocal acked
                try:
                    r = c.post("/internal/v1/events", json=batch(inst, acked + 1, 20))
                except httpx.HTTPError:
                    return 0
                if r.status_code == 200:
                    acked = r.json()["up_to"]
                return r.status_code

            for _ in range(5):
                send()
            proxy.cut()
            t_end = time.monotonic() + down_s
            while time.monotonic() < t_end:
                code = send()
                codes[code] = codes.get(code, 0) + 1
                if ready_while_down is None:
                    ready_while_down = httpx.get(server.url + "/readyz", timeout=10).status_code
                time.sleep(0.05)
            acked_down = acked
            proxy.restore()
            t0 = time.monotonic()
            while send() != 200 and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            recovery = time.monotonic() - t0
        counts = records_by_event(server, f"bench/{inst}")
        unstored = sum(1 for n in range(acked + 1) if n not in counts)
    finally:
        server.stop()
        proxy.close()
    log = (tmp / "serve.log").read_text()
    tracebacks, lines = log.count("Traceback"), log.count('"database unavailable"')
    other = sum(n for code, n in codes.items() if code not in (503,))
    report.add("database outage (postgresql)",
               f"{down_s:g} s down: {codes.get(503, 0)} × 503, {other} other; /readyz {ready_while_down}; acknowledged "
               f"but not stored {unstored}; recovery {recovery:.2f} s; {lines} log lines, {tracebacks} tracebacks",
               codes.get(503, 0) > 0 and other == 0 and ready_while_down == 503 and unstored == 0
               and acked > acked_down and tracebacks == 0)


def second_server(server, report: Report, label: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvguard", "serve"], env={**server.env, "KVGUARD_PORT": "0"},
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    with ingest_client(server) as c:
        serving = c.post("/internal/v1/events", json={"client": "x", "instance": "0" * 16}).status_code == 200
    ready = httpx.get(server.url + "/readyz").status_code == 200
    refused = r.returncode != 0 and "another kvguard serve is running" in r.stderr
    report.add(f"second server on the data directory ({label})",
               f"refused: {refused} (exit {r.returncode}); first still ready: {ready}, serving ingest: {serving}",
               refused and ready and serving)


def run(db: str, report: Report, small: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="kvguard-reliability-") as tmp:
        tmp = Path(tmp)
        db_url, name = f"sqlite:///{tmp / 'audit.db'}", None
        if db == "postgresql":
            import sqlalchemy as sa

            name = f"kvguard_rel_{uuid.uuid4().hex[:10]}"
            admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
            db_url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
        server = None
        try:
            server = start_server(tmp / "main", db_url, extra_env=ENV)
            matrix(server, report, db)
            corpus(server, report, db, small)
            second_server(server, report, db)
            server = kill_during_ingestion(server, tmp / "main", db_url, report, db, small)
            server = kill_during_erasure(server, tmp / "main", db_url, report, db, small)
            server.stop()
            if db == "postgresql":
                outage(tmp / "outage", db_url, report, small)
        finally:
            if server is not None:
                server.stop()
            if name is not None:
                drop_pg_database(name)  # and the runtime role start_server made for it
                admin.dispose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="fewer rounds and clients (the CI test)")
    p.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="both")
    args = p.parse_args(argv)
    report = Report()
    t0 = time.monotonic()
    for db in (("sqlite", "postgresql") if args.db == "both" else (args.db,)):
        (Path(tempfile.gettempdir())).mkdir(exist_ok=True)
        run(db, report, args.small)
    print(report.table())
    print(f"\n{time.strftime('%Y-%m-%d')}, {'small' if args.small else 'full'} run, {time.monotonic() - t0:.0f} s, "
          f"{os.cpu_count()} CPUs")
    return 0 if all(r.ok for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
