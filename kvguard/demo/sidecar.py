"""The sidecar half of `make demo`, on embedded defaults (SQLite in a fresh data dir):

1. create an admin token and start `kvguard serve` on loopback;
2. an inference process's cache (INT8 pages, H2O eviction, a disk tier) streams
   its events through the Unix socket while three users decode;
3. erase one user through the admin API, wait for the signed receipt;
4. verify the receipt offline with nothing but the public key, and show that
   the other users were not touched and the log verifies.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from ..cache import CacheConfig, CacheManager
from ..cache.tiers import DiskTier
from ..client import SidecarClient
from ..types import Subject


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvguard(args: list[str], env: dict) -> str:
    r = subprocess.run([sys.executable, "-m", "kvguard", *args], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"kvguard {' '.join(args)} failed:\n{r.stderr}")
    return r.stdout.strip()


def _step(title: str) -> None:
    print(f"\n== {title}")


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="kvguard-demo-"))
    data = root / "data"
    port = _port()
    env = {**os.environ, "KVGUARD_DATA_DIR": str(data), "KVGUARD_PORT": str(port),
           "KVGUARD_ORIGIN": "demo.kvguard/sidecar-0", "KVGUARD_LOG_FORMAT": "json",
           # the demo's one process connects at once: erasures need not wait 30 s for others
           "KVGUARD_INFERENCE_LIVE_S": "5"}
    _step(f"kvguard serve on SQLite in {data}")
    admin = _kvguard(["token", "create", "--scope", "admin", "--name", "demo-admin"], env)
    ingest = _kvguard(["token", "create", "--scope", "ingest", "--name", "demo-inference"], env)
    log_file = open(root / "serve.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "kvguard", "serve"], env=env, stdout=log_file,
                              stderr=log_file)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200 and (data / "ingest.sock").exists():
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit((root / "serve.log").read_text())
            time.sleep(0.1)
        print(f"ready: {httpx.get(url + '/readyz').json()}")
        return _drive(url, admin, ingest, data, root)
    finally:
        server.terminate()
        server.wait(20)
        if os.environ.get("KVGUARD_DEMO_KEEP"):
            print(f"\n(kept {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _drive(url: str, admin: str, ingest: str, data: Path, root: Path) -> int:
    _step("an inference process decodes for three users (INT8 pages, H2O, a disk tier)")
    cfg = CacheConfig(num_layers=4, num_kv_heads=3, num_query_heads=9, head_dim=64, num_pages=2048,
                      codec="int8", fp_sink=4, evictor="h2o",
                      evictor_options={"budget": 256, "sink": 4, "window": 64})
    cache = CacheManager(cfg, tiers={"disk": DiskTier(root / "tier")})
    g = torch.Generator().manual_seed(0)
    users = {"alice": None, "bob": None, "carol": None}
    outputs: dict[str, list[torch.Tensor]] = {u: [] for u in users}
    with SidecarClient(cache, socket=data / "ingest.sock", token=ingest, client_id="demo-proc") as client:
        for user in users:
            users[user] = client.open(Subject("acme-bank", f"{user}@example.com", f"{user}-session"))
        for step in range(48):
            t = 200 if step == 0 else 8
            for user, seq in users.items():
                if seq not in cache.sequences():
                    continue
                for layer in range(cfg.num_layers):
                    k, v = (torch.randn(t, 3, 64, generator=g).half() for _ in "kv")
                    cache.append(seq, layer, k, v)
                    outputs[user].append(cache.attend(seq, layer, torch.randn(t, 9, 64, generator=g).half()))
        cache.offload(users["alice"], "disk", max_pages=4)  # alice's oldest pages go to the disk tier
        client.flush(30)
        st = cache.stats()
        print(f"held {st.tokens_held} tokens in {sum(st.pages_used.values())} pages, evicted "
              f"{st.tokens_evicted}, {st.bytes_held:,} bytes ({st.saving:.0%} saved against 16-bit)")
        headers = {"Authorization": f"Bearer {admin}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            ops = {}
            after = -1
            while after is not None:
                page = api.get("/v1/audit/records", params={"after": after, "limit": 1000}).json()
                for r in page["records"]:
                    ops[r["op"]] = ops.get(r["op"], 0) + 1
                after = page["next_after"]
            print(f"signed audit records so far: {ops}")

            _step("erase alice (GDPR Art. 17) through the admin API")
            r = api.post("/v1/erasure-requests", headers={"Idempotency-Key": "demo-ticket-0001"},
                         json={"tenant": "acme-bank", "user": "alice@example.com", "legal_basis": "gdpr-art17"})
            print(f"POST /v1/erasure-requests -> {r.status_code} {r.json()['state']}, deadline in "
                  f"{(r.json()['deadline_ms'] - r.json()['received_ms']) // 86_400_000} days")
            rid = r.json()["id"]
            for _ in range(600):
                body = api.get(f"/v1/erasure-requests/{rid}").json()
                if body["state"] in ("completed", "failed"):
                    break
                time.sleep(0.1)
            print(f"state: {body['state']}; erased: {json.dumps(body['result']['tiers'])}")
            keys = api.get("/v1/audit/public-keys").json()
        print(f"alice's sequences left: {sum(1 for s in cache.sequences() if cache.subject_of(s).user.startswith('alice'))}; "
              f"bob and carol still open: {users['bob'] in cache.sequences() and users['carol'] in cache.sequences()}")

    _step("verify the receipt offline, with the public key alone")
    receipt_file, key_file = root / "receipt.json", root / "log.pub"
    receipt_file.write_text(json.dumps(body["receipt"], indent=2))
    key_file.write_text(keys[0]["public_key_pem"])
    from kvguard.audit.keys import PublicKey
    from kvguard.audit.receipt import verify_fleet_receipt

    # the fleet receipt: one receipt per sidecar of the database; here the fleet is this one sidecar
    verify_fleet_receipt(json.loads(receipt_file.read_text()), [PublicKey.load(key_file)])
    (part,) = body["receipt"]["receipts"]
    rec = part["record"]
    print(f"receipt verified: record #{rec['seq']} op={rec['op']} subject={rec['subject']} signed by key "
          f"{rec['key_id'][:16]}…, included in the signed checkpoint of size {part['tree_size']}")
    print("checkpoint:\n  " + part["checkpoint"].replace("\n", "\n  ").rstrip())

    _step("seal the whole log into an audit bundle and verify it as an auditor would")
    env = {**os.environ, "KVGUARD_DATABASE_URL": f"sqlite:///{data / 'audit.db'}"}
    bundle = root / "audit-bundle.kvg"
    _kvguard(["audit", "export", "--origin", "demo.kvguard/sidecar-0", "--key", str(data / "signing.key"),
              "-o", str(bundle), "--no-progress"], env)
    print(f"exported {bundle.name} ({bundle.stat().st_size:,} bytes)")
    print(_kvguard(["audit", "verify", str(bundle), "--public-key", str(key_file)], env))
    print("\nDone: every cache operation above is a signed record in the log, and the erasure has a receipt.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
