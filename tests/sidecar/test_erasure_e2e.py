"""The sidecar and a real inference process, over SQLite and PostgreSQL: erase a user
while another keeps decoding, and check what is left everywhere."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kvguard.audit.keys import PublicKey
from kvguard.audit.pseudonym import Pseudonymizer, load_index_key
from kvguard.audit.receipt import verify_receipt
from kvguard.audit.store import AuditStore

from kvguard.cache import CacheManager
from tests.sidecar import client_proc
from tests.sidecar.conftest import ROOT

RAW_IDS = ["alice-raw-id-7f3a", "alice-session-1", "alice-session-2", "bob-raw-id-22c1", "bob-session-1"]


class Proc:
    """The inference process, driven line by line."""

    def __init__(self, server, tmp: Path, wait: bool = True):
        self.redis_prefix = f"kvguard-test:{uuid.uuid4().hex[:8]}:"
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.sidecar.client_proc", str(server.socket), server.tokens["ingest"],
             str(tmp), self.redis_prefix], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if wait:  # else the caller reads the ready line (to start several processes at once)
            assert self.read()["ready"]

    def read(self) -> dict:
        line = self.p.stdout.readline()
        assert line, "the inference process exited"
        return json.loads(line)

    def send(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(30)


def wait_state(server, request_id: str, state: str = "completed", timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    with server.client("erasure:read") as c:
        while time.monotonic() < deadline:
            body = c.get(f"/v1/erasure-requests/{request_id}").json()
            if body["state"] == state:
                return body
            time.sleep(0.2)
    raise AssertionError(f"request {request_id} stayed {body['state']}: {body.get('error')}")


def bob_alone(steps: int) -> str:
    """Bob's outputs when nothing else ever shared the cache."""
    cache = CacheManager(_plain_config())
    runner = client_proc.Runner(cache, None)
    from kvguard.types import Subject

    runner.open("bob", Subject("acme", "bob-raw-id-22c1", "bob-session-1"), 64)
    for _ in range(steps - 64):
        runner.step("bob")
    return runner.digest["bob"].hexdigest()


def _plain_config():
    from kvguard.cache import CacheConfig

    return CacheConfig(num_layers=client_proc.LAYERS, num_kv_heads=client_proc.HEADS,
                       num_query_heads=client_proc.QHEADS, head_dim=client_proc.DIM, num_pages=256,
                       codec="int8", fp_sink=4)


def database_dump(db_url: str) -> bytes:
    if db_url.startswith("sqlite"):
        path = db_url.removeprefix("sqlite:///")
        con = sqlite3.connect(path)
        text = "\n".join(con.iterdump()).encode()
        con.close()
        raw = b"".join(Path(p).read_bytes() for p in (path, path + "-wal") if Path(p).exists())
        return text + raw
    name = db_url.rsplit("/", 1)[1]
    return subprocess.run(["pg_dump", "-h", "127.0.0.1", "-U", "postgres", name], check=True,
                          capture_output=True).stdout


def test_erase_a_user_while_another_decodes(server, tmp_path):
    proc = Proc(server, tmp_path)
    try:
        proc.send("decode 5")
        assert proc.send("offload")["offloaded"] == {"disk": 2, "redis": 1}
        body = {"tenant": "acme", "user": "alice-raw-id-7f3a", "legal_basis": "gdpr-art17",
                "reason": "data subject request"}
        with server.client("erasure:write") as c:
            r = c.post("/v1/erasure-requests", json=body, headers={"Idempotency-Key": "ticket-4711-a"})
            assert r.status_code == 202, r.text
            request_id = r.json()["id"]
            # the deadline: one month from receipt
            assert r.json()["deadline_ms"] - r.json()["received_ms"] == 30 * 86_400_000
            proc.send("decode 20 bob")  # bob keeps decoding while alice's pages sit in the lower tiers
            done = wait_state(server, request_id)
            again = c.post("/v1/erasure-requests", json=body, headers={"Idempotency-Key": "ticket-4711-a"})
            assert again.status_code == 200 and again.json()["id"] == request_id
        proc.send("decode 3")
        report = proc.send("report")
    finally:
        proc.close()

    # alice is gone from the process: sequences, device pages (overwritten), disk and Redis tiers
    assert report["open"] == ["bob"]
    assert report["alice_residue_bytes"] == 0
    assert report["disk_pages"] == [] and report["redis_pages"] == []
    erased = report["erasures"][0]
    assert erased["sequences"] == 2 and erased["pages"] > 0 and erased["tier_copies"] == 3
    # bob was not touched: bit for bit what he computes alone
    assert report["bob_digest"] == bob_alone(report["bob_pos"])

    # what the request says, and its receipt verifying offline with the public key alone
    (process, acked), = done["result"]["processes"].items()  # one process: its id and this run's instance
    assert process.startswith("test-proc/") and acked["sequences"] == 2
    receipt = done["receipt"]["receipts"][0]  # the fleet receipt of a one-sidecar fleet
    with server.client("audit:read") as c:
        keys = c.get("/v1/audit/public-keys").json()
    verify_receipt(receipt, PublicKey.from_text(keys[0]["public_key_pem"]))
    record = receipt["record"]
    assert record["op"] == "erase" and record["subject"]["user"] == done["subject_pseudonym"]
    assert record["details"]["request"] == request_id and record["details"]["tier_copies_erased"] == 3

    # crypto-shredding: the pseudonym secret is gone; no raw id anywhere in the database
    store = AuditStore(server.db_url)
    pseudonyms = Pseudonymizer(store, load_index_key(server.data_dir / "index.key"))
    assert pseudonyms.existing("user", "alice-raw-id-7f3a", tenant="acme") is None
    assert pseudonyms.existing("session", "alice-session-1", tenant="acme") is None
    store.dispose()
    dump = database_dump(server.db_url)
    for raw in RAW_IDS + ["data subject request", server.tokens["admin"]]:
        assert raw.encode() not in dump, f"{raw} found in the database"
    # nor in the sidecar's log
    server.stop()
    logged = (server.data_dir.parent / "serve.log").read_bytes()
    for raw in RAW_IDS + list(server.tokens.values()):
        assert raw.encode() not in logged, f"{raw} found in the log"


def test_bad_erasure_requests_are_refused(server):
    with server.client("erasure:write") as c:
        ok = {"tenant": "acme", "user": "u", "legal_basis": "gdpr-art17"}
        assert c.post("/v1/erasure-requests", json=ok).status_code == 422  # no Idempotency-Key
        for bad in ({**ok, "session": "s"}, {"tenant": "acme", "legal_basis": "gdpr-art17"},
                    {**ok, "legal_basis": "because"}, {**ok, "extra": 1}, {**ok, "tenant": ""}):
            r = c.post("/v1/erasure-requests", json=bad, headers={"Idempotency-Key": uuid.uuid4().hex})
            assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", bad
        r = c.post("/v1/erasure-requests", content=b"{not json", headers={"Idempotency-Key": "k" * 10,
                                                                            "Content-Type": "application/json"})
        assert r.status_code == 422
        pipl = c.post("/v1/erasure-requests", json={**ok, "legal_basis": "pipl-art47"},
                      headers={"Idempotency-Key": "pipl-000001"}).json()
        assert pipl["deadline_ms"] - pipl["received_ms"] == 72 * 3_600_000
    with server.client("erasure:read") as c:
        assert c.get("/v1/erasure-requests/nope").status_code == 404


def test_interrupted_erasure_resumes_after_a_crash(tmp_path, db_url):
    from tests.sidecar.conftest import start_server

    server = start_server(tmp_path, db_url)
    try:
        # a process that receives the command but never acknowledges it
        with server.client("ingest") as ingest, server.client("erasure:write") as c:
            mute = {"client": "mute", "instance": "0123456789abcdef"}
            ingest.post("/internal/v1/events", json={**mute, "events": []}).raise_for_status()
            r = c.post("/v1/erasure-requests", json={"tenant": "t", "session": "s-1", "legal_basis": "pipl-art47"},
                       headers={"Idempotency-Key": "crash-test-1"})
            request_id = r.json()["id"]
            assert ingest.get("/internal/v1/commands", params={**mute, "wait": 5}).json()
        wait_state(server, request_id, "executing")
        server.proc.kill()  # kill -9 mid-erasure
        server.proc.wait(10)
    finally:
        server.stop()
    restarted = start_server(tmp_path, db_url, tokens=server.tokens,
                             extra_env={"KVGUARD_ORIGIN": server.env["KVGUARD_ORIGIN"]})
    try:
        done = wait_state(restarted, request_id)
        assert done["receipt"]["receipts"][0]["record"]["details"]["request"] == request_id
        # the mute process never came back: the request says that no process erased anything
        assert done["result"]["no_process_acknowledged"] is True and done["result"]["processes"] == {}
        with restarted.client("audit:read") as c:
            erases = c.get("/v1/audit/records", params={"op": "erase"}).json()["records"]
        assert [e["details"]["request"] for e in erases] == [request_id]  # recorded once
    finally:
        restarted.stop()
