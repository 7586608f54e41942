"""The inference-side client never drops an event; retention erases expired sessions."""

from __future__ import annotations

import time

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache.events import EventQueue
from kvguard.client import SidecarClient, SidecarUnavailable
from kvguard.types import Subject
from tests.sidecar.conftest import start_server


def small_cache():
    return CacheManager(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=32, num_pages=64, page_size=4,
                                    codec="int8"))


def fill(cache, seq, n=40):
    k = torch.randn(n, 1, 32).half()
    assert cache.append(seq, 0, k, k)  # full pages get quantized: one event


def count_records(server, op):
    n, after = 0, -1
    with server.client("audit:read") as c:
        while after is not None:
            page = c.get("/v1/audit/records", params={"op": op, "after": after, "limit": 1000}).json()
            n += len(page["records"])
            after = page["next_after"]
    return n


def test_unreachable_sidecar_refuses_new_sequences_and_loses_nothing(tmp_path, db_url):
    cache = small_cache()
    ingest_token = "kvg_" + "x" * 43  # replaced once the server exists
    # the socket the server will listen on (the ingest API is served there only)
    client = SidecarClient(cache, socket=tmp_path / "data" / "ingest.sock", token=ingest_token, max_pending=3,
                           on_full="refuse", interval_s=0.02).start()
    try:
        # opened before any event exists, so the sender's draining cannot refuse one of them
        seqs = [client.open(Subject("t", f"u{i}", f"s{i}")) for i in range(5)]
        for seq in seqs:
            fill(cache, seq)  # more events than max_pending: kept, never dropped
        deadline = time.monotonic() + 20  # the sender takes them every 20 ms; a busy machine may delay it
        while client.pending < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # and nothing more arrives
        assert client.pending == 5 and not client.connected
        with pytest.raises(SidecarUnavailable, match="refusing new sequences"):
            client.open(Subject("t", "late", "s"))
        server = start_server(tmp_path, db_url)
        try:
            client._http.headers["Authorization"] = f"Bearer {server.tokens['ingest']}"
            assert client.flush(30)
            assert client.pending == 0 and client.connected
            assert count_records(server, "quantize") == 5  # every event, once
            client.open(Subject("t", "late", "s"))  # admitted again
        finally:
            client.close()
            server.stop()
    finally:
        client._stop.set()


def test_retention_erases_expired_sessions_each_with_its_own_record(tmp_path, db_url):
    server = start_server(tmp_path, db_url, extra_env={"KVGUARD_RETENTION_MAX_AGE_S": "1",
                                                       "KVGUARD_RETENTION_CHECK_S": "0.5"})
    cache = small_cache()
    try:
        with SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], interval_s=0.05) as client:
            for i in range(3):
                fill(cache, client.open(Subject("bank", f"user-{i}", f"session-{i}")))
            assert client.flush(20)
            deadline = time.monotonic() + 60
            # an erasure is acknowledged (and listed) once its event is durable, after the pages go
            while (cache.sequences() or len(client.erasures) < 3) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert cache.sequences() == []
            assert len(client.erasures) == 3 and all(e["sequences"] == 1 for e in client.erasures)
            deadline = time.monotonic() + 30
            while count_records(server, "erase") < 6 and time.monotonic() < deadline:
                time.sleep(0.2)
        # per session: the process's own erase event and the request's signed erase record
        assert count_records(server, "erase") == 6
    finally:
        server.stop()


class DawdlingQueue(EventQueue):
    """Drains, then pauses before handing the events over: the sender caught between taking
    events and numbering them."""

    def take_events(self):
        items = super().take_events()
        if items:
            time.sleep(1.0)
        return items


def test_flush_waits_for_events_the_sender_has_already_taken(tmp_path):
    server = start_server(tmp_path, f"sqlite:///{tmp_path / 'audit.db'}")
    cache = small_cache()
    cache.events = DawdlingQueue()
    try:
        with SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], interval_s=0.01) as client:
            fill(cache, client.open(Subject("t", "u", "s")))
            deadline = time.monotonic() + 10
            while len(cache.events) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client._next_no == 0  # the sender has taken the event and not numbered it yet
            assert client.flush(30)
            assert count_records(server, "quantize") == 1  # durable when flush said so
    finally:
        server.stop()


def test_an_erase_command_that_fails_is_retried_and_the_client_lives_on(tmp_path, db_url, monkeypatch):
    # a tier down makes the cache's erasure raise (TierError, nothing released): the command
    # thread survives, the unacknowledged command comes back and the erasure completes
    from kvguard.errors import TierError

    server = start_server(tmp_path, db_url, extra_env={"KVGUARD_RETENTION_MAX_AGE_S": "1",
                                                       "KVGUARD_RETENTION_CHECK_S": "0.5"})
    cache = small_cache()
    real, calls = cache.erase_session, []

    def flaky(tenant, session):
        calls.append(session)
        if len(calls) == 1:
            raise TierError("1 of 1 lower-tier copies could not be erased (ConnectionError)")
        return real(tenant, session)

    monkeypatch.setattr(cache, "erase_session", flaky)
    try:
        with SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], interval_s=0.05) as client:
            fill(cache, client.open(Subject("bank", "user-0", "session-0")))
            assert client.flush(20)
            deadline = time.monotonic() + 60
            while (cache.sequences() or not client.erasures) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert cache.sequences() == [] and len(client.erasures) == 1
            assert client.command_errors == 1 and len(calls) == 2
            assert client._threads[1].is_alive()
    finally:
        server.stop()


def test_an_erasure_whose_event_is_not_durable_is_never_acknowledged(monkeypatch):
    cache = small_cache()
    client = SidecarClient(cache, url="http://127.0.0.1:9", token="kvg_" + "x" * 43)
    posted = []
    monkeypatch.setattr(client, "flush", lambda timeout_s=10.0: False)  # the sidecar records nothing
    monkeypatch.setattr(client._http, "post", lambda *a, **kw: posted.append(a))
    client._stop.set()  # closing
    client._execute({"id": "c1", "kind": "erase", "scope": "session", "tenant": "t", "target": "s"})
    assert posted == [] and client.erasures == []
    client._http.close()


def test_an_erase_command_runs_on_a_thread_that_ends_with_it(monkeypatch):
    """Its torch work leaves no OpenMP team beside the model's (kvguard/threads.py)."""
    import threading

    cache = small_cache()
    client = SidecarClient(cache, url="http://127.0.0.1:9", token="kvg_" + "x" * 43)
    real, ran = cache.erase_session, []
    monkeypatch.setattr(cache, "erase_session", lambda t, s: ran.append(threading.current_thread()) or real(t, s))
    monkeypatch.setattr(client, "flush", lambda timeout_s=10.0: False)
    client._stop.set()
    client._execute({"id": "c1", "kind": "erase", "scope": "session", "tenant": "t", "target": "s"})
    assert ran and ran[0] is not threading.current_thread() and not ran[0].is_alive()
    client._http.close()


def test_an_idle_client_reports_at_its_heartbeat_and_events_go_at_once():
    """Nothing to send: one report a heartbeat (the sidecar keeps the process live by it), not
    one every look for events; an event goes out at the next look."""
    import httpx

    cache = small_cache()
    client = SidecarClient(cache, url="http://sidecar", token="kvg_" + "x" * 43, interval_s=0.01,
                           heartbeat_s=0.5)
    posts: list[tuple[float, int]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            events = __import__("json").loads(request.content)["events"]
            posts.append((time.monotonic(), len(events)))
            return httpx.Response(200, json={"recorded": len(events), "up_to": max([e["n"] for e in events],
                                                                                  default=-1)})
        time.sleep(0.05)  # the command poll
        return httpx.Response(200, json={"commands": []})

    client._http.close()
    client._http = httpx.Client(base_url="http://sidecar", transport=httpx.MockTransport(answer))
    client._threads = client._threads[:1]  # the sender alone
    client.start()
    try:
        time.sleep(1.6)
        idle = len(posts)
        assert 3 <= idle <= 5, posts  # at 0, 0.5, 1.0, 1.5 s; every 10 ms look would be ~160
        seq = cache.open(Subject("t", "u", "s"))
        t0 = time.monotonic()
        fill(cache, seq)  # a quantize event
        assert client.flush(2.0)
        assert any(n > 0 and t - t0 < 0.2 for t, n in posts), posts
        cache.free(seq)
    finally:
        client._stop.set()
        client._threads[0].join(5)
        client._http.close()


def live_processes(server) -> float:
    with server.client("audit:read") as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith("kvguard_inference_processes_live "):
                return float(line.split()[1])
    raise AssertionError("no kvguard_inference_processes_live in /metrics")


def test_a_client_that_closed_is_not_live_and_erasures_do_not_wait_for_it(tmp_path, db_url):
    # a liveness window far longer than the client's 50 ms between polls: only the goodbye ends its liveness at once
    server = start_server(tmp_path, db_url, extra_env={"KVGUARD_INFERENCE_LIVE_S": "10"})
    cache = small_cache()
    try:
        with SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], interval_s=0.05,
                           poll_wait_s=30) as client:
            fill(cache, client.open(Subject("bank", "user-0", "session-0")))
            assert client.flush(20)
            assert live_processes(server) == 1
            closing = time.monotonic()
        # closed: it said goodbye, and the sidecar ended the command poll that had waited since the
        # client started (it would have waited 30 s)
        assert time.monotonic() - closing < 5
        assert live_processes(server) == 0
        with server.client("erasure:write") as c:
            r = c.post("/v1/erasure-requests", headers={"Idempotency-Key": "goodbye-1"},
                       json={"tenant": "bank", "user": "user-0", "legal_basis": "gdpr-art17"})
            assert r.status_code == 202, r.text
        deadline, body = time.monotonic() + 90, {}
        while time.monotonic() < deadline:  # after the start's reconnect window of 10 s
            with server.client("erasure:read") as c:
                body = c.get(f"/v1/erasure-requests/{r.json()['id']}").json()
            if body["state"] in ("completed", "failed"):
                break
            time.sleep(0.5)
        assert body["state"] == "completed", body
        assert body["result"]["no_process_acknowledged"] is True and body["error"] is None
    finally:
        server.stop()
