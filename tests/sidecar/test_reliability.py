"""The sidecar against hostile and failing surroundings, over real HTTP: bodies bounded and
authenticated before they are read, slow clients cut, cache stats validated, one server per
data directory, a database outage answered 503 and recovered from, event numbers that
cannot skip ahead and survive a restart."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import sqlalchemy as sa

from tests.sidecar.conftest import ROOT, start_server
from tests.sidecar.netproxy import TcpProxy

LIMITS = {"KVGUARD_MAX_BODY_BYTES": "4096", "KVGUARD_MAX_INGEST_BODY_BYTES": "65536",
          "KVGUARD_REQUEST_READ_TIMEOUT_S": "1.5"}
MAX_SAFE_INTEGER = 2**53 - 1


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One SQLite sidecar with small limits, for the tests that store nothing of note."""
    tmp = tmp_path_factory.mktemp("small")
    s = start_server(tmp, f"sqlite:///{tmp / 'audit.db'}", extra_env=LIMITS)
    yield s
    s.stop()


def ingest(server) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket)), base_url="http://sidecar",
                        headers={"Authorization": f"Bearer {server.tokens['ingest']}"}, timeout=30)


def event(n: int, user: str = "u1") -> dict:
    return {"n": n, "op": "quantize", "subject": {"tenant": "acme", "user": user, "session": f"{user}-s"},
            "details": {"seq": 1, "pages": ["main:1"], "n_tokens": 16}}


def batch(instance: str, events: list[dict], **extra) -> dict:
    return {"client": "proc", "instance": instance, "events": events, **extra}


def raw(port: int, data: bytes, *, read_s: float = 5.0) -> bytes:
    """Send `data` on a fresh connection; what the server answers before it closes or `read_s` ends."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def port_of(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


# --- bodies and slow clients ---------------------------------------------------------------------

def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(small):
    head = (b"POST /v1/erasure-requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + small.tokens["erasure:write"].encode() + b"\r\n"
            b"Content-Length: 104857600\r\n\r\n")
    t0 = time.monotonic()
    answer = raw(port_of(small), head + b"{")  # 100 MB announced, one byte sent
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"application/problem+json" in answer and time.monotonic() - t0 < 1.4  # not the read timeout


def test_an_unauthenticated_body_is_not_read(small):
    # a body within the limit, announced but never sent: the answer cannot wait for it
    head = (b"POST /v1/erasure-requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4000\r\n\r\n")
    t0 = time.monotonic()
    answer = raw(port_of(small), head)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert time.monotonic() - t0 < 1.4
    answer = raw(port_of(small), head.replace(b"Host: x\r\n", b"Host: x\r\nAuthorization: Bearer kvg_forged\r\n"))
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_a_chunked_body_is_counted_and_cut_at_the_limit(small):
    def chunks():
        yield b'{"tenant": "' + b"a" * 3000
        for _ in range(1000):  # 1 MB more, if anyone read it
            yield b"a" * 1024

    with small.client("erasure:write") as c:
        r = c.post("/v1/erasure-requests", content=chunks(), headers={"Idempotency-Key": uuid.uuid4().hex,
                                                                      "Content-Type": "application/json"})
    assert r.status_code == 413 and r.headers["content-type"] == "application/problem+json"
    with ingest(small) as c:  # the ingest batch route has its own, larger limit
        body = json.dumps(batch("ab" * 8, [event(0)])).encode()
        r = c.post("/internal/v1/events", content=body + b" " * 70_000, headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        big = event(0)
        big["details"]["pages"] = [f"main:{i}" for i in range(1000)]  # ~10 KB: over the admin routes' 4 KiB
        r = c.post("/internal/v1/events", json=batch(uuid.uuid4().hex[:16], [big]))
        assert r.status_code == 200, r.text


def test_slow_clients_are_cut(small):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port_of(small)), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # and never the rest of the headers
        assert s.recv(1024).startswith(b"HTTP/1.1 408")
        assert s.recv(1024) == b""  # closed
    assert time.monotonic() - t0 < 5
    # a body trickling in, one byte a quarter second, with headers complete and authenticated
    with socket.create_connection(("127.0.0.1", port_of(small)), timeout=10) as s:
        s.sendall(b"POST /v1/erasure-requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + small.tokens["erasure:write"].encode() + b"\r\n"
                  b"Idempotency-Key: slow-client-1\r\nContent-Length: 100\r\n\r\n")
        t0, answer = time.monotonic(), b""
        try:
            for _ in range(40):
                s.sendall(b" ")
                time.sleep(0.25)
        except OSError:
            pass
        try:
            answer = s.recv(1024)
        except OSError:
            pass
        assert time.monotonic() - t0 < 5 and (answer == b"" or answer.startswith(b"HTTP/1.1 408")), answer
    assert httpx.get(small.url + "/healthz").status_code == 200


# --- cache stats and /metrics --------------------------------------------------------------------

def test_malformed_stats_are_refused_and_metrics_stay_up(small):
    inst = uuid.uuid4().hex[:16]
    bad = [{"pages_used": {"hot": "many"}}, {"pages_used": {"hot": 2**60}}, {"pages_offloaded": {"disk": -1}},
           {"pages_offloaded": {f"tier{i}": 1 for i in range(20_000)}}, {"codec": "x" * 300},
           {"pages_used": {"hot": {"nested": [1]}}}, {"unknown": 1}]
    with ingest(small) as c:
        for stats in bad:
            r = c.post("/internal/v1/events", json=batch(inst, [], stats=stats))
            assert r.status_code in (413, 422), (stats if len(str(stats)) < 200 else "20k tiers", r.status_code)
        r = c.post("/internal/v1/events", json=batch(inst, [], stats={
            "codec": "int8", "pages_used": {"hot": 3, "main": 40}, "pages_offloaded": {"disk": 7}, "tokens_held": 9}))
        assert r.status_code == 200, r.text
    with small.client("audit:read") as c:
        r = c.get("/metrics")
    assert r.status_code == 200
    pages = [line for line in r.text.splitlines() if line.startswith("kvguard_cache_pages{")]
    assert 'kvguard_cache_pages{codec="int8",tier="disk"} 7.0' in pages
    assert 'kvguard_cache_pages{codec="int8",tier="device"} 40.0' in pages and len(pages) <= 4 * 6


def test_the_stats_of_a_cache_with_the_k_v_split_are_taken(small):
    """A cache with the K/V split reports its split pool and the values it holds in host memory
    (CacheManager.stats): taken, the split's pages counted on the device in the codec's label."""
    from kvguard.sidecar.metrics import _pages

    stats = {"codec": "int8", "pages_used": {"hot": 2, "main": 6, "split": 30}, "pages_offloaded": {"cpu-values": 30},
             "tokens_held": 600}
    with ingest(small) as c:
        r = c.post("/internal/v1/events", json=batch(uuid.uuid4().hex[:16], [], stats=stats))
        assert r.status_code == 200, r.text
    assert _pages(stats) == {("device", "fp16"): 2, ("device", "int8"): 36}  # the values' tier is no label


def test_metrics_have_a_bounded_label_set_whatever_a_process_sends(small):
    from kvguard.sidecar.metrics import _pages

    counts = _pages({"codec": "zzz", "pages_used": {"hot": 1, "x": 5}, "pages_offloaded": {"t1": 2, "disk": "9"}})
    assert counts == {("device", "fp16"): 1, ("device", "unknown"): 5}


# --- one server per data directory ---------------------------------------------------------------

def test_a_second_server_on_the_data_directory_exits_and_the_first_keeps_serving(small):
    r = subprocess.run([sys.executable, "-m", "kvguard", "serve"], env={**small.env, "KVGUARD_PORT": "0"},
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "another kvguard serve is running on" in r.stderr and "Traceback" not in r.stderr
    assert small.socket.exists()
    with ingest(small) as c:
        assert c.post("/internal/v1/events", json=batch(uuid.uuid4().hex[:16], [])).status_code == 200
    assert httpx.get(small.url + "/readyz").json()["status"] == "ready"


def test_readyz_fails_when_its_socket_is_no_longer_the_one_it_bound(tmp_path):
    server = start_server(tmp_path, f"sqlite:///{tmp_path / 'audit.db'}")
    try:
        moved = server.socket.with_name("moved.sock")
        server.socket.rename(moved)
        r = httpx.get(server.url + "/readyz")
        assert r.status_code == 503 and r.json()["checks"]["ingest_socket"] != "ok"
        moved.rename(server.socket)
        assert httpx.get(server.url + "/readyz").status_code == 200
    finally:
        server.stop()


# --- event numbers -------------------------------------------------------------------------------

def restart(server, tmp_path):
    server.stop()
    return start_server(tmp_path, server.db_url, tokens=server.tokens,
                        extra_env={"KVGUARD_ORIGIN": server.env["KVGUARD_ORIGIN"]})


def count_records(server, process: str) -> dict[int, int]:
    """How many records each event of `process` has in the log."""
    out, after = {}, -1
    with server.client("audit:read") as c:
        while after is not None:
            page = c.get("/v1/audit/records", params={"after": after, "limit": 1000}).json()
            for r in page["records"]:
                if r["details"].get("process") == process:
                    out[r["details"]["event"]] = out.get(r["details"]["event"], 0) + 1
            after = page["next_after"]
    return out


def test_event_numbers_cannot_skip_ahead_and_survive_a_restart(tmp_path, db_url):
    server = start_server(tmp_path, db_url)
    inst = uuid.uuid4().hex[:16]
    try:
        with ingest(server) as c:
            assert c.post("/internal/v1/events", json=batch(inst, [event(0), event(1)])).json()["up_to"] == 1
            r = c.post("/internal/v1/events", json=batch(inst, [event(MAX_SAFE_INTEGER)]))
            assert r.status_code == 422 and r.json()["next_event"] == 2
            r = c.post("/internal/v1/events", json=batch(inst, [event(2), event(2)]))
            assert r.status_code == 422  # a number twice in one batch
            ack = c.post("/internal/v1/events", json=batch(inst, [event(1), event(2), event(3)])).json()
            assert (ack["recorded"], ack["up_to"]) == (2, 3)  # 1 was resent: dropped
        server = restart(server, tmp_path)
        with ingest(server) as c:  # the process resends what it has not seen acknowledged, and more
            ack = c.post("/internal/v1/events", json=batch(inst, [event(2), event(3), event(4)])).json()
            assert (ack["recorded"], ack["up_to"]) == (1, 4)
        assert count_records(server, f"proc/{inst}") == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}
    finally:
        server.stop()


def test_events_of_a_batch_whose_answer_was_lost_are_recorded_once(tmp_path, db_url):
    """The records are in the log but the progress row is not (a crash between the two)."""
    server = start_server(tmp_path, db_url)
    inst = uuid.uuid4().hex[:16]
    try:
        with ingest(server) as c:
            assert c.post("/internal/v1/events", json=batch(inst, [event(0)])).status_code == 200
            assert c.post("/internal/v1/events", json=batch(inst, [event(1), event(2)])).status_code == 200
        server.stop()
        engine = sa.create_engine(db_url)
        with engine.begin() as conn:  # as if the sidecar died before its progress row was written
            conn.execute(sa.text("UPDATE ingest_progress SET last_event = 0, log_size = 1 WHERE client = :c"),
                         {"c": f"proc/{inst}"})
        engine.dispose()
        server = restart(server, tmp_path)
        with ingest(server) as c:
            ack = c.post("/internal/v1/events", json=batch(inst, [event(1), event(2), event(3)])).json()
            assert (ack["recorded"], ack["up_to"]) == (1, 3)
        assert count_records(server, f"proc/{inst}") == {0: 1, 1: 1, 2: 1, 3: 1}
    finally:
        server.stop()


# --- database outage -----------------------------------------------------------------------------

def test_a_database_outage_is_503_and_recovers_by_itself(tmp_path, pg_database):
    proxy = TcpProxy(("127.0.0.1", 5432))
    proxied = pg_database.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    server = start_server(tmp_path, proxied)
    inst = uuid.uuid4().hex[:16]
    try:
        with ingest(server) as c, server.client("erasure:write") as admin:
            assert c.post("/internal/v1/events", json=batch(inst, [event(0)])).status_code == 200
            proxy.cut()
            for _i in range(10):
                r = c.post("/internal/v1/events", json=batch(inst, [event(1), event(2)]))
                assert r.status_code == 503, r.text
                assert r.headers["content-type"] == "application/problem+json" and r.headers["retry-after"]
            r = admin.post("/v1/erasure-requests", json={"tenant": "acme", "user": "u1", "legal_basis": "gdpr-art17"},
                           headers={"Idempotency-Key": "outage-erasure-1"})
            assert r.status_code == 503 and r.headers["retry-after"]
            assert httpx.get(server.url + "/readyz").status_code == 503
            time.sleep(1.5)  # the erasure loop runs meanwhile
            proxy.restore()
            deadline = time.monotonic() + 20
            while httpx.get(server.url + "/readyz").status_code != 200:
                assert time.monotonic() < deadline, "not ready again after the database came back"
                time.sleep(0.2)
            ack = c.post("/internal/v1/events", json=batch(inst, [event(1), event(2)])).json()
            assert ack["up_to"] == 2
            r = admin.post("/v1/erasure-requests", json={"tenant": "acme", "user": "u1", "legal_basis": "gdpr-art17"},
                           headers={"Idempotency-Key": "outage-erasure-1"})
            assert r.status_code == 202
        assert count_records(server, f"proc/{inst}") == {0: 1, 1: 1, 2: 1}
    finally:
        server.stop()
        proxy.close()
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log
    assert 1 <= log.count('"database unavailable"') <= 6  # one line per place and 10 s, not one per failure


def test_deeply_nested_details_become_an_ingest_error_and_the_log_stays_readable(small):
    inst = uuid.uuid4().hex[:16]
    deep = event(0)
    deep["details"]["extra"] = json.loads("[" * 300 + "]" * 300)
    with ingest(small) as c:
        ack = c.post("/internal/v1/events", json=batch(inst, [deep, event(1)])).json()
    assert ack["refused"] == [0] and ack["up_to"] == 1
    assert count_records(small, f"proc/{inst}") == {0: 1, 1: 1}  # the records API answers (no 500)
