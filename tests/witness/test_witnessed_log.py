"""A log whose checkpoints witnesses cosign: submission, bundles carrying the cosignatures,
`kvguard audit verify --witness-key`, and the tampering only witnesses catch, done as an
attacker with write access to the database would (triggers bypassed)."""

from __future__ import annotations

import base64
import json
import shutil
import time

import pytest
from fastapi.testclient import TestClient
from kvguard.audit.bundle.export import export_bundle
from kvguard.audit.bundle.verify import verify_bundle
from kvguard.audit.cli import main as audit_cli
from kvguard.audit.cosignature import Witness
from kvguard.audit.errors import VerificationError
from kvguard.audit.keys import SigningKey
from kvguard.audit.store import AuditStore
from sqlalchemy import create_engine, text

from kvguard.sidecar.witnessing import Witnessing
from kvguard.witness.app import WitnessConfig, create_app
from kvguard.witness.store import WitnessStore
from tests.audit.audit_testlib import fill, open_log, read_bundle, write_bundle

HOUR = 3600


class Clock:
    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture
def witnesses(tmp_path, origin, log_key):
    """Two witnesses, each with its own key and SQLite state, and a clock each (set back to
    make cosignatures "of an hour ago")."""
    made = []
    for i in (1, 2):
        key, clock = SigningKey.generate(), Clock()
        config = WitnessConfig(f"witness.test/w{i}", key, {origin: [log_key.public_key]}, clock=clock)
        store = WitnessStore(f"sqlite:///{tmp_path / f'w{i}.db'}")
        made.append((f"http://w{i}.test", Witness(config.name, key.public_key), clock,
                     TestClient(create_app(config, store)), store))
    yield made
    for *_, client, store in made:
        client.close()
        store.dispose()


def submitter(log, witnesses, which=(0, 1)) -> Witnessing:
    chosen = [witnesses[i] for i in which]
    clients = {url: client for url, _, _, client, _ in chosen}
    return Witnessing(log, [(url, w) for url, w, *_ in chosen], refresh_s=0.0, retry_max_s=0.0,
                      client_for=clients.__getitem__)


def vkeys(witnesses) -> list[str]:
    return [w.vkey() for _, w, *_ in witnesses]


def attack(url: str, *statements: str) -> None:
    """Run SQL as the attacker: PostgreSQL superuser with triggers off, or SQLite without them."""
    engine = create_engine(url)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SET session_replication_role = replica"))
        else:
            for (name,) in conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).all():
                conn.execute(text(f'DROP TRIGGER "{name}"'))
        for sql in statements:
            conn.execute(text(sql))
    engine.dispose()


def test_truncation_with_its_checkpoints_deleted_fails_verify_witness_key(db_url, origin, log_key, witnesses,
                                                                         tmp_path, capsys):
    store = AuditStore(db_url)
    for _, _, clock, *_ in witnesses:
        clock.offset = -HOUR  # the first 10 records were cosigned an hour ago, the rest since
    with open_log(store, origin, log_key) as log:
        fill(log, 10)
        log.checkpoint()
        submitter(log, witnesses).run_once()
        for _, _, clock, *_ in witnesses:
            clock.offset = 0
        fill(log, 10)
        log.erase = log.append("erase", {"user": "ab" * 16}, {"scope": "user", "pages": 1})
        log.checkpoint()
        w = submitter(log, witnesses)
        w.run_once()
        assert w.status() == {"witness.test/w1": "ok", "witness.test/w2": "ok"}
    honest = tmp_path / "honest.zip"
    export_bundle(store, origin, str(honest), log_key, progress=False, witnessed=True)
    ok = verify_bundle(honest, [log_key.public_key], witnesses=[w for _, w, *_ in witnesses])
    assert (ok.tree_size, ok.cosignatures, ok.receipts) == (21, 2, 1)
    receipt = tmp_path / "receipt.json"
    receipt.write_bytes(read_bundle(honest)["receipts.jsonl"])
    (tmp_path / "log.pub").write_text(log_key.public_key.to_pem())
    args = ["--public-key", str(tmp_path / "log.pub"), *sum((["--witness-key", k] for k in vkeys(witnesses)), [])]
    assert audit_cli(["verify-receipt", str(receipt), *args]) == 0

    # the attacker deletes records 10.. and the checkpoints (and cosignatures) above them
    attack(db_url, f"DELETE FROM records WHERE origin = '{origin}' AND seq >= 10",
           f"DELETE FROM checkpoints WHERE origin = '{origin}' AND tree_size > 10")  # cosignatures left
    cut = tmp_path / "cut.zip"
    export_bundle(store, origin, str(cut), log_key, progress=False, witnessed=True)
    assert verify_bundle(cut, [log_key.public_key]).tree_size == 10  # what passes without witnesses
    with pytest.raises(VerificationError, match="outside the accepted time window") as e:
        verify_bundle(cut, [log_key.public_key], witnesses=[w for _, w, *_ in witnesses])
    assert (e.value.check, e.value.member) == ("witness", "checkpoints.json")
    capsys.readouterr()
    assert audit_cli(["verify", str(cut), *args, "--witnesses", "1", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["check"] == "witness"

    # and the sidecar, restarted on the truncated log (its cosignature rows deleted too), hears it
    # from the witnesses at once: each answers 409 with the larger size it cosigned
    attack(db_url, f"DELETE FROM cosignatures WHERE origin = '{origin}' AND tree_size > 10")
    with open_log(store, origin, log_key) as log:
        w = submitter(log, witnesses)
        w.run_once()
        assert all("rolled back" in s for s in w.status().values())
    store.dispose()


def test_two_histories_shown_to_two_auditors_fail(db_url, origin, log_key, witnesses, tmp_path,
                                                  _sqlite_template):
    """A split view: one history shown to witness 1, another (same origin, same key) to witness
    2. Each auditor's bundle has one cosignature; a quorum of two fails both, and neither
    witness cosigns the other history."""
    other_db = tmp_path / "other.db"
    shutil.copyfile(_sqlite_template, other_db)
    stores = [AuditStore(db_url), AuditStore(f"sqlite:///{other_db}")]
    logs = [open_log(store, origin, log_key) for store in stores]
    for i, (log, op) in enumerate(zip(logs, ("evict", "offload"))):
        fill(log, 12, op=op)
        log.checkpoint()
        submitter(log, witnesses, which=(i,)).run_once()  # history i shown to witness i only
    for i, log in enumerate(logs):  # neither witness cosigns the other history
        other = submitter(log, witnesses, which=(1 - i,))
        other.run_once()  # 409: the witness is at 12; resume from there
        other.run_once()  # 409 again: another root at 12
        assert "not consistent" in other.status()[f"witness.test/w{2 - i}"] or \
            "another tree" in other.status()[f"witness.test/w{2 - i}"]
    bundles = []
    for i, (log, store) in enumerate(zip(logs, stores)):
        log.close()
        path = tmp_path / f"history{i}.zip"
        export_bundle(store, origin, str(path), log_key, progress=False, witnessed=True)
        bundles.append(path)
        store.dispose()
    trusted = [w for _, w, *_ in witnesses]
    for path in bundles:
        assert verify_bundle(path, [log_key.public_key], witnesses=trusted, min_witnesses=1).cosignatures == 1
        with pytest.raises(VerificationError, match="1 valid cosignature.*2 required"):
            verify_bundle(path, [log_key.public_key], witnesses=trusted)


def test_bad_cosignature_wrong_witness_key_and_too_few_fail(sqlite_url, origin, log_key, witnesses, tmp_path):
    store = AuditStore(sqlite_url)
    with open_log(store, origin, log_key) as log:
        fill(log, 6)
        log.checkpoint()
        submitter(log, witnesses, which=(0,)).run_once()
    path = tmp_path / "b.zip"
    export_bundle(store, origin, str(path), log_key, progress=False, witnessed=True)
    store.dispose()
    w1, w2 = (w for _, w, *_ in witnesses)
    verify_bundle(path, [log_key.public_key], witnesses=[w1])
    with pytest.raises(VerificationError, match="0 valid"):  # a key the bundle's witness does not hold
        verify_bundle(path, [log_key.public_key], witnesses=[Witness(w1.name, SigningKey.generate().public_key)])
    with pytest.raises(VerificationError, match="1 valid cosignature.*2 required"):
        verify_bundle(path, [log_key.public_key], witnesses=[w1, w2])
    # a cosignature altered in the bundle (resealed with the log's key, to reach the check)
    members = read_bundle(path)
    doc = json.loads(members["checkpoints.json"])
    note = doc["checkpoints"][-1]["note"]
    head, _, line = note[:-1].rpartition("\n")
    blob = bytearray(base64.b64decode(line.split(" ")[2]))
    blob[-1] ^= 1  # one bit of the witness's Ed25519 signature
    doc["checkpoints"][-1]["note"] = f"{head}\n— {w1.name} {base64.b64encode(bytes(blob)).decode()}\n"
    members["checkpoints.json"] = json.dumps(doc).encode()
    write_bundle(path, members, reseal_with=log_key)
    with pytest.raises(VerificationError, match="does not verify") as e:
        verify_bundle(path, [log_key.public_key], witnesses=[w1])
    assert e.value.check == "cosignature"


def test_a_receipt_read_back_carries_the_cosignatures_stored_since(sqlite_url, origin, log_key, witnesses, tmp_path):
    from types import SimpleNamespace

    from kvguard.audit.receipt import make_receipt

    from kvguard.sidecar.api.erasure import _cosigned

    store = AuditStore(sqlite_url)
    with open_log(store, origin, log_key) as log:
        fill(log, 3)
        record = log.append("erase", {"user": "ab" * 16}, {"scope": "user", "pages": 1})
        receipt = make_receipt(log, record.seq)  # made at once: its checkpoint is not cosigned yet
        sidecar = SimpleNamespace(store=store)
        assert _cosigned(sidecar, receipt) == receipt
        submitter(log, witnesses).run_once()
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(_cosigned(sidecar, receipt)))
    (tmp_path / "log.pub").write_text(log_key.public_key.to_pem())
    args = ["verify-receipt", str(path), "--public-key", str(tmp_path / "log.pub"),
            *sum((["--witness-key", k] for k in vkeys(witnesses)), [])]
    assert audit_cli(args) == 0
    path.write_text(json.dumps(receipt))
    assert audit_cli(args) == 1  # without them: not witnessed
    store.dispose()


def test_a_witness_answering_too_much_or_no_cosignature_is_a_failure_not_a_crash(sqlite_url, origin, log_key):
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    answers = iter(["x" * 100_000, "— nobody AAAA\n"])
    app = FastAPI()
    app.post("/add-checkpoint")(lambda: PlainTextResponse(next(answers)))
    witness = Witness("witness.test/odd", SigningKey.generate().public_key)
    store = AuditStore(sqlite_url)
    with open_log(store, origin, log_key) as log, TestClient(app) as client:
        fill(log, 2)
        log.checkpoint()
        w = Witnessing(log, [("http://odd.test", witness)], retry_max_s=0.0, client_for=lambda _: client)
        w.run_once()
        assert "answered more than" in w.status()[witness.name]
        w.run_once()
        assert "without a valid cosignature" in w.status()[witness.name]
    store.dispose()
