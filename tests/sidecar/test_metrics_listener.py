"""The metrics listener: /metrics, /healthz and /readyz without a token on a port of their own,
for Prometheus and the kubelet; nothing else is served there, and no metric carries a subject."""

from __future__ import annotations

import os
import re

import httpx
import pytest
from kvguard.audit.ops import OPS
from kvguard.audit.store import migrate
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from kvguard.cache.events import SequenceFreed
from kvguard.errors import ConfigError
from kvguard.sidecar.app import metrics_app
from kvguard.sidecar.metrics import CODECS, TIERS
from kvguard.sidecar.settings import load_settings
from kvguard.types import Subject
from tests.sidecar.conftest import free_port, kvguard, start_server

# Every label a metric may have, and what its values may be: fixed sets, never an id.
LABELS = {
    "op": lambda v: v in OPS,
    "state": lambda v: v in ("received", "executing", "completed", "failed", "live", "down"),  # requests; sidecars
    "tier": lambda v: v in TIERS,
    "codec": lambda v: v in CODECS,
    "status": lambda v: re.fullmatch(r"[1-5][0-9]{2}", v) is not None,
    "reason": lambda v: re.fullmatch(r"[a-z_]{1,32}", v) is not None,  # ingest.py's fixed reasons
    "le": lambda v: True,  # histogram buckets
}


@pytest.fixture
def metered(tmp_path, db_url):
    port = free_port()
    env = {"KVGUARD_DATA_DIR": str(tmp_path / "data"), "KVGUARD_DATABASE_URL": db_url}
    if db_url.startswith("postgresql"):
        migrate(db_url)  # as `kvguard db upgrade` does before the first start: the owner migrates
    tokens = {scope: kvguard(["token", "create", "--scope", scope, "--name", scope], {**os.environ, **env})
              for scope in ("admin", "ingest")}  # only these two: each is a process start
    s = start_server(tmp_path, db_url, tokens=tokens, extra_env={"KVGUARD_METRICS_PORT": str(port),
                                                                 "KVGUARD_METRICS_HOST": "127.0.0.1"})
    s.metrics_url = f"http://127.0.0.1:{port}"
    yield s
    s.stop()


def test_probes_and_metrics_without_a_token_and_no_subject_in_any_label(metered):
    subject = {"tenant": "tenant-9051", "user": "raw-user-9051", "session": "raw-session-9051"}
    freed = SequenceFreed(1, Subject(**subject), ("hot:0",), 4, 0)
    batch = {"client": "pod-9051", "instance": "9051" * 4,
             "events": [{"n": 0, "op": freed.op, "subject": subject, "details": freed.details()},
                        {"n": 1, "op": "bogus", "subject": subject, "details": {}}],  # an ingest_error
             "stats": {"codec": "int8", "pages_used": {"main": 3}, "pages_offloaded": {"disk": 2}},
             "sessions": [{"subject": subject, "opened_ms": 1}]}
    with metered.ingest(metered.tokens["ingest"]) as c:
        assert c.post("/internal/v1/events", json=batch).status_code == 200
    with metered.ingest("not-a-token") as c:
        assert c.post("/internal/v1/events", json=batch).status_code == 401
    with httpx.Client(base_url=metered.metrics_url, timeout=10) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz")
        assert ready.status_code == 200 and set(ready.json()["checks"].values()) == {"ok"}
        text = c.get("/metrics").text
        # the admin API and the ingest API are not served here, with or without a token
        for path in ("/v1/erasure-requests/x", "/v1/audit/records", "/openapi.json", "/internal/v1/events", "/docs"):
            assert c.get(path).status_code == 404, path
        assert c.get("/v1/audit/records", headers={"Authorization": f"Bearer {metered.tokens['admin']}"}
                     ).status_code == 404
        refused = c.post("/metrics", content=b"x" * 1000)
        assert refused.status_code == 405 and refused.headers["content-type"] == "application/problem+json"
    for line in ('kvguard_audit_records_written_total{op="free"} 1.0', 'kvguard_cache_pages{codec="int8",tier="disk"} 2.0',
                 'kvguard_ingest_batches_refused_total{status="401"} 1.0', "kvguard_inference_processes_live 1.0"):
        assert line in text, line
    assert 'kvguard_ingest_events_refused_total{reason="' in text
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("kvguard_"), family.name
        for sample in family.samples:
            for label, value in sample.labels.items():
                assert label in LABELS and LABELS[label](value), (sample.name, label, value)
    for secret in (*subject.values(), "pod-9051", "9051" * 4, metered.tokens["ingest"]):
        assert secret not in text


class _Failing:
    """A sidecar whose database is down, as readiness() reports it."""

    def readiness(self) -> dict[str, str]:
        return {"database": "unreachable: OperationalError at db.internal:5432", "signing_key": "ok"}


def test_open_readiness_names_the_failing_check_but_not_why():
    with TestClient(metrics_app(_Failing())) as c:
        r = c.get("/readyz")
    assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["checks"] == {"database": "failing", "signing_key": "ok"}
    assert "db.internal" not in r.text and "OperationalError" not in r.text


def test_the_metrics_port_must_differ_from_the_admin_port(monkeypatch):
    monkeypatch.setenv("KVGUARD_PORT", "9470")
    monkeypatch.setenv("KVGUARD_METRICS_PORT", "9470")
    with pytest.raises(ConfigError, match="metrics_port and port are both 9470"):
        load_settings()
