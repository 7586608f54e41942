"""The admin API as a user or an attacker meets it, over real HTTP: reused idempotency keys,
malformed path and query parameters, wrong content types, the quick start's own curl line (docs/sidecar.md), and
tokens that expire or are revoked."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
import uuid

import httpx

from tests.sidecar.conftest import ROOT, kvguard

ERASE = {"tenant": "acme", "user": "u-123", "legal_basis": "gdpr-art17"}


def log_lines(server) -> list[dict]:
    out = []
    for line in (server.data_dir.parent / "serve.log").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_a_reused_idempotency_key_with_another_body_is_refused(shared_server):
    key = {"Idempotency-Key": f"reuse-{uuid.uuid4().hex}"}
    with shared_server.client("erasure:write") as c:
        first = c.post("/v1/erasure-requests", headers=key, json=ERASE)
        assert first.status_code == 202, first.text
        again = c.post("/v1/erasure-requests", headers=key, json=ERASE)
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        for other in ({**ERASE, "user": "u-456"}, {**ERASE, "legal_basis": "pipl-art47"},
                      {**ERASE, "reason": "asked twice"}, {"tenant": "acme", "session": "u-123",
                                                          "legal_basis": "gdpr-art17"}):
            r = c.post("/v1/erasure-requests", headers=key, json=other)
            assert r.status_code == 422, (other, r.status_code, r.text)
            assert r.headers["content-type"] == "application/problem+json"
            assert "Idempotency-Key was already used" in r.json()["detail"]
        # the second subject's request goes through under a key of its own
        r = c.post("/v1/erasure-requests", headers={"Idempotency-Key": f"new-{uuid.uuid4().hex}"},
                   json={**ERASE, "user": "u-456"})
        assert r.status_code == 202 and r.json()["subject_pseudonym"] != first.json()["subject_pseudonym"]


def test_malformed_path_and_query_parameters_are_4xx_and_logged_with_the_request_id(shared_server):
    bad_admin = ["/v1/erasure-requests/%00", "/v1/erasure-requests/%00%00", "/v1/erasure-requests/x%00y",
                 "/v1/erasure-requests/" + "a" * 5000, "/v1/erasure-requests/" + str(uuid.uuid4()).upper(),
                 "/v1/audit/records?pseudonym=%00", "/v1/audit/records?op=%00", "/v1/audit/records?after=%00",
                 "/v1/audit/proofs/inclusion?seq=%00", "/v1/audit/proofs/consistency?first=1&second=%00"]
    bad_ingest = ["/internal/v1/commands?client=%00&instance=00000000000000000", "/internal/v1/commands/%00/ack"]
    rids = []
    with shared_server.client("admin") as c:
        for i, path in enumerate(bad_admin):
            rid = f"probe-{i}-{uuid.uuid4().hex[:8]}"
            r = c.get(path, headers={"X-Request-ID": rid})
            assert r.status_code in (404, 422), (path, r.status_code, r.text)
            assert r.headers["content-type"] == "application/problem+json" and r.json()["request_id"] == rid
            rids.append(rid)
        r = c.get(f"/v1/erasure-requests/{uuid.uuid4()}")  # well formed, unknown
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
    transport = httpx.HTTPTransport(uds=str(shared_server.socket))
    with httpx.Client(base_url="http://sidecar", transport=transport,
                      headers={"Authorization": f"Bearer {shared_server.tokens['ingest']}"}) as c:
        for path in bad_ingest:
            r = c.request("POST" if path.endswith("/ack") else "GET", path, json={})
            assert r.status_code in (404, 422), (path, r.status_code, r.text)
    time.sleep(0.5)
    lines = log_lines(shared_server)
    assert not [x for x in lines if x.get("level") in ("error", "critical")], "a malformed parameter was an error"
    # every line a request logged names it: the probes' access lines by the id we sent
    assert all(x.get("request_id") for x in lines if "method" in x or x.get("event") == "unhandled error")
    logged = {x["request_id"] for x in lines if x.get("event") == "request"}
    assert set(rids) <= logged


def test_a_form_body_gets_415_saying_to_send_json(shared_server):
    with shared_server.client("erasure:write") as c:
        r = c.post("/v1/erasure-requests", headers={"Idempotency-Key": f"form-{uuid.uuid4().hex}",
                                                     "Content-Type": "application/x-www-form-urlencoded"},
                   content=json.dumps(ERASE))
    assert r.status_code == 415 and r.headers["content-type"] == "application/problem+json"
    assert "Content-Type: application/json" in r.json()["detail"]
    transport = httpx.HTTPTransport(uds=str(shared_server.socket))
    with httpx.Client(base_url="http://sidecar", transport=transport,
                      headers={"Authorization": f"Bearer {shared_server.tokens['ingest']}"}) as c:
        r = c.post("/internal/v1/events", content=b"client=a", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415


def test_a_body_with_a_bom_repeated_names_or_no_content_type_is_refused(shared_server):
    """Bytes that two JSON readers could read differently are refused, not read one way; a
    trailing slash is a 404, never a redirect to a Location made from the Host header."""
    body = json.dumps(ERASE).encode()
    repeated = b'{"tenant": "acme", "user": "u-123", "user": "u-456", "legal_basis": "gdpr-art17"}'
    nested = json.dumps({"client": "c", "instance": "0" * 16, "events": []})[:-1].encode() + \
        b', "stats": {"tokens_held": 1, "tokens_held": 2}}'
    with shared_server.client("erasure:write") as c:
        def post(content: bytes, headers: dict | None = None) -> httpx.Response:
            return c.post("/v1/erasure-requests", content=content,
                          headers={"Idempotency-Key": f"strict-{uuid.uuid4().hex}",
                                   "Content-Type": "application/json", **(headers or {})})

        for bad in (b"\xef\xbb\xbf" + body, repeated, body.decode().encode("utf-16")):
            r = post(bad)
            assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text
        r = c.post("/v1/erasure-requests", content=body, headers={"Idempotency-Key": f"bare-{uuid.uuid4().hex}"})
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["detail"]
        for path in ("/v1/erasure-requests/", "/healthz/"):
            r = c.request("POST" if path.startswith("/v1") else "GET", path, content=body,
                          headers={"Host": "evil.example", "Content-Type": "application/json",
                                   "Idempotency-Key": f"slash-{uuid.uuid4().hex}"})
            assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code)
        assert post(body).status_code == 202
    transport = httpx.HTTPTransport(uds=str(shared_server.socket))
    with httpx.Client(base_url="http://sidecar", transport=transport,
                      headers={"Authorization": f"Bearer {shared_server.tokens['ingest']}"}) as c:
        assert c.post("/internal/v1/events", content=nested, headers={"Content-Type": "application/json"}
                      ).status_code == 422
        assert c.post("/internal/v1/events", content=nested.replace(b', "tokens_held": 2', b"")).status_code == 415
        assert c.post("/internal/v1/events", content=nested.replace(b', "tokens_held": 2', b""),
                      headers={"Content-Type": "application/json"}).status_code == 200


def quick_start_curl() -> str:
    """The erasure curl command of docs/sidecar.md's "Running it", its continuation lines joined."""
    text = (ROOT / "docs" / "sidecar.md").read_text()
    section = text.split("## Running it", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"^curl .*?(?:\\\n.*?)*$", section, flags=re.M)
    assert m, "no curl line in docs/sidecar.md's 'Running it'"
    return m.group(0)


def test_the_quick_start_curl_line_creates_an_erasure_request(shared_server):
    line = quick_start_curl()
    assert "http://127.0.0.1:8470" in line
    # the quick start's key is fixed: a second run of the same line (the other database) has its own server
    r = subprocess.run(["bash", "-c", line.replace("http://127.0.0.1:8470", shared_server.url)],
                       env={"PATH": "/usr/bin:/bin", "TOKEN": shared_server.tokens["erasure:write"]},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body.get("state") == "received" and body.get("scope") == "user", body


def test_tokens_are_listed_without_secrets_and_expired_or_revoked_ones_get_401(shared_server):
    env = shared_server.env
    name = f"ops-{uuid.uuid4().hex[:8]}"
    token = kvguard(["token", "create", "--scope", "audit:read", "--name", name, "--expires-in", "1h"], env)
    short = kvguard(["token", "create", "--scope", "audit:read", "--name", name + "-short", "--expires-in", "1s"],
                    env)
    bound = kvguard(["token", "create", "--scope", "ingest", "--name", name + "-pool", "--tenant", "a",
                     "--tenant", "b"], env)

    def status(tok: str) -> int:
        return httpx.get(shared_server.url + "/v1/audit/checkpoint", headers={"Authorization": f"Bearer {tok}"},
                         timeout=30).status_code

    assert status(token) == 200
    time.sleep(1.2)
    assert status(short) == 401  # expired

    listing = kvguard(["token", "list"], env)
    rows = {line.split()[1]: line.split() for line in listing.splitlines()[1:]}
    assert listing.splitlines()[0].split() == ["ID", "NAME", "SCOPES", "TENANTS", "CREATED", "EXPIRES", "STATE"]
    assert rows[name][2:4] == ["audit:read", "all"] and rows[name][-1] == "active" and rows[name][5] != "-"
    assert rows[name + "-short"][-1] == "expired"
    assert rows[name + "-pool"][3] == "2" and rows[name + "-pool"][5] == "-"
    for secret in (token, short, bound):
        assert secret not in listing and hashlib.sha256(secret.encode()).hexdigest() not in listing

    kvguard(["token", "revoke", rows[name][0]], env)
    assert status(token) == 401
    assert kvguard(["token", "list"], env).count("revoked") == 1 + listing.count("revoked")
    r = subprocess.run([*kvguard_cmd(), "token", "revoke", "no-such-id"], env=env, capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "no token with id" in r.stderr and "Traceback" not in r.stderr


def kvguard_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "kvguard"]


def test_an_unhandled_error_is_logged_with_the_request_id_the_answer_gives(tmp_path, capsys):
    from fastapi.testclient import TestClient

    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.logs import configure
    from kvguard.sidecar.service import Sidecar
    from kvguard.sidecar.settings import load_settings

    configure("json")
    sidecar = Sidecar(load_settings(data_dir=tmp_path, environment="development", audit_sign_process=False))
    try:
        app = create_app(sidecar)

        @app.get("/v1/boom")
        def boom():
            raise RuntimeError("a bug")

        with TestClient(app, raise_server_exceptions=False) as c:
            r = c.get("/v1/boom", headers={"X-Request-ID": "quote-me-42"})
    finally:
        sidecar.close()
    assert r.status_code == 500 and r.json()["request_id"] == "quote-me-42"
    assert r.headers["X-Request-ID"] == "quote-me-42"
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    crash = [x for x in lines if x["event"] == "unhandled error"]
    assert len(crash) == 1 and crash[0]["request_id"] == "quote-me-42" and "RuntimeError" in crash[0]["exception"]
