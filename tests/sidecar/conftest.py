"""Real sidecar processes on loopback, over SQLite and over PostgreSQL."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pg_database():
    """A PostgreSQL database of its own, dropped afterwards (and its runtime role with it)."""
    name = f"kvguard_sidecar_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    drop_pg_database(name)
    admin.dispose()


def drop_pg_database(name: str) -> None:
    """Drop a database and the runtime role `runtime_url` made for it."""
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            c.execute(sa.text(f'DROP ROLE IF EXISTS "{name}_rt"'))
    finally:
        admin.dispose()


def runtime_url(owner_url: str) -> str:
    """Provision a PostgreSQL database as an operator does for production: migrations run as
    the owner (the URL's role), a runtime role `<database>_rt` granted what the sidecar needs
    (docs/operations-roles.md); returns the same URL as that role, which the sidecar runs as."""
    url = sa.engine.make_url(owner_url)
    role = f"{url.database}_rt"
    with _PROVISIONING:  # alembic's context is process-wide: tests that start sidecars in threads take turns
        _provision(owner_url, role)
    return url.set(username=role).render_as_string(hide_password=False)


_PROVISIONING = threading.Lock()


def _provision(owner_url: str, role: str) -> None:
    from kvguard.audit.store import migrate

    from kvguard.sidecar import roles

    migrate(owner_url)
    for url_, step in ((PG_ADMIN, "create"), (owner_url, "grant")):  # a superuser creates it; the owner grants
        engine = sa.create_engine(url_, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as c:
                if step == "grant":
                    roles.grant(c, role)
                elif c.scalar(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}) is None:
                    c.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        finally:
            engine.dispose()


@dataclass
class Server:
    url: str
    socket: Path
    data_dir: Path
    db_url: str
    tokens: dict[str, str]
    proc: subprocess.Popen
    env: dict

    def client(self, scope: str | None = "admin") -> httpx.Client:
        """A client of the admin API (TCP), or with the ingest scope of the ingest API (the socket)."""
        if scope == "ingest":
            return self.ingest(self.tokens["ingest"])
        headers = {"Authorization": f"Bearer {self.tokens[scope]}"} if scope else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def ingest(self, token: str | None) -> httpx.Client:
        """A client of the ingest API, which only the Unix socket serves."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url="http://sidecar", transport=httpx.HTTPTransport(uds=str(self.socket)),
                            headers=headers, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def kvguard(args: list[str], env: dict) -> str:
    r = subprocess.run([sys.executable, "-m", "kvguard", *args], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def kvguard_commands(commands: list[list[str]], env: dict) -> list[str]:
    """Each command's output, as `kvguard(args, env)` would return it, through kvguard's CLI entry
    point in this process with `env`'s variables set: a `python -m kvguard` spends most of a
    second importing before the command runs, and a sidecar test starts many sidecars."""
    from kvguard.cli import main

    # only the variables that differ are set, and put back after: the rest of the environment,
    # which other threads of the worker may read meanwhile, is never touched
    saved, out = {k: os.environ.get(k) for k, v in env.items() if os.environ.get(k) != v}, []
    os.environ.update({k: env[k] for k in saved})
    try:
        for args in commands:
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()) as buf, contextlib.redirect_stderr(err):
                try:
                    code = main(args)
                except SystemExit as e:  # argparse's errors
                    code = e.code
            assert not code, f"kvguard {' '.join(args)}: exit status {code}: {err.getvalue()}"
            out.append(buf.getvalue().strip())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def start_server(tmp: Path, db_url: str, *, tokens: dict | None = None, extra_env: dict | None = None) -> Server:
    data, owner_url = tmp / "data", db_url
    kek = {}
    if db_url.startswith("postgresql"):  # the sidecar runs as a runtime role, never the owner
        name = sa.engine.make_url(db_url).database
        kek = {"KVGUARD_KEK_DIR": str(tmp.parent / f"kek-{name}")}  # shared by its sidecars
        (tmp.parent / f"kek-{name}").mkdir(mode=0o700, exist_ok=True)
        db_url = runtime_url(db_url)
    env = {**os.environ, "KVGUARD_DATA_DIR": str(data), "KVGUARD_DATABASE_URL": db_url, **kek,
           "KVGUARD_ORIGIN": f"test.kvguard/{uuid.uuid4().hex[:8]}", "KVGUARD_LOG_FORMAT": "json",
           "KVGUARD_ERASURE_ACK_TIMEOUT_S": "20", "KVGUARD_INFERENCE_LIVE_S": "3", **(extra_env or {})}
    commands = []
    for secret in ("index.key", "seal.key"):  # as an operator provisions them for a shared database
        if not (data / secret).exists():
            data.mkdir(parents=True, exist_ok=True, mode=0o700)
            commands.append(["keygen", "--secret", str(data / secret)])
    scopes = ("admin", "ingest", "erasure:write", "erasure:read", "audit:read") if tokens is None else ()
    commands += [["token", "create", "--scope", scope, "--name", scope.replace(":", "-")] for scope in scopes]
    if commands:
        out = kvguard_commands(commands, env)
        if scopes:
            tokens = dict(zip(scopes, out[-len(scopes):], strict=True))
    port = int((extra_env or {}).get("KVGUARD_PORT") or free_port())
    env["KVGUARD_PORT"] = str(port)
    log = open(tmp / "serve.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvguard", "serve"], env=env, cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvguard serve exited: {(tmp / 'serve.log').read_text()[-3000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200 and (data / "ingest.sock").exists():
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError("kvguard serve did not become ready")
    return Server(url, data / "ingest.sock", data, owner_url, tokens, proc, env)


@pytest.fixture(scope="session")
def kek_dirs(tmp_path_factory):
    """One key-encryption key directory per database, as every sidecar of a database shares it."""
    root = tmp_path_factory.mktemp("kek")
    return lambda url: root / hashlib.sha256(url.encode()).hexdigest()[:16]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'audit.db'}"
    return request.getfixturevalue("pg_database")


@pytest.fixture
def server(tmp_path, db_url):
    s = start_server(tmp_path, db_url)
    yield s
    s.stop()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def shared_server(request, tmp_path_factory):
    """One server per module and database, for tests that leave nothing behind that the
    others would see."""
    tmp = tmp_path_factory.mktemp(f"shared-{request.param}")
    url = f"sqlite:///{tmp / 'audit.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_database")
    s = start_server(tmp, url)
    yield s
    s.stop()
