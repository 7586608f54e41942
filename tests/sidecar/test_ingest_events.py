"""From the cache's events to audit records: an event of any size is recorded page by
page, one the sidecar cannot record never stops the ones after it, and a process that
reuses a client id (restarted, or two at once) has every event recorded; a client id
belongs to the ingest token that registered it, and a token bound to tenants sends
events of those tenants only."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from collections import defaultdict
from dataclasses import dataclass

import sqlalchemy as sa
import torch
from kvguard.audit.fields import MAX_ARRAY

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache.events import CacheEvent, SequenceFreed
from kvguard.client import SidecarClient
from kvguard.sidecar.ingest import split_pages
from kvguard.types import Subject
from tests.sidecar.conftest import ROOT, kvguard, start_server
from tests.sidecar.test_erasure_e2e import wait_state

TOKENS = MAX_ARRAY + 300  # one page a token: every event of the sequence lists more pages than a record may


def records(server, op: str | None = None) -> list[dict]:
    out, after = [], -1
    with server.client("audit:read") as c:
        while after is not None:
            params = {"after": after, "limit": 1000} | ({"op": op} if op else {})
            page = c.get("/v1/audit/records", params=params).json()
            out += page["records"]
            after = page["next_after"]
    return out


def test_split_pages_lists_every_page_once_and_sums_the_counts():
    details = {"seq": 7, "pages": [f"hot:{i}" for i in range(10)], "n_tokens": 33, "bytes": 1001,
               "codec": "int8", "kept": 5}
    parts = split_pages(details, limit=4)
    assert [p["pages"] for p in parts] == [details["pages"][0:4], details["pages"][4:8], details["pages"][8:]]
    assert [(p["part"], p["parts"]) for p in parts] == [(1, 3), (2, 3), (3, 3)]
    assert sum(p["n_tokens"] for p in parts) == 33 and sum(p["bytes"] for p in parts) == 1001
    assert [p["n_tokens"] for p in parts] == [13, 13, 7]  # in proportion to the pages, 4:4:2
    assert all(p["seq"] == 7 and p["codec"] == "int8" and p["kept"] == 5 for p in parts)
    assert split_pages(details, limit=10) == [details]  # at the limit: one record, no part numbers


def test_events_over_the_array_limit_reach_the_store_with_every_page(tmp_path, db_url):
    server = start_server(tmp_path, db_url)
    cache = CacheManager(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=32, num_pages=TOKENS + 16,
                                     page_size=1, codec="int8"))
    client = SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], interval_s=0.02)
    try:
        k = torch.randn(TOKENS, 1, 32).half()
        seq = client.open(Subject("acme", "long-context-user", "s-1"))
        assert cache.append(seq, 0, k, k)  # one quantize event of TOKENS pages
        client.free(seq)  # one free event of TOKENS pages
        seq = client.open(Subject("acme", "erased-user", "s-2"))
        assert cache.append(seq, 0, k, k)
        cache.erase_user("acme", "erased-user")  # one erase event of TOKENS pages
        events = list(cache.events._items)
        assert [e.op for e in events] == ["quantize", "free", "quantize", "erase"]
        assert all(len(e.pages) > MAX_ARRAY for e in events)
        client.start()
        assert client.flush(60), client.last_error
        assert client.refused == 0
        stored = records(server)
    finally:
        client.close()
        server.stop()
    # each event's parts, in log order: every page once, the counts summing to the event's
    by_event: dict[tuple, list[dict]] = defaultdict(list)
    for r in stored:
        by_event[(r["op"], r["details"]["seq"])].append(r["details"])
    assert len(by_event) == len(events)
    for e in events:
        parts = by_event[(e.op, e.seq)]
        assert [(p["part"], p["parts"]) for p in parts] == [(i + 1, len(parts)) for i in range(len(parts))]
        assert all(len(p["pages"]) <= MAX_ARRAY for p in parts)
        assert [page for p in parts for page in p["pages"]] == list(e.pages)
        assert sum(p["n_tokens"] for p in parts) == e.n_tokens and sum(p["bytes"] for p in parts) == e.bytes
        if e.op == "erase":
            assert sum(p["sequences"] for p in parts) == e.sequences == 1


@dataclass(frozen=True, slots=True)
class BadEvent(CacheEvent):
    """An event whose details break the format (a key that names a raw subject id)."""

    op = "free"
    email: str = ""


def test_an_event_the_format_refuses_is_recorded_as_an_ingest_error_and_stops_nothing(tmp_path, db_url,
                                                                                        caplog):
    server = start_server(tmp_path, db_url)
    cache = CacheManager(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=32, num_pages=16, page_size=4))
    subject = Subject("acme", "raw-user-4411", "raw-session-4411")
    client = SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], interval_s=0.02)
    try:
        cache.events.emit(SequenceFreed(1, subject, ("hot:0",), 4, 0))
        cache.events.emit(BadEvent(2, subject, ("hot:1",), 4, 0, email="raw-user-4411@example.com"))
        cache.events.emit(SequenceFreed(3, subject, ("hot:2",), 4, 0))
        with caplog.at_level(logging.INFO, logger="kvguard.client"):
            client.start()
            assert client.flush(30), client.last_error
        assert client.pending == 0 and client.refused == 1
        stored = records(server)
        with server.client("audit:read") as c:
            metrics = c.get("/metrics").text
    finally:
        client.close()
        server.stop()
    assert [(r["op"], r["details"].get("seq")) for r in stored] == [("free", 1), ("ingest_error", None),
                                                                    ("free", 3)]
    error = stored[1]
    assert error["details"] == {"process": f"{client.client_id}/{client.instance}", "event": 1, "event_op": "free",
                                "reason": "details"}
    assert error["subject"] == stored[0]["subject"]  # pseudonyms, as for any record
    assert 'kvguard_ingest_events_refused_total{reason="details"} 1.0' in metrics
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1 and "event 1 (op free)" in logged[0].getMessage()
    text = caplog.text + (tmp_path / "serve.log").read_text()
    assert "raw-user-4411" not in text and "raw-session-4411" not in text


def test_a_refused_batch_is_kept_logged_once_and_sent_again(tmp_path, caplog):
    server = start_server(tmp_path, f"sqlite:///{tmp_path / 'audit.db'}")
    cache = CacheManager(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=32, num_pages=16, page_size=4))
    client = SidecarClient(cache, socket=server.socket, token="kvg_" + "x" * 43, interval_s=0.01)
    try:
        with caplog.at_level(logging.INFO, logger="kvguard.client"):
            cache.events.emit(SequenceFreed(1, Subject("acme", "raw-user-4411", "s"), ("hot:0",), 4, 0))
            client.start()
            assert not client.flush(1.5)  # a few retries, each answered 401
            assert client.pending == 1 and client.last_error.startswith("the sidecar answered 401")
            client._http.headers["Authorization"] = f"Bearer {server.tokens['ingest']}"
            assert client.flush(30) and client.last_error is None
        assert len(records(server, "free")) == 1
        with server.client("ingest") as c:  # what no record can hold is refused, not a 500
            subject = {"tenant": "acme", "user": "u", "session": "s"}
            for bad in ({"n": 0, "op": "free", "subject": {**subject, "user": "a\x00b"}},  # the pseudonyms' separator
                        {"n": 2**53, "op": "free", "subject": subject, "details": {"email": "x"}}):  # over 2**53 - 1
                assert c.post("/internal/v1/events", json={"client": "p", "instance": "c" * 16,
                                                           "events": [bad]}).status_code == 422
        with server.client("audit:read") as c:
            metrics = c.get("/metrics").text
        assert 'kvguard_ingest_batches_refused_total{status="401"}' in metrics
        assert 'kvguard_ingest_batches_refused_total{status="422"}' in metrics
    finally:
        client.close()
        server.stop()
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(logged) == 2 and logged[0][0] == logging.ERROR and "401" in logged[0][1]  # once, not per retry
    assert logged[1] == (logging.WARNING, "the sidecar records events again (0 pending)")
    assert "raw-user-4411" not in caplog.text


def small_cache() -> CacheManager:
    return CacheManager(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=32, num_pages=16, page_size=4))


def test_a_client_restarted_under_the_same_id_has_every_event_recorded(tmp_path, db_url):
    server = start_server(tmp_path, db_url)
    try:
        for run, n in enumerate((5, 3)):  # the second run numbers its events from 0 again
            cache = small_cache()
            with SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], client_id="fixed-proc",
                               interval_s=0.01) as client:
                for i in range(n):
                    cache.events.emit(SequenceFreed(i, Subject("acme", f"u{run}", "s"), (f"hot:{i}",), 4, 0))
                assert client.flush(30)
        stored = records(server, "free")
    finally:
        server.stop()
    assert [r["details"]["seq"] for r in stored] == [0, 1, 2, 3, 4, 0, 1, 2]
    runs = [r["details"]["process"] for r in stored]
    assert len(set(runs)) == 2 and all(p.startswith("fixed-proc/") for p in runs)  # one instance per run


def test_two_processes_sharing_an_id_each_record_and_each_erase(tmp_path, db_url):
    server = start_server(tmp_path, db_url)
    caches = [small_cache(), small_cache()]
    clients = [SidecarClient(cache, socket=server.socket, token=server.tokens["ingest"], client_id="shared-proc",
                             interval_s=0.01).start() for cache in caches]
    try:
        for i, (cache, client) in enumerate(zip(caches, clients)):
            seq = client.open(Subject("acme", "alice", f"s-{i}"))
            k = torch.randn(8, 1, 32).half()
            assert cache.append(seq, 0, k, k)
            for j in range(2):
                cache.events.emit(SequenceFreed(j, Subject("acme", "bob", "s"), (f"hot:{j}",), 4, 0))
            assert client.flush(30)  # the first has recorded events 0 and 1 before the second sends its own
        assert len(records(server, "free")) == 4
        with server.client("erasure:write") as c:
            r = c.post("/v1/erasure-requests", json={"tenant": "acme", "user": "alice", "legal_basis": "gdpr-art17"},
                       headers={"Idempotency-Key": "shared-id-erasure"})
        done = wait_state(server, r.json()["id"])
        assert len(done["result"]["processes"]) == 2  # each process received the command and acknowledged
        assert [cache.sequences() for cache in caches] == [[], []]
        assert all(len(client.erasures) == 1 for client in clients)
    finally:
        for client in clients:
            client.close()
        server.stop()


def test_a_client_id_belongs_to_the_token_that_registered_it(tmp_path):
    server = start_server(tmp_path, f"sqlite:///{tmp_path / 'audit.db'}")
    other_token = kvguard(["token", "create", "--scope", "ingest", "--name", "other-pod"], server.env)
    mine = {"client": "pod-a", "instance": "a" * 16}
    try:
        with server.client("ingest") as owner, server.ingest(None) as other:
            other.headers["Authorization"] = f"Bearer {other_token}"
            assert owner.post("/internal/v1/events", json={**mine, "events": []}).status_code == 200
            with server.client("erasure:write") as c:
                c.post("/v1/erasure-requests", json={"tenant": "acme", "user": "alice", "legal_basis": "gdpr-art17"},
                       headers={"Idempotency-Key": "owned-id-1"}).raise_for_status()
            # the other token can neither read pod-a's commands (raw subject ids), nor acknowledge one
            # in its name, nor send events as pod-a, under its instance or a new one
            for instance in (mine["instance"], "b" * 16):
                as_pod_a = {"client": "pod-a", "instance": instance}
                for r in (other.get("/internal/v1/commands", params={**as_pod_a, "wait": 0}),
                          other.post(f"/internal/v1/commands/{uuid.uuid4().hex}/ack",
                                     json={**as_pod_a, "result": {"pages": 0}}),
                          other.post("/internal/v1/events", json={**as_pod_a, "events": []})):
                    assert r.status_code == 403 and "in use by another ingest token" in r.json()["detail"]
                    assert "alice" not in r.text
            # the owner still gets its command, and the other token works under an id of its own
            commands = owner.get("/internal/v1/commands", params={**mine, "wait": 5}).json()
            assert [c["target"] for c in commands] == ["alice"]
            assert other.post("/internal/v1/events", json={"client": "pod-b", "instance": "b" * 16,
                                                           "events": []}).status_code == 200
    finally:
        server.stop()


def test_a_token_bound_to_tenants_sends_their_events_only(tmp_path, db_url):
    server = start_server(tmp_path, db_url)
    acme = kvguard(["token", "create", "--scope", "ingest", "--name", "acme-pods", "--tenant", "acme",
                    "--tenant", "acme-eu"], server.env)
    event = {"n": 0, "op": "free", "subject": {"tenant": "acme", "user": "alice", "session": "s"},
             "details": {"seq": 0, "pages": ["hot:0"], "n_tokens": 4, "bytes": 0}}
    globex = {**event, "n": 1, "subject": {**event["subject"], "tenant": "globex"}}
    try:
        with server.ingest(None) as c:
            c.headers["Authorization"] = f"Bearer {acme}"
            pod = {"client": "acme-pod", "instance": "a" * 16}
            r = c.post("/internal/v1/events", json={**pod, "events": [event, globex]})
            assert r.status_code == 403 and "not among this ingest token's tenants" in r.json()["detail"]
            assert "globex" not in r.text and "alice" not in r.text
            r = c.post("/internal/v1/events", json={**pod, "events": [], "sessions": [
                {"subject": globex["subject"], "opened_ms": 1}]})
            assert r.status_code == 403
            assert records(server, "free") == []  # nothing of a refused batch was recorded
            r = c.post("/internal/v1/events", json={**pod, "events": [event]})
            assert r.status_code == 200 and r.json()["recorded"] == 1
        # the token row keeps keyed indexes, not the tenants' names
        with sa.create_engine(db_url).connect() as conn:
            (tenants,) = conn.execute(sa.text("SELECT tenants FROM api_tokens WHERE name = 'acme-pods'")).one()
        assert len(tenants.split()) == 2 and "acme" not in tenants
        for bad in (["--scope", "admin", "--tenant", "acme"], ["--scope", "ingest", "--scope", "audit:read",
                                                              "--tenant", "acme"]):
            r = subprocess.run([sys.executable, "-m", "kvguard", "token", "create", *bad], env=server.env,
                               capture_output=True, text=True, cwd=ROOT)
            assert r.returncode != 0 and "only an ingest token can be bound to tenants" in r.stderr
    finally:
        server.stop()
