"""`kvguard keys rotate --offline` on a stopped sidecar's data directory, and a rotation that a crash
interrupted, completed or undone at the next start. (The running sidecar's rotation through
the admin API is in test_roles.py.)"""

from __future__ import annotations

import os

import pytest
from kvguard.audit.keys import SigningKey
from kvguard.audit.store import AuditStore
from kvguard.audit.verify import verify_store

from kvguard.cli import main
from kvguard.sidecar.server import lock_data_dir
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.settings import load_settings
from kvguard.sidecar.signing import finish_rotation, next_path
from tests.sidecar.conftest import PG_ADMIN


@pytest.fixture
def stopped(tmp_path, monkeypatch):
    """A data directory whose sidecar wrote a record and stopped."""
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVGUARD_ORIGIN", "test.kvguard/rotate")
    settings = load_settings(environment="development", audit_sign_process=False)
    sc = Sidecar(settings)
    sc.log.append("policy", {}, {"name": "chat"})
    sc.close()
    return settings


def test_offline_rotation_signs_a_rotation_record_and_replaces_the_key_file(stopped, capsys):
    old = SigningKey.load(stopped.signing_key_path)
    assert main(["keys", "rotate", "--offline"]) == 0
    assert "signs from #2" in capsys.readouterr().out
    new = SigningKey.load(stopped.signing_key_path)
    store = AuditStore(stopped.db_url)
    keys = store.keys(stopped.origin)
    assert [k.key.key_id for k in keys] == [old.key_id, new.key_id] and keys[1].valid_from_seq == 2
    assert store.record(stopped.origin, 1).op == "key_rotation"
    store.dispose()
    assert not next_path(stopped.signing_key_path).exists()
    sc = Sidecar(stopped)  # the next start signs on with the new key
    assert sc.log.append("policy", {}, {"name": "rag"}).key_id == new.key_id
    sc.close()
    verify_store(stopped.db_url, stopped.origin, [old.public_key])  # anchored at the first key


def test_offline_rotation_refuses_while_a_sidecar_runs(stopped, capsys):
    fds = lock_data_dir(stopped)  # as `kvguard serve` holds it
    try:
        assert main(["keys", "rotate", "--offline"]) == 1
        assert "another kvguard serve is running" in capsys.readouterr().err
    finally:
        for fd in fds:
            os.close(fd)


def test_online_rotation_needs_an_admin_token(stopped, capsys, monkeypatch):
    monkeypatch.delenv("KVGUARD_ADMIN_TOKEN", raising=False)
    assert main(["keys", "rotate", "--url", "http://127.0.0.1:9"]) == 1
    assert "--token-file FILE (mode 0600) or KVGUARD_ADMIN_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", "kvg_x")
    assert main(["keys", "rotate", "--url", "http://127.0.0.1:9"]) == 1
    assert "no sidecar answered at http://127.0.0.1:9" in capsys.readouterr().err


def test_a_rotation_interrupted_by_a_crash_is_completed_or_undone_at_start(stopped):
    key_path, pending = stopped.signing_key_path, next_path(stopped.signing_key_path)
    store = AuditStore(stopped.db_url)
    # a crash before the rotation record: the log never named the .next key, which goes
    SigningKey.generate().save(pending)
    finish_rotation(key_path, store, stopped.origin)
    assert not pending.exists()
    # a crash after the record, before the rename: the log is the new key's, which moves in
    sc = Sidecar(stopped)
    new = SigningKey.generate()
    new.save(pending)
    sc.log.rotate_key(new)
    sc.close()
    assert SigningKey.load(key_path).key_id != new.key_id
    sc = Sidecar(stopped)  # would refuse a key file that the log no longer uses
    assert sc.key.key_id == new.key_id == SigningKey.load(key_path).key_id and not pending.exists()
    sc.close()
    store.dispose()


def test_the_kek_rotates_on_its_schedule_and_one_sidecar_at_a_time(stopped, monkeypatch):
    from kvguard.audit.models import Kek
    from sqlalchemy import update

    from kvguard.sidecar.rotation import check_interval_s

    monkeypatch.setenv("KVGUARD_KEK_ROTATION_S", "3600")
    settings = load_settings(environment="development", audit_sign_process=False)
    sc = Sidecar(settings)
    try:
        sc.pseudonyms.pseudonym("user", "alice", tenant="acme")
        first = sc.store.current_kek()
        assert sc.rotate_kek_if_due() is None  # younger than the period
        with sc.store.write() as conn:  # an hour and a second later
            conn.execute(update(Kek).where(Kek.id == first).values(created_ms=Kek.created_ms - 3_601_000))
        assert b"kvguard_kek_age_seconds 360" in sc.metrics.render()  # overdue: an alert can see it
        second = sc.rotate_kek_if_due()
        assert second not in (None, first) and not sc.keyring.path(first).exists()
        assert sc.rotate_kek_if_due() is None
        assert sc.readiness()["kek"] == "ok"
        sc.keyring.path(second).rename(sc.keyring.path(second).with_suffix(".moved"))  # not the shared dir
        sc.keyring.forget_destroyed()
        assert sc.readiness()["kek"].startswith(f"key-encryption key {second} is not in")
        metrics = sc.metrics.render().decode()
        assert "kvguard_kek_rotations_total 1.0" in metrics and "kvguard_kek_age_seconds 0." in metrics
    finally:
        sc.close()
    assert check_interval_s(3600) == 60 and check_interval_s(60) == 15
    # on PostgreSQL one sidecar of the database rotates at a time: the others skip
    a, b = AuditStore(PG_ADMIN), AuditStore(PG_ADMIN)
    with a.kek_rotation_lock() as first_holds, b.kek_rotation_lock() as second_holds:
        assert first_holds and not second_holds
    with b.kek_rotation_lock() as again:
        assert again
    a.dispose()
    b.dispose()
