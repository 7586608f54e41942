"""A witness's cosigning rate: sequential add-checkpoint round trips to a real `kvguard witness
serve` on loopback, its state in SQLite, as a ratio against raw Ed25519 signing in this process.

    .venv/bin/python benchmarks/audit/witness_bench.py [--checkpoints 300] [--records 256]

Each request carries a checkpoint `--records` records larger than the last and the
consistency proof to it, as a sidecar sends them; the witness verifies the log's signature
and the proof, updates its state and cosigns. A sidecar checkpoints about once a second,
so one witness serves that many sidecars per second of this rate.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from kvguard.audit.checkpoint import Checkpoint
from kvguard.audit.keys import SigningKey
from kvguard.audit.merkle import leaf_hash
from kvguard.audit.tree import HashTree

ORIGIN = "bench.kvguard.example/log"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bodies(key: SigningKey, n: int, per: int) -> list[bytes]:
    tree, old, out = HashTree(), 0, []
    for _ in range(n):
        for _ in range(per):
            tree.append(leaf_hash(tree.size.to_bytes(8, "big")))
        proof = tree.consistency_proof(old, tree.size) if old else []
        note = Checkpoint(ORIGIN, tree.size, tree.root()).sign(key)
        out.append((f"old {old}\n" + "".join(base64.b64encode(h).decode() + "\n" for h in proof) + "\n" + note).encode())
        old = tree.size
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", type=int, default=300)
    p.add_argument("--records", type=int, default=256, help="records between two checkpoints")
    args = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="witness-bench-"))
    witness_key, log_key = SigningKey.generate(), SigningKey.generate()
    witness_key.save(d / "w.key")
    (d / "log.pub").write_text(log_key.public_key.to_pem())
    bodies = _bodies(log_key, args.checkpoints, args.records)
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "kvguard", "witness", "serve", "--name", "w.bench/1",
                             "--key", str(d / "w.key"), "--log", f"{ORIGIN}={d / 'log.pub'}", "--port", str(port),
                             "--database-url", f"sqlite:///{d / 'w.db'}", "--log-format", "json"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}")
        for _ in range(300):
            try:
                client.get("/healthz")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        started = time.perf_counter()
        for body in bodies:
            r = client.post("/add-checkpoint", content=body)
            if r.status_code != 200:
                print(f"witness answered {r.status_code}: {r.text}", file=sys.stderr)
                return 1
        seconds = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait()
    msg, n = hashlib.sha256(b"x").digest() * 4, 2000
    t = time.perf_counter()
    for _ in range(n):
        log_key.sign(msg)
    sign_rate = n / (time.perf_counter() - t)
    rate = args.checkpoints / seconds
    print(f"{args.checkpoints} checkpoints of {args.records} records each (tree up to "
          f"{args.checkpoints * args.records}) cosigned in {seconds:.2f} s: {rate:.0f}/s, "
          f"{seconds / args.checkpoints * 1000:.1f} ms a round trip; raw Ed25519 signing here "
          f"{sign_rate:.0f}/s, ratio {rate / sign_rate:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
