"""A fleet on one PostgreSQL database: three `kvguard serve` processes (three origins), each
with two real inference processes holding pages of several users. One request posted to one
sidecar reaches all six processes; a sidecar killed mid-erasure carries out its part when it
comes back; a process that never answers holds up only the requests that need it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from kvguard.audit.errors import VerificationError
from kvguard.audit.keyring import Keyring
from kvguard.audit.keys import PublicKey
from kvguard.audit.pseudonym import Pseudonymizer, load_index_key
from kvguard.audit.receipt import verify_fleet_receipt
from kvguard.audit.store import AuditStore

from tests.sidecar.conftest import ROOT, kvguard, start_server
from tests.sidecar.test_erasure_e2e import Proc

# fast heartbeats, so that a stopped sidecar is down within seconds
FLEET_ENV = {"KVGUARD_FLEET_HEARTBEAT_S": "0.5", "KVGUARD_FLEET_DEADLINE_S": "2"}
ALICE = {"tenant": "acme", "user": "alice-raw-id-7f3a", "legal_basis": "gdpr-art17"}
# one worker builds the fleet once for every test of this file (a fleet is three sidecars and six
# processes); each test still checks only what its own erasure did
pytestmark = pytest.mark.xdist_group("fleet")


SCOPES = ("admin", "ingest", "erasure:write", "erasure:read", "audit:read")


def provision(tmp: Path, db_url: str, n: int) -> dict[str, str]:
    """What an operator does once for a fleet, in process (no command per step): the schema,
    the shared index and seal keys in every sidecar's data directory, and the tokens."""
    import secrets

    from kvguard.audit.keys import write_private_file
    from kvguard.audit.store import make_engine, migrate
    from sqlalchemy.orm import Session

    from kvguard.sidecar.auth import create_token

    migrate(db_url)
    shared = {name: secrets.token_bytes(32).hex().encode() + b"\n" for name in ("index.key", "seal.key")}
    for i in range(n):
        data = tmp / f"s{i}" / "data"
        data.mkdir(parents=True, mode=0o700)
        for name, content in shared.items():
            write_private_file(data / name, content)
    engine = make_engine(db_url)
    try:
        with Session(engine) as db:
            return {scope: create_token(db, scope.replace(":", "-"), [scope]) for scope in SCOPES}
    finally:
        engine.dispose()


class Fleet:
    def __init__(self, tmp: Path, db_url: str):
        self.tmp, self.db_url = tmp, db_url
        self.tokens = provision(tmp, db_url, 3)
        with ThreadPoolExecutor(3) as pool:
            self.servers = list(pool.map(lambda i: start_server(tmp / f"s{i}", db_url, tokens=self.tokens,
                                                                extra_env=FLEET_ENV), range(3)))
        self.procs: list[list[Proc]] = []
        for i, s in enumerate(self.servers):  # two inference processes per sidecar, started at once
            self.procs.append([Proc(s, self._proc_dir(i, j), wait=False) for j in range(2)])
        for p in self.all_procs():
            assert p.read()["ready"]

    def _proc_dir(self, i: int, j: int) -> Path:
        d = self.tmp / f"s{i}" / f"proc{j}"
        d.mkdir()
        return d

    def all_procs(self) -> list[Proc]:
        return [p for procs in self.procs for p in procs]

    def origins(self) -> list[str]:
        return [s.env["KVGUARD_ORIGIN"] for s in self.servers]

    def public_keys(self) -> list[PublicKey]:
        keys = []
        for s in self.servers:
            with s.client("audit:read") as c:
                keys += [PublicKey.from_text(k["public_key_pem"]) for k in c.get("/v1/audit/public-keys").json()]
        return keys

    def erase_records(self, request_id: str) -> dict[str, list[dict]]:
        """Each origin's signed erase records of the request (not its processes' own erase events)."""
        out = {}
        for s in self.servers:
            with s.client("audit:read") as c:
                records = c.get("/v1/audit/records", params={"op": "erase", "limit": 1000}).json()["records"]
            out[s.env["KVGUARD_ORIGIN"]] = [r for r in records if r["details"].get("request") == request_id]
        return out

    def close(self) -> None:
        for p in self.all_procs():  # nothing of theirs is checked any more: no clean goodbye needed
            p.p.kill()
        for s in self.servers:
            if s.proc.poll() is None:
                s.proc.terminate()
        for s in self.servers:
            s.stop()
        for p in self.all_procs():
            p.p.wait(10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, pg_database):
    f = Fleet(tmp_path_factory.mktemp("fleet"), pg_database)
    yield f
    f.close()


def post(server, body: dict) -> str:
    with server.client("erasure:write") as c:
        r = c.post("/v1/erasure-requests", json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def get(server, request_id: str) -> dict:
    with server.client("erasure:read") as c:
        return c.get(f"/v1/erasure-requests/{request_id}").json()


def wait_for(server, request_id: str, done, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = get(server, request_id)
        if done(body):
            return body
        time.sleep(0.1)
    raise AssertionError(f"request {request_id} is still {body['state']}: {json.dumps(body['result'])}")


def completed(body: dict) -> bool:
    return body["state"] == "completed"


# --- (1) one request, every process of the fleet, one fleet receipt --------------------------------

def test_one_request_erases_the_user_in_every_process_of_the_fleet(fleet, tmp_path):
    rid = post(fleet.servers[0], {**ALICE, "reason": "data subject request"})
    done = wait_for(fleet.servers[1], rid, completed)  # any sidecar answers for the request
    reports = [p.send("report") for p in fleet.all_procs()]
    for r in reports:  # alice is gone from all six processes; bob is untouched
        assert r["open"] == ["bob"] and r["alice_residue_bytes"] == 0
        assert [e["sequences"] for e in r["erasures"]] == [2]

    origins = sorted(fleet.origins())
    result = done["result"]
    assert sorted(result["origins"]) == origins and result["pending_origins"] == []
    assert all(len(result["origins"][o]["processes"]) == 2 for o in origins)
    assert len(result["processes"]) == 6 and result["no_process_acknowledged"] is False

    # one erase record per origin, each stating its own two processes and the same fleet
    records = fleet.erase_records(rid)
    assert sorted(o for o, rs in records.items() if rs) == origins
    assert all(len(rs) == 1 for rs in records.values())
    for (record,) in records.values():
        assert len(record["details"]["processes"]) == 2
        assert record["details"]["fleet"] == {"origins": origins, "excluded": []}

    # the shredding happened once: the user's and her two sessions' secrets, stated by every record
    assert result["secrets_destroyed"] == 3
    assert {rs[0]["details"]["secrets_destroyed"] for rs in records.values()} == {3}
    store = AuditStore(fleet.db_url)
    keyring = Keyring(fleet.servers[0].env["KVGUARD_KEK_DIR"], store)  # the fleet's shared KEK directory
    pseudonyms = Pseudonymizer(store, load_index_key(fleet.servers[0].data_dir / "index.key"), keyring)
    for scope, raw in (("user", "alice-raw-id-7f3a"), ("session", "alice-session-1"), ("session", "alice-session-2")):
        assert pseudonyms.existing(scope, raw, tenant="acme") is None
    assert pseudonyms.existing("session", "bob-session-1", tenant="acme") is not None
    store.dispose()

    # the fleet receipt verifies offline with the fleet's public keys: the command line...
    receipt_file = tmp_path / "request.json"
    receipt_file.write_text(json.dumps(done))
    key_files = []
    for i, key in enumerate(fleet.public_keys()):
        key_files += ["--public-key", str(tmp_path / f"k{i}.pub")]
        (tmp_path / f"k{i}.pub").write_text(key.to_pem())
    cmd = [sys.executable, "-m", "kvguard", "audit", "verify-receipt", str(receipt_file)]
    ok = subprocess.run(cmd + key_files, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert ok.returncode == 0 and "3 erase record(s)" in ok.stdout, ok.stdout + ok.stderr
    short = subprocess.run(cmd + key_files[:4], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert short.returncode == 1 and "check      key" in short.stdout  # one origin's key missing
    # ... and in process: a receipt with an origin left out, or a record changed, fails
    receipt = done["receipt"]
    assert [r.origin for r in verify_fleet_receipt(receipt, fleet.public_keys())] == origins
    with pytest.raises(VerificationError, match="do not match the fleet"):
        verify_fleet_receipt({**receipt, "receipts": receipt["receipts"][:2]}, fleet.public_keys())
    forged = json.loads(json.dumps(receipt))
    forged["receipts"][1]["record"]["details"]["pages_overwritten"] += 1
    with pytest.raises(VerificationError) as err:
        verify_fleet_receipt(forged, fleet.public_keys())
    assert err.value.check == "signature"


# --- (2) kill -9 of a sidecar mid-erasure ----------------------------------------------------------

def test_a_sidecar_killed_mid_erasure_carries_out_its_part_when_it_comes_back(fleet):
    victim = fleet.servers[2]
    origin = victim.env["KVGUARD_ORIGIN"]
    victim.proc.send_signal(signal.SIGSTOP)  # it cannot act on the request from here on
    try:
        rid = post(fleet.servers[0], {"tenant": "acme", "session": "bob-session-1", "legal_basis": "pipl-art47"})
        # the others erase; the request waits, naming the origin, which misses its heartbeats
        waiting = wait_for(fleet.servers[0], rid, lambda b: b["result"]["pending_origins"] == [origin]
                           and b["result"]["origins"][origin].get("sidecar_down"))
        assert waiting["state"] == "executing"
        assert {o: e["state"] for o, e in waiting["result"]["origins"].items() if o != origin} == {
            o: "erased" for o in fleet.origins() if o != origin}
        with fleet.servers[1].client("audit:read") as c:
            metrics = c.get("/metrics").text
        assert "kvguard_erasure_origins_overdue 1.0" in metrics
        assert 'kvguard_fleet_sidecars{state="down"} 1.0' in metrics
    finally:
        victim.proc.send_signal(signal.SIGKILL)  # kill -9 mid-erasure
        victim.proc.wait(10)
    # it comes back (same data directory, origin and port); its processes reconnect to it, and it
    # carries out the part it missed before /readyz says ready (start_server waits for that)
    fleet.servers[2] = start_server(victim.data_dir.parent, fleet.db_url, tokens=fleet.tokens,
                                    extra_env={**FLEET_ENV, "KVGUARD_ORIGIN": origin,
                                               "KVGUARD_PORT": victim.env["KVGUARD_PORT"]})
    assert get(fleet.servers[0], rid)["result"]["origins"][origin]["state"] != "pending"
    done = wait_for(fleet.servers[0], rid, completed)
    assert sorted(done["result"]["origins"]) == sorted(fleet.origins())
    for p in fleet.all_procs():  # bob's session is gone everywhere (alice's goes with the test before)
        assert "bob" not in p.send("report")["open"]
    records = fleet.erase_records(rid)
    assert {o: len(rs) for o, rs in records.items()} == dict.fromkeys(fleet.origins(), 1)  # each once
    verify_fleet_receipt(done["receipt"], fleet.public_keys())


# --- (3) a process that never answers ---------------------------------------------------------------

class MuteProcess:
    """An inference process bound to one tenant that takes its erase commands and never answers."""

    def __init__(self, server, token: str):
        self.client = server.ingest(token)
        self.ids = {"client": "mute", "instance": uuid.uuid4().hex[:16]}
        self.client.post("/internal/v1/events", json={**self.ids, "events": []}).raise_for_status()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self.stop.is_set():  # always waiting for commands: always live
            try:
                self.client.get("/internal/v1/commands", params={**self.ids, "wait": 2})
            except httpx.HTTPError:
                time.sleep(0.2)

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.client.close()


# a request held up by the mute process would wait out the 20 s it is given to answer (19.5 s after
# t0); the others take ~4 s on a quiet machine, ~7 s on a busy 2-CPU one
BOUND_S = 12.0


def test_a_process_that_never_answers_holds_up_only_the_requests_that_need_it(fleet, tmp_path):
    quiet_token = kvguard(["token", "create", "--scope", "ingest", "--name", "quiet", "--tenant", "quiet"],
                          fleet.servers[1].env)
    mute = MuteProcess(fleet.servers[1], quiet_token)
    try:
        stuck = post(fleet.servers[1], {"tenant": "quiet", "session": "q-1", "legal_basis": "pipl-art47"})
        time.sleep(0.5)  # its command is out, waiting for the mute process
        t0 = time.monotonic()
        others = [post(fleet.servers[i % 3], {"tenant": "acme", "session": f"s-{i}", "legal_basis": "pipl-art47"})
                  for i in range(3)]
        for rid in others:
            wait_for(fleet.servers[0], rid, completed, timeout=BOUND_S)
        took = time.monotonic() - t0
        print(f"3 requests completed in {took:.2f} s while another waited for a mute process")
        assert took < BOUND_S
        held = get(fleet.servers[0], stuck)
        assert held["state"] == "executing" and held["result"]["pending_origins"] == [
            fleet.servers[1].env["KVGUARD_ORIGIN"]]

        # the pod is gone for good: an operator closes the request without it, for a reason
        origin = fleet.servers[1].env["KVGUARD_ORIGIN"]
        excl = [sys.executable, "-m", "kvguard", "erasure", "exclude", stuck, origin]
        refused = subprocess.run(excl, env=fleet.servers[1].env, capture_output=True, text=True, cwd=ROOT)
        assert refused.returncode == 2 and "--reason" in refused.stderr
        kvguard([*excl[3:], "--reason", "node lost; pod deleted"], fleet.servers[1].env)
        done = wait_for(fleet.servers[0], stuck, completed)
        excluded = [{"origin": origin, "reason": "node lost; pod deleted"}]
        assert done["receipt"]["excluded"] == excluded
        assert done["result"]["origins"][origin] == {"state": "excluded", "processes": [],
                                                     "excluded_reason": "node lost; pod deleted"}
        records = fleet.erase_records(stuck)
        assert not records[origin] and all(len(rs) == 1 for o, rs in records.items() if o != origin)
        for o, rs in records.items():
            if o != origin:
                assert rs[0]["details"]["fleet"]["excluded"] == excluded
        verify_fleet_receipt(done["receipt"], fleet.public_keys())
    finally:
        mute.close()


def test_fleet_status_names_each_sidecar(fleet):
    out = kvguard(["fleet", "status"], fleet.servers[0].env)
    for origin in fleet.origins():
        assert origin in out and out.split(origin)[1].split()[0] == "live"
    gone = subprocess.run([sys.executable, "-m", "kvguard", "fleet", "remove", "test.kvguard/never-was"],
                          env=fleet.servers[0].env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert gone.returncode == 1 and "no sidecar test.kvguard/never-was" in gone.stderr
