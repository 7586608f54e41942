"""The erasure service in process, over SQLite and PostgreSQL: who must answer, what a bad
answer does, what the signed record says, and how a resumed request is recorded once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid

import pytest
from kvguard.audit.models import RecordRow, SubjectKey
from kvguard.audit.pseudonym import reason_hmac_of
from kvguard.audit.receipt import verify_receipt
from sqlalchemy import select

from kvguard.sidecar.erasure import ErasureService, NewRequest
from kvguard.sidecar.models import ErasureRequest
from kvguard.sidecar.retention import sweep
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.settings import Settings

GOOD = {"pages": 3, "bytes": 3072, "sequences": 1, "shared_pages": 0, "tier_copies": 1, "prefix_entries": 2}


@pytest.fixture
def make_sidecar(tmp_path, db_url, kek_dirs):
    made = []

    def make(**settings) -> Sidecar:
        s = Settings(environment="development", data_dir=tmp_path / "data", database_url=db_url,
                     kek_dir=kek_dirs(db_url),
                     origin=f"test.kvguard/{uuid.uuid4().hex[:8]}", audit_sign_process=False,
                     erasure_ack_timeout_s=5, **settings)
        made.append(Sidecar(s))
        return made[-1]

    yield make
    for sc in made:
        sc.close()


@pytest.fixture
def sidecar(make_sidecar) -> Sidecar:
    sc = make_sidecar()
    sc.registry.started -= sc.registry.live_s  # the start's reconnect window has passed
    return sc


def submit(service: ErasureService, session: str, tenant: str = "acme") -> str:
    row, new = service.create(NewRequest(tenant, None, session, "pipl-art47", None), uuid.uuid4().hex, "tester")
    assert new
    return row.id


def state(sc: Sidecar, request_id: str) -> ErasureRequest:
    with sc.db() as db:
        return db.get(ErasureRequest, request_id)


INSTANCE, TOKEN = "i-1", "token-1"  # the process's start and the ingest token it holds


async def inference_process(sc: Sidecar, client_id: str, answer, stop: asyncio.Event) -> None:
    """Polls for commands like a real process and answers each with answer(command)."""
    while not stop.is_set():
        for cmd in await sc.registry.take_commands(client_id, INSTANCE, TOKEN, 0.05):
            sc.registry.ack(client_id, INSTANCE, TOKEN, cmd["id"], answer(cmd))


async def with_process(sc: Sidecar, answer, body, client_id: str = "proc-a"):
    sc.registry.touch(client_id, INSTANCE, TOKEN)  # connected before the body starts
    stop = asyncio.Event()
    task = asyncio.create_task(inference_process(sc, client_id, answer, stop))
    try:
        return await body()
    finally:
        stop.set()
        await task


def erase_records(sc: Sidecar, request_id: str) -> list[dict]:
    out = []
    with sc.store.read() as conn:
        for (body,) in conn.execute(select(RecordRow.body).where(RecordRow.origin == sc.settings.origin,
                                                                 RecordRow.op == "erase")):
            record = json.loads(body)
            if record["details"].get("request") == request_id:
                out.append(record)
    return out


def test_the_loop_stops_when_cancelled_as_its_wait_ends(make_sidecar):
    """A cancel that comes in the tick the loop's wait ends (a wake-up just arrived) stops it:
    Python 3.11's asyncio.wait_for swallowed such a cancel, and a sidecar shutting down (or a
    test) waited for the loop for ever."""
    sc = make_sidecar()
    service = ErasureService(sc)

    async def main():
        sc.registry.start(asyncio.get_running_loop())
        loop_task = asyncio.create_task(service.run_forever())
        await asyncio.sleep(0.5)  # its first round done: waiting for a wake-up
        service._note(None)
        await asyncio.sleep(0)  # the wait ends in this tick
        loop_task.cancel()
        stopped, _ = await asyncio.wait([loop_task], timeout=5)
        return bool(stopped)

    assert asyncio.run(main())


# --- (1) who must answer --------------------------------------------------------------------------

def test_after_a_start_erasures_wait_for_processes_to_reconnect(make_sidecar):
    sc = make_sidecar(inference_live_s=1.5)
    service = ErasureService(sc)
    rid = submit(service, "s-1")

    async def main():
        sc.registry.start(asyncio.get_running_loop())
        loop_task = asyncio.create_task(service.run_forever())
        await asyncio.sleep(0.3)  # the process reconnects some time after the start

        async def body():
            deadline = time.monotonic() + 20
            while state(sc, rid).state != "completed" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

        await with_process(sc, lambda cmd: GOOD, body)
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)

    asyncio.run(main())
    done = state(sc, rid)
    assert done.state == "completed", done.error
    result = json.loads(done.result_json)
    assert list(result["processes"]) == ["proc-a/i-1"] and result["no_process_acknowledged"] is False
    details = json.loads(done.receipt_json)["receipts"][0]["record"]["details"]
    assert details["processes"] == ["proc-a/i-1"] and details["no_process_acknowledged"] is False
    assert details["process_erasures"] == [{"process": "proc-a/i-1", **GOOD}]


def test_an_erasure_without_any_live_process_says_so(sidecar):
    service = ErasureService(sidecar)
    rid = submit(service, "s-1")
    asyncio.run(service.run_pending())
    done = state(sidecar, rid)
    assert done.state == "completed"
    result = json.loads(done.result_json)
    assert result["processes"] == {} and result["no_process_acknowledged"] is True
    assert "no inference process" in result["notice"]
    receipt = json.loads(done.receipt_json)["receipts"][0]
    verify_receipt(receipt, sidecar.key.public_key)
    details = receipt["record"]["details"]  # the signed record says it too
    assert details["processes"] == [] and details["process_erasures"] == []
    assert details["no_process_acknowledged"] is True and details["pages_overwritten"] == 0


def test_a_guessed_reason_cannot_be_confirmed_once_the_subject_is_shredded(sidecar):
    service = ErasureService(sidecar)
    reason = "asked by alice.smith@example.com on the phone"
    row, _ = service.create(NewRequest("acme", "alice", None, "gdpr-art17", reason), uuid.uuid4().hex, "tester")
    # while alice's secret exists, her reason is an HMAC under it (which is what shredding destroys)
    assert row.reason_hmac == sidecar.pseudonyms.reason_hmac("user", "alice", reason, tenant="acme")
    asyncio.run(service.run_pending())
    assert state(sidecar, row.id).state == "completed"
    (record,) = erase_records(sidecar, row.id)
    details = record["details"]
    assert details["legal_basis"] == "gdpr-art17" and details["reason_hmac"] == row.reason_hmac
    assert "reason_sha256" not in details
    digest = hashlib.sha256(reason.encode()).hexdigest()  # the old, unkeyed form confirms a guess
    with sidecar.store.read() as conn:
        bodies = "".join(conn.scalars(select(RecordRow.body)))
        requests = [str(tuple(r)) for r in conn.execute(select(ErasureRequest.__table__))]
    assert digest not in bodies and not any(digest in r or reason in r for r in requests)
    # the attacker holds the database, the index key and every key-encryption key, and tries
    # the right guess under every secret left: none confirms it
    guesses = [reason, "asked by alice.smith@example.com", "data subject request"]
    with sidecar.store.read() as conn:
        rows = conn.execute(select(SubjectKey.idx, SubjectKey.kek_id, SubjectKey.secret)).all()
    secrets_left = [sidecar.keyring.unwrap(bytes(i), k, bytes(b)) for i, k, b in rows]
    assert secrets_left  # acme's own secret (the tenant) is still there
    assert all(reason_hmac_of(sec, g) != details["reason_hmac"] for sec in secrets_left for g in guesses)
    # asking again for alice makes a fresh secret: an unrelated HMAC
    assert sidecar.pseudonyms.reason_hmac("user", "alice", reason, tenant="acme") != details["reason_hmac"]


def test_a_process_whose_token_is_bound_to_other_tenants_never_sees_the_command(sidecar):
    """Erase commands carry raw ids: only processes that may hold the tenant's data get them."""
    service = ErasureService(sidecar)
    rid = submit(service, "s-1", tenant="acme")
    bound = {"proc-any": None, "proc-acme": frozenset({sidecar.tenant_index("acme")}),
             "proc-globex": frozenset({sidecar.tenant_index("globex")})}
    seen: dict[str, list[str]] = {name: [] for name in bound}

    async def main():
        for name, tenants in bound.items():  # each process under a token of its own
            sidecar.registry.touch(name, INSTANCE, f"token-{name}", tenants)

        async def process(name: str, stop: asyncio.Event):
            while not stop.is_set():
                for cmd in await sidecar.registry.take_commands(name, INSTANCE, f"token-{name}", 0.05,
                                                                bound[name]):
                    seen[name].append(cmd["tenant"])
                    sidecar.registry.ack(name, INSTANCE, f"token-{name}", cmd["id"], GOOD)

        stop = asyncio.Event()
        tasks = [asyncio.create_task(process(name, stop)) for name in bound]
        await service.run_pending()
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    done = state(sidecar, rid)
    assert done.state == "completed", done.error
    assert sorted(json.loads(done.result_json)["processes"]) == ["proc-acme/i-1", "proc-any/i-1"]
    assert seen == {"proc-any": ["acme"], "proc-acme": ["acme"], "proc-globex": []}


# --- (2) bad answers, bad requests ----------------------------------------------------------------

@pytest.mark.parametrize("bad", [{**GOOD, "pages": "x"}, {**GOOD, "pages": -1}, {**GOOD, "bytes": 2**53},
                                 {**GOOD, "tier_copies": True}, {**GOOD, "pages": 1.0}, {"pages": 3}])
def test_a_bad_acknowledgement_counts_as_none_and_blocks_no_other_request(sidecar, bad):
    service = ErasureService(sidecar)
    bad_rid, good_rid = submit(service, "s-bad"), submit(service, "s-good")
    with sidecar.db() as db:
        targets = {rid: sidecar.unseal(db.get(ErasureRequest, rid).sealed_subject)["target"]
                   for rid in (bad_rid, good_rid)}
    answer = lambda cmd: bad if cmd["target"] == targets[bad_rid] else GOOD  # noqa: E731
    asyncio.run(with_process(sidecar, answer, service.run_pending))
    assert state(sidecar, good_rid).state == "completed"
    failed = state(sidecar, bad_rid)
    assert failed.state == "received" and failed.attempts == 1  # retried
    assert "invalid acknowledgement" in failed.error
    assert erase_records(sidecar, bad_rid) == []  # nothing signed for it
    assert json.loads(failed.result_json)["processes"] == {}


def test_a_request_that_raises_is_counted_failed_and_the_others_run(sidecar):
    service = ErasureService(sidecar)
    broken, fine = submit(service, "s-broken"), submit(service, "s-fine")
    with sidecar.db() as db:  # its sealed ids no longer decrypt (e.g. the seal key was replaced)
        row = db.get(ErasureRequest, broken)
        row.sealed_subject = row.sealed_subject[:-1] + bytes([row.sealed_subject[-1] ^ 1])
        db.commit()
    for attempt in (1, 2, 3):
        asyncio.run(with_process(sidecar, lambda cmd: GOOD, service.run_pending))
        assert state(sidecar, fine).state == "completed"
        row = state(sidecar, broken)
        assert row.attempts == attempt and row.error == "the attempt raised InvalidTag"
        assert row.state == ("failed" if attempt == 3 else "received")
    asyncio.run(service.run_pending())
    assert state(sidecar, broken).attempts == 3  # failed: not tried again


# --- (3) retention, every time a session expires ----------------------------------------------------

def test_retention_erases_a_reused_session_again_and_renews_a_failed_request(make_sidecar):
    sc = make_sidecar(retention_max_age_s=1)
    service = ErasureService(sc)
    proc = sc.registry.touch("proc-a", INSTANCE, TOKEN)
    now = time.time_ns() // 1_000_000
    proc.sessions = {("bank", "u-1", "s-1"): now - 5_000}
    assert sweep(sc, service) == 1
    assert sweep(sc, service) == 0  # the same expiry: the same request
    with sc.db() as db:
        first = db.scalar(select(ErasureRequest).where(ErasureRequest.origin == sc.settings.origin))
        first.state = "completed"
        db.commit()
    proc.sessions = {("bank", "u-2", "s-1"): now - 2_000}  # the id opened again, expired again
    assert sweep(sc, service) == 1
    with sc.db() as db:
        rows = db.scalars(select(ErasureRequest).where(ErasureRequest.origin == sc.settings.origin,
                                                       ErasureRequest.id != first.id)).all()
        assert len(rows) == 1 and rows[0].subject_pseudonym == first.subject_pseudonym
        rows[0].state, rows[0].attempts = "failed", 3
        db.commit()
        second = rows[0].id
    assert sweep(sc, service) == 1  # still held: a failed request is replaced, not left
    with sc.db() as db:
        states = {r.id: r.state for r in db.scalars(select(ErasureRequest).where(
            ErasureRequest.origin == sc.settings.origin))}
    assert len(states) == 3 and states[second] == "failed" and states[first.id] == "completed"


# --- (4) the signed record attests the shred, and is written once ----------------------------------

def test_the_signed_record_counts_the_destroyed_secrets(sidecar):
    service = ErasureService(sidecar)
    sidecar.ingest.subject({"tenant": "acme", "user": "u-9", "session": "s-9"}, {})  # seen with a session
    row, _ = service.create(NewRequest("acme", "u-9", None, "gdpr-art17", None), uuid.uuid4().hex, "tester")
    asyncio.run(with_process(sidecar, lambda cmd: GOOD, service.run_pending))
    done = state(sidecar, row.id)
    assert done.state == "completed"
    assert json.loads(done.result_json)["secrets_destroyed"] == 2  # the user's and the session's
    details = json.loads(done.receipt_json)["receipts"][0]["record"]["details"]
    assert details["secrets_destroyed"] == 2
    assert len(details["shredded"]) == 2  # their shred tags, which `kvguard audit check` matches
    assert sidecar.pseudonyms.existing("user", "u-9", tenant="acme") is None


def test_a_crash_after_the_record_is_signed_does_not_sign_a_second_one(sidecar, monkeypatch):
    service = ErasureService(sidecar)
    rid = submit(service, "s-1")
    append = sidecar.log.append

    def append_then_crash(*args, **kwargs):
        append(*args, **kwargs)
        raise SystemExit("killed before the record's sequence number was saved")

    monkeypatch.setattr(sidecar.log, "append", append_then_crash)
    with pytest.raises(SystemExit):
        asyncio.run(with_process(sidecar, lambda cmd: GOOD, lambda: service.execute(rid)))
    monkeypatch.setattr(sidecar.log, "append", append)
    assert state(sidecar, rid).record_seq is None and state(sidecar, rid).state == "executing"
    restarted = ErasureService(sidecar)
    asyncio.run(with_process(sidecar, lambda cmd: GOOD, restarted.run_pending))
    done = state(sidecar, rid)
    assert done.state == "completed"
    records = erase_records(sidecar, rid)
    assert len(records) == 1 and json.loads(done.receipt_json)["receipts"][0]["record"] == records[0]
    # what the first attempt did is what the record says, not what the resumed one found left
    assert records[0]["details"]["pages_overwritten"] == GOOD["pages"]
    assert records[0]["details"]["secrets_destroyed"] == 1


def test_a_resumed_request_signs_what_every_attempt_did(sidecar, monkeypatch):
    service = ErasureService(sidecar)
    rid = submit(service, "s-1")
    append = sidecar.log.append
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the database went away")
        return append(*args, **kwargs)

    monkeypatch.setattr(sidecar.log, "append", fail_once)
    answers = iter([GOOD, dict.fromkeys(GOOD, 0)])  # the second time there is nothing left
    asyncio.run(with_process(sidecar, lambda cmd: next(answers), service.run_pending))
    assert state(sidecar, rid).state == "received" and state(sidecar, rid).error.endswith("ConnectionError")
    asyncio.run(with_process(sidecar, lambda cmd: next(answers), service.run_pending))
    done = state(sidecar, rid)
    assert done.state == "completed"
    details = json.loads(done.receipt_json)["receipts"][0]["record"]["details"]
    assert details["pages_overwritten"] == GOOD["pages"] and details["secrets_destroyed"] == 1


def test_a_retention_request_keeps_no_unkeyed_hash_of_the_session_ids(make_sidecar):
    # its idempotency key is built from the session's keyed index: hashing a guess of the raw
    # tenant and session ids (and the opening time, seen in the logs) does not reproduce it
    import hashlib

    sc = make_sidecar(retention_max_age_s=1)
    service = ErasureService(sc)
    proc = sc.registry.touch("proc-a", INSTANCE, TOKEN)
    opened = time.time_ns() // 1_000_000 - 5_000
    proc.sessions = {("bank", "u-1", "s-1"): opened}
    assert sweep(sc, service) == 1
    with sc.db() as db:
        row = db.scalar(select(ErasureRequest).where(ErasureRequest.origin == sc.settings.origin))
    for key in (f"retention:bank\x00s-1\x00{opened}", "retention:bank\x00s-1"):
        assert row.idempotency_sha256 != hashlib.sha256(f"retention\x00{key}".encode()).hexdigest()
