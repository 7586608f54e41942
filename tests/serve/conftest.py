"""`kvguard serve-llm` in-process on loopback (one SmolLM2 for the module) beside a real sidecar
process (`kvguard serve`, SQLite), with API keys of two tenants."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from sqlalchemy.orm import Session

from tests.sidecar.conftest import Server, free_port, start_server


@dataclass
class Llm:
    url: str
    app: object
    engine: object
    client: object  # the SidecarClient
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.stop()
        self.client.close()


def make_tokens(data: Path, db_url: str, extra_scopes: tuple[str, ...] = ()) -> dict[str, str]:
    """The sidecar's secrets and tokens, made in-process (faster than a CLI call each); a token
    of each of `extra_scopes` too."""
    from kvguard.audit.keys import write_private_file
    from kvguard.audit.store import make_engine, migrate

    from kvguard.sidecar.auth import create_token
    from kvguard.sidecar.service import load_or_create_secret

    data.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in ("index.key", "seal.key"):
        write_private_file(data / name, secrets.token_bytes(32).hex().encode() + b"\n")
    index_key = load_or_create_secret(data / "index.key")
    migrate(db_url)
    engine = make_engine(db_url)
    with Session(engine) as db:
        tokens = {"admin": create_token(db, "admin", ["admin"]), "ingest": create_token(db, "ingest", ["ingest"]),
                  "audit:read": create_token(db, "auditor", ["audit:read"])}
        for scope in extra_scopes:
            tokens[scope] = create_token(db, scope.replace(":", "-"), [scope])
        for tenant in ("acme", "globex"):
            tokens[tenant] = create_token(db, f"infer-{len(tokens)}", ["infer"], tenants=[tenant], index_key=index_key)
    engine.dispose()
    return tokens


def start_llm(sidecar: Server, model, tok, server_options: dict | None = None, **options) -> Llm:
    """server_options: serve-llm's uvicorn settings (cli.server_config), as the command sets them."""
    from kvguard.serve.cli import build, server_config

    app, engine, client = build(model, tok, model_name="smollm2", socket=sidecar.socket,
                                ingest_token=sidecar.tokens["ingest"],
                                client_options={"poll_wait_s": 1.0}, **options)
    port = free_port()
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port,
                                          max_seqs=options.get("max_seqs", 64), **(server_options or {})))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:  # ready once the sidecar has taken a first batch
        if httpx.get(url + "/readyz").status_code == 200:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("kvguard serve-llm did not become ready")
    return Llm(url, app, engine, client, server, thread)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-llm")
    db_url = f"sqlite:///{tmp / 'audit.db'}"
    server = start_server(tmp, db_url, tokens=make_tokens(tmp / "data", db_url))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm2():
    from kvguard.hf import load_smollm2

    return load_smollm2()
