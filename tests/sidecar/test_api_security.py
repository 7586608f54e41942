"""Every route refuses unauthenticated and wrong-scope calls; each listener serves its own
routes only; the schema is for admin tokens and documents the problem+json errors; malformed
input never gets a 500 (a bounded schemathesis run against the OpenAPI schemas)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.sidecar.conftest import kvguard, start_server

OPEN = {"/healthz", "/readyz"}
SCOPE_OF = [("/v1/erasure-requests", {"post": "erasure:write", "get": "erasure:read"}),
            ("/v1/audit", {"get": "audit:read", "post": "admin"}), ("/metrics", {"get": "audit:read"}),
            ("/v1/keys", {"post": "admin"}), ("/internal/v1", {"get": "ingest", "post": "ingest"})]


def needed_scope(path: str, method: str) -> str:
    for prefix, by_method in SCOPE_OF:
        if path.startswith(prefix):
            return by_method[method]
    raise AssertionError(f"no scope known for {method} {path}: add it to the table")


def http(server, listener: str, token: str | None = None) -> httpx.Client:
    """A client of the admin listener (TCP) or of the ingest listener (the Unix socket)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if listener == "admin":
        return httpx.Client(base_url=server.url, headers=headers, timeout=30)
    return httpx.Client(base_url="http://sidecar", transport=httpx.HTTPTransport(uds=str(server.socket)),
                        headers=headers, timeout=30)


def schema_of(server, listener: str) -> dict:
    with http(server, listener, server.tokens["admin"]) as c:
        r = c.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def test_every_route_refuses_missing_and_wrong_scopes(server):
    checked = 0
    for listener in ("admin", "ingest"):
        for path, ops in schema_of(server, listener)["paths"].items():
            if path in OPEN:
                continue
            for method in ops:
                concrete = path.replace("{request_id}", "x").replace("{command_id}", "x")
                scope = needed_scope(path, method)
                with http(server, listener) as anon:
                    r = anon.request(method, concrete)
                    assert r.status_code == 401, (method, path, r.status_code)
                    assert r.headers["content-type"] == "application/problem+json"
                    r = anon.request(method, concrete, headers={"Authorization": "Bearer kvg_forged"})
                    assert r.status_code == 401, (method, path)
                for other in ("erasure:write", "erasure:read", "audit:read", "ingest"):
                    if other != scope:
                        with http(server, listener, server.tokens[other]) as c:
                            assert c.request(method, concrete).status_code == 403, (method, path, other)
                checked += 1
    assert checked >= 10


def test_each_listener_serves_its_own_routes_only(shared_server):
    """The admin API is not on the ingest socket, the ingest API not on TCP, and the schema
    (one per listener) only for an admin token; there are no /docs or /redoc pages."""
    server = shared_server
    admin, ingest = schema_of(server, "admin")["paths"], schema_of(server, "ingest")["paths"]
    assert "/v1/erasure-requests" in admin and not any(p.startswith("/internal/") for p in admin)
    assert "/internal/v1/events" in ingest and all(p.startswith("/internal/") for p in ingest)
    with http(server, "admin", server.tokens["admin"]) as c:
        assert c.post("/internal/v1/events", json={}).status_code == 404
        assert c.get("/internal/v1/commands", params={"client": "a", "instance": "0" * 16}).status_code == 404
        for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert c.get(page).status_code == 404, page
    with http(server, "ingest", server.tokens["admin"]) as c:
        for path in ("/v1/erasure-requests/" + "0" * 8 + "-0000-0000-0000-" + "0" * 12, "/v1/audit/checkpoint",
                     "/metrics", "/readyz"):
            assert c.get(path).status_code == 404, path
    for listener in ("admin", "ingest"):
        with http(server, listener) as anon:
            assert anon.get("/openapi.json").status_code == 401
        for scope in ("erasure:write", "erasure:read", "audit:read", "ingest"):
            with http(server, listener, server.tokens[scope]) as c:
                assert c.get("/openapi.json").status_code == 403, (listener, scope)


def test_the_schema_documents_the_problems_each_route_sends(shared_server):
    """401/403/404/415/422/503 are documented as application/problem+json, never as FastAPI's
    default validation error; each documented status is one the route really sends."""
    server = shared_server
    for listener in ("admin", "ingest"):
        schema = schema_of(server, listener)
        assert "HTTPValidationError" not in str(schema) and "ProblemDetails" in schema["components"]["schemas"]
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                codes = {int(c) for c in op["responses"] if c.isdigit() and int(c) >= 400}
                want = set() if path == "/healthz" else {503}
                if path not in OPEN:
                    want |= {401, 403}
                if op.get("parameters") or op.get("requestBody"):
                    want.add(422)
                if op.get("requestBody"):
                    want.add(415)
                if path in ("/v1/erasure-requests/{request_id}", "/internal/v1/keys/check"):  # no such request, key
                    want.add(404)
                if path in ("/v1/keys/kek/rotate", "/v1/audit/check"):  # one run at a time (of the database)
                    want.add(409)
                assert codes == want, (method, path, codes)
                for code in codes:
                    content = op["responses"][str(code)]["content"]
                    assert list(content) == ["application/problem+json"], (method, path, code)
                    assert content["application/problem+json"]["schema"]["$ref"].endswith("/ProblemDetails")


def test_open_routes_reveal_nothing(server):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").json()["status"] == "ready"
    with server.client("audit:read") as c:
        text = c.get("/metrics").text
    assert "kvguard_audit_records_written" in text and "kvguard_erasure_requests_overdue" in text


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    s = start_server(tmp, f"sqlite:///{tmp / 'audit.db'}")
    s.tokens["all"] = kvguard(["token", "create", "--scope", "admin", "--scope", "ingest", "--name", "fuzz"], s.env)
    yield s
    s.stop()


def send(c: httpx.Client, kwargs: dict) -> httpx.Response:
    """Send a schemathesis case's request (requests-style keyword arguments) with httpx."""
    kwargs = {k: v for k, v in kwargs.items() if k != "cookies"}
    if isinstance(kwargs.get("data"), (bytes, str)):
        kwargs["content"] = kwargs.pop("data")
    return c.request(**kwargs)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_malformed_input_never_gets_a_500(fuzz_server, mode):
    """Bounded: 15 generated requests per operation and mode, valid and malformed, on both
    listeners."""
    token = fuzz_server.tokens["all"]
    ops = [(listener, r.ok()) for listener in ("admin", "ingest")
           for r in schemathesis.openapi.from_dict(schema_of(fuzz_server, listener)).get_all_operations()]
    assert len(ops) >= 13
    fuzzed = 0
    for listener, op in ops:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            if case.path == "/internal/v1/commands" and isinstance(case.query, dict):
                case.query["wait"] = 0  # no long polls in a fuzz run
            with http(fuzz_server, listener, token) as c:  # noqa: B023 (run is called in this turn)
                # our token over whatever the case drew for the bearer scheme
                r = send(c, case.as_transport_kwargs(base_url=str(c.base_url).rstrip("/"),
                                                     headers={"Authorization": f"Bearer {token}"}))
            assert r.status_code < 500, (case.as_curl_command(), r.status_code, r.text[:500])

        try:
            run()
            fuzzed += 1
        except Unsatisfiable:  # an operation without inputs has no malformed variant
            assert mode == GenerationMode.NEGATIVE
        except Exception as e:  # show what the server logged about it
            tail = (fuzz_server.data_dir.parent / "serve.log").read_text()[-4000:]
            raise AssertionError(f"{op.label}: {e}\n--- serve.log ---\n{tail}") from e
    assert fuzzed >= 8


def test_production_refuses_insecure_settings(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVGUARD_DATA_DIR": str(tmp_path / "d"), "KVGUARD_PORT": "0"}
    r = subprocess.run([sys.executable, "-m", "kvguard", "serve"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "no admin API token exists" in r.stderr
    kvguard(["token", "create", "--scope", "admin"], env)
    key = tmp_path / "d" / "signing.key"
    kvguard(["keygen", str(key)], env)
    key.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "kvguard", "serve"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "chmod 600" in r.stderr


@pytest.mark.parametrize("url", ["postgresql+psycopg://kvguard:s3cret@db/audit",
                                 "postgresql+psycopg://kvguard@db/audit?password=s3cret"])
def test_production_refuses_a_database_password_in_the_url(tmp_path, url):
    from kvguard.errors import ConfigError
    from kvguard.sidecar.settings import Settings, check_secure

    for name in ("index.key", "seal.key"):
        (tmp_path / name).write_text("00")
    (tmp_path / "kek").mkdir()
    settings = Settings(data_dir=tmp_path, database_url=url)
    with pytest.raises(ConfigError, match="password is in the URL"):
        check_secure(settings, tokens_exist=True)
    check_secure(Settings(data_dir=tmp_path, database_url="postgresql+psycopg://kvguard@db/audit"), tokens_exist=True)


def test_bad_settings_are_one_clear_error_without_their_values(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVGUARD_DATA_DIR": str(tmp_path / "d"), "KVGUARD_PORT": "abc",
           "KVGUARD_DATABASE_URL": "sqlite:////s3cret-path/audit.db", "KVGUARD_INFERENCE_LIVE_S": "-1"}
    r = subprocess.run([sys.executable, "-m", "kvguard", "token", "create", "--scope", "admin"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "port (KVGUARD_PORT): Input should be a valid integer" in r.stderr
    assert "inference_live_s (KVGUARD_INFERENCE_LIVE_S)" in r.stderr and "abc" not in r.stderr


def test_the_retention_limit_comes_from_the_deployment_policy(tmp_path):
    from pathlib import Path

    from kvguard.errors import ConfigError
    from kvguard.policy import load_policy
    from kvguard.sidecar.settings import load_settings

    chat = Path(__file__).resolve().parents[2] / "policies" / "chat.yaml"
    limit = load_policy(chat).retention.seconds
    assert load_settings(data_dir=tmp_path, policy_file=chat).retention_max_age_s == limit
    assert load_settings(data_dir=tmp_path, policy_file=chat, retention_max_age_s=limit).retention_max_age_s == limit
    with pytest.raises(ConfigError, match=r"retention_max_age_s is 60 s but the policy .*chat.yaml says"):
        load_settings(data_dir=tmp_path, policy_file=chat, retention_max_age_s=60)
    bad = tmp_path / "bad.yaml"
    bad.write_text(chat.read_text().replace("retention:", "retentoin:"))
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: retentoin"):
        load_settings(data_dir=tmp_path, policy_file=bad)
