"""`kvguard witness`'s add-checkpoint endpoint (C2SP tlog-witness), in process, its state on
SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from kvguard.audit.cosignature import Witness, cosignatures
from kvguard.audit.keys import SigningKey

from kvguard.witness.app import WitnessConfig, create_app
from kvguard.witness.store import WitnessStore

from .witnesslib import MemoryLog

NAME = "witness.test/w1"


@pytest.fixture
def wstore(db_url):
    s = WitnessStore(db_url)
    yield s
    s.dispose()


@pytest.fixture
def witness_key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
def client(wstore, witness_key, origin, log_key):
    config = WitnessConfig(NAME, witness_key, {origin: [SigningKey.generate().public_key, log_key.public_key]})
    with TestClient(create_app(config, wstore)) as c:
        yield c


def add(client, body: str):
    return client.post("/add-checkpoint", content=body.encode())


def test_cosigns_what_extends_the_last_cosigned_and_refuses_the_rest(client, wstore, witness_key, origin, log_key):
    log = MemoryLog(origin, log_key).grow(5)
    r = add(client, log.body(0))
    assert r.status_code == 200, r.text
    [c] = cosignatures(log.note() + r.text, [Witness(NAME, witness_key.public_key)])
    log.grow(3)
    assert add(client, log.body(5)).status_code == 200
    assert wstore.latest(origin).size == 8

    # a client behind the witness: 409 with the witness's size, as text/x.tlog.size
    r = add(client, log.body(5))
    assert (r.status_code, r.headers["content-type"], r.text) == (409, "text/x.tlog.size", "8\n")
    assert add(client, log.body(0)).status_code == 409

    # another history sharing the first 5 records: refused, whether larger or of the same size
    fork = MemoryLog(origin, log_key).grow(5)
    fork.grow(5, tag=b"forged")
    r = add(client, fork.body(8))
    assert r.status_code == 422 and "not consistent" in r.json()["detail"]
    assert add(client, fork.body(8, 8)).status_code == 409
    assert wstore.latest(origin).size == 8  # nothing moved

    # the same checkpoint again: cosigned again (a fresh timestamp for an idle log)
    assert add(client, log.body(8)).status_code == 200


def test_refuses_unknown_logs_forged_signatures_and_bad_bodies(client, origin, log_key):
    log = MemoryLog(origin, log_key).grow(4)
    assert add(client, MemoryLog("other.test/log", log_key).grow(4).body(0)).status_code == 404
    assert add(client, MemoryLog(origin, SigningKey.generate()).grow(4).body(0)).status_code == 403
    assert add(client, "old 9\n\n" + log.note()).status_code == 400  # old size beyond the checkpoint
    assert add(client, "old 0\nnot base64!\n\n" + log.note()).status_code == 400
    assert add(client, "old 01\n\n" + log.note()).status_code == 400
    assert add(client, "old 0\n" + "A" * 44 + "\n\n" + log.note()).status_code == 400  # not 32 bytes
    r = add(client, "old 0\n" + "x" * 20_000)
    assert r.status_code == 413 and r.headers["content-type"] == "application/problem+json"
    assert add(client, log.body(0)).status_code == 200  # none of that moved the state


def test_the_state_moves_only_from_what_was_checked(wstore, origin, log_key):
    log = MemoryLog(origin, log_key).grow(3)
    first = wstore.latest(origin)
    assert wstore.advance(origin, first, 3, log.tree.root(3), log.note(), 1)
    assert not wstore.advance(origin, first, 3, log.tree.root(3), log.note(), 2)  # a racing request
    assert (wstore.latest(origin).size, wstore.latest(origin).root) == (3, log.tree.root(3))


def test_storage_down_is_a_503_not_a_500(wstore, client, origin, log_key, monkeypatch):
    from sqlalchemy.exc import OperationalError

    def down(*_):
        raise OperationalError("SELECT", {}, ConnectionError("connection refused"))

    monkeypatch.setattr(wstore, "latest", down)
    r = add(client, MemoryLog(origin, log_key).grow(2).body(0))
    assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json"


def test_an_origin_pattern_admits_a_fleets_logs(wstore, witness_key, log_key, origin):
    config = WitnessConfig(NAME, witness_key, {f"{origin}/*": [log_key.public_key],
                                               f"{origin}/special-*": [SigningKey.generate().public_key]})
    with TestClient(create_app(config, wstore)) as client:
        assert add(client, MemoryLog(f"{origin}/pod-7", log_key).grow(2).body(0)).status_code == 200
        assert add(client, MemoryLog(f"{origin}/special-1", log_key).grow(2).body(0)).status_code == 403
        assert add(client, MemoryLog(f"{origin}-other/pod-7", log_key).grow(2).body(0)).status_code == 404
