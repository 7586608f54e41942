"""What `kvguard serve` and the commands reading settings refuse at start: a database
without a usable admin token, booleans it cannot read, misspelt variables, and a data
directory or database files that others can read."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvguard.errors import ConfigError
from kvguard.sidecar.settings import check_secure, load_settings
from tests.sidecar.conftest import ROOT, kvguard, runtime_url, start_server


def run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvguard", *args], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_production_needs_a_usable_admin_token_not_just_any_token(tmp_path, db_url):
    data = tmp_path / "d"
    if db_url.startswith("postgresql"):  # migrated by its owner, served as the runtime role
        db_url = runtime_url(db_url)
    env = {**os.environ, "KVGUARD_DATA_DIR": str(data), "KVGUARD_DATABASE_URL": db_url, "KVGUARD_PORT": "0",
           "KVGUARD_ORIGIN": f"test.kvguard/{tmp_path.name}"}
    data.mkdir(mode=0o700)
    (data / "kek").mkdir(mode=0o700)
    for secret in ("index.key", "seal.key"):
        kvguard(["keygen", "--secret", str(data / secret)], env)
    for scopes in (["ingest"], ["erasure:write", "erasure:read", "audit:read"]):
        kvguard(["token", "create", "--name", "x", *[a for s in scopes for a in ("--scope", s)]], env)
    r = run(["serve"], env)
    assert r.returncode == 1 and "no admin API token exists" in r.stderr, r.stderr[-2000:]
    # an admin token that has expired does not count either
    kvguard(["token", "create", "--scope", "admin", "--name", "gone", "--expires-in", "1s"], env)
    time.sleep(1.1)
    r = run(["serve"], env)
    assert r.returncode == 1 and "no admin API token exists" in r.stderr, r.stderr[-2000:]


def test_booleans_parse_strictly(tmp_path, monkeypatch):
    for name in ("index.key", "seal.key"):
        (tmp_path / name).write_text("00")
    for off in ("0", "false", "no", "off"):
        monkeypatch.setenv("KVGUARD_BEHIND_TLS_PROXY", off)
        with pytest.raises(ConfigError, match="would listen on 0.0.0.0 without TLS"):
            check_secure(load_settings(data_dir=tmp_path, host="0.0.0.0"), tokens_exist=True)
    monkeypatch.setenv("KVGUARD_BEHIND_TLS_PROXY", "1")
    check_secure(load_settings(data_dir=tmp_path, host="0.0.0.0"), tokens_exist=True)
    for bad in ("maybe", "2", "yes please"):
        monkeypatch.setenv("KVGUARD_BEHIND_TLS_PROXY", bad)
        with pytest.raises(ConfigError, match=r"behind_tls_proxy \(KVGUARD_BEHIND_TLS_PROXY\): Input should be "
                                              "a valid boolean"):
            load_settings(data_dir=tmp_path)
    monkeypatch.delenv("KVGUARD_BEHIND_TLS_PROXY")
    monkeypatch.setenv("KVGUARD_AUDIT_SIGN_PROCESS", "nah")
    with pytest.raises(ConfigError, match="KVGUARD_AUDIT_SIGN_PROCESS"):
        load_settings(data_dir=tmp_path)


def test_serve_refuses_to_bind_beyond_loopback_when_the_proxy_flag_is_0(tmp_path):
    env = {**os.environ, "KVGUARD_DATA_DIR": str(tmp_path / "d"), "KVGUARD_HOST": "0.0.0.0", "KVGUARD_PORT": "0",
           "KVGUARD_BEHIND_TLS_PROXY": "0"}
    kvguard(["token", "create", "--scope", "admin"], env)
    r = run(["serve"], env)
    assert r.returncode == 1 and "would listen on 0.0.0.0 without TLS" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("command", [["serve"], ["token", "create", "--scope", "admin"], ["token", "list"]])
def test_a_misspelt_variable_is_refused_with_the_setting_it_resembles(tmp_path, command):
    env = {**os.environ, "KVGUARD_DATA_DIR": str(tmp_path / "d"), "KVGUARD_PORT": "0",
           "KVGUARD_DATABSE_URL": "postgresql+psycopg://kvguard@db/audit"}
    r = run(command, env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "KVGUARD_DATABSE_URL (did you mean KVGUARD_DATABASE_URL?)" in r.stderr, r.stderr[-2000:]
    assert "postgresql" not in r.stderr  # the value is not echoed
    assert not (tmp_path / "d").exists()  # refused before anything was made


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_the_data_directory_is_0700_and_the_database_files_0600(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)  # as an earlier version, or an operator's mkdir, left it
    db = data / "audit.db"
    old = os.umask(0o022)
    try:
        server = start_server(tmp_path, f"sqlite:///{db}")
    finally:
        os.umask(old)
    try:
        with server.client("admin") as c:  # something written: the WAL is in use
            assert c.post("/v1/erasure-requests", headers={"Idempotency-Key": "perm-check-1"},
                          json={"tenant": "t", "user": "u", "legal_basis": "gdpr-art17"}).status_code == 202
        assert mode(data) == 0o700
        files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
        assert all(f.exists() for f in files)
        assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
    finally:
        server.stop()


def test_files_left_readable_are_tightened_and_a_foreign_data_directory_is_refused(tmp_path):
    data = tmp_path / "d"
    env = {**os.environ, "KVGUARD_DATA_DIR": str(data)}
    kvguard(["token", "create", "--scope", "admin"], env)
    for f in (data, data / "audit.db"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    kvguard(["token", "list"], env)
    assert mode(data) == 0o700 and mode(data / "audit.db") == 0o600
    if os.geteuid() == 0:  # only root can hand the directory to another user
        os.chown(data, 65534, 65534)
        r = run(["token", "list"], env)
        assert r.returncode == 1 and "belongs to uid 65534" in r.stderr, r.stderr[-2000:]
