"""A real `kvguard witness` process beside an in-process sidecar: keygen, serve, the sidecar's
checkpoints cosigned, a witnessed bundle verified by the CLI, then a witness outage that does
not stop signing and shows in /readyz and the metrics."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
from fastapi.testclient import TestClient
from kvguard.audit.cli import main as audit_cli
from kvguard.audit.keys import SigningKey

from kvguard.cli import main as kvguard_main
from kvguard.sidecar.app import create_app
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.settings import load_settings
from tests.audit.audit_testlib import fill
from tests.sidecar.conftest import free_port

NAME = "witness.test/real"


def _until(check, what: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_witness_process_cosigns_a_sidecars_checkpoints(tmp_path, origin, capsys):
    kvguard = [sys.executable, "-m", "kvguard"]
    wkey, vkey = tmp_path / "witness.key", tmp_path / "witness.vkey"
    assert kvguard_main(["witness", "keygen", str(wkey), "--name", NAME, "--vkey", str(vkey)]) == 0
    assert capsys.readouterr().out.strip() == vkey.read_text().strip() and wkey.stat().st_mode & 0o077 == 0
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    log_key = SigningKey.generate()
    log_key.save(data / "signing.key")
    (tmp_path / "log.pub").write_text(log_key.public_key.to_pem())
    port = free_port()
    proc = subprocess.Popen([*kvguard, "witness", "serve", "--name", NAME, "--key", str(wkey), "--port", str(port),
                             "--log", f"{origin}={tmp_path / 'log.pub'}", "--log-format", "json"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    sidecar = None
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stderr.read()
                return False

        _until(up, "the witness to listen")
        settings = load_settings(data_dir=data, environment="development", audit_sign_process=False, origin=origin,
                                 witnesses=[{"url": url, "vkey": vkey.read_text()}], witness_retry_max_s=0.2)
        sidecar = Sidecar(settings)
        fill(sidecar.log, 12)
        size = sidecar.log.checkpoint().size
        _until(lambda: sidecar.witnessing.targets[0].size == size, "the checkpoint's cosignature")
        api = TestClient(create_app(sidecar))
        assert api.get("/readyz").json()["witnesses"] == {NAME: "ok"}
        assert f'kvguard_witness_cosigned_size{{witness="{NAME}"}} {size}.0' in sidecar.metrics.render().decode()

        bundle = tmp_path / "b.zip"
        assert audit_cli(["export", "--database-url", settings.db_url, "--origin", origin, "--key",
                          str(data / "signing.key"), "-o", str(bundle), "--witnessed", "--no-progress"]) == 0
        assert audit_cli(["verify", str(bundle), "--public-key", str(tmp_path / "log.pub"),
                          "--witness-key", str(vkey)]) == 0

        proc.terminate()
        proc.wait(timeout=10)
        fill(sidecar.log, 3)  # signing goes on without the witness
        sidecar.log.checkpoint()
        _until(lambda: "unreachable" in sidecar.witness_status()[NAME], "the outage to show")
        ready = api.get("/readyz")
        assert ready.status_code == 200 and "unreachable" in ready.json()["witnesses"][NAME]
        metrics = sidecar.metrics.render().decode()
        assert f'kvguard_witness_failures_total{{reason="unreachable",witness="{NAME}"}}' in metrics
        assert f'kvguard_witness_ok{{witness="{NAME}"}} 0.0' in metrics
    finally:
        if sidecar is not None:
            sidecar.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
