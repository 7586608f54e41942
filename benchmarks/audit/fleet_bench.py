"""A fleet under load: N `kvguard serve` sidecars on one PostgreSQL database, each with an
inference process streaming events, and an erasure request every second.

    .venv/bin/python benchmarks/audit/fleet_bench.py [--sidecars 8] [--seconds 30] [--batch 32]
                                               [--events-per-s R] [--small]

Each sidecar is a real `kvguard serve` process (production mode, records signed in its
child process) with its own origin and key; the processes are threads of this script
(one per sidecar, each sending batches of `quantize` events over the sidecar's Unix socket
as fast as they are acknowledged, or paced with --events-per-s, and answering erase commands at once, like
`SidecarClient`). Every second one erasure request goes to the next sidecar in turn; it
completes when every sidecar's process has erased, the secrets are destroyed once and
each sidecar has signed its record. Prints a Markdown table: aggregate records/s (events
acknowledged as durable, one record each) and erasure latency (POST to `completed`, seen
by polling every 50 ms) p50 / p99 / max.

All of it shares this machine's CPUs: the sidecars, their signing processes, PostgreSQL
and this script's load threads. Exits 1 if an erasure did not complete.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.sidecar.conftest import start_server  # noqa: E402

ENV = {"KVGUARD_INFERENCE_LIVE_S": "1", "KVGUARD_LOG_LEVEL": "warning"}
ZERO = dict.fromkeys(("pages", "bytes", "sequences", "shared_pages", "tier_copies", "prefix_entries"), 0)


def event(n: int) -> dict:
    return {"n": n, "op": "quantize", "subject": {"tenant": "acme", "user": f"u{n % 7}", "session": f"s{n % 13}"},
            "details": {"seq": n % 13, "pages": [f"main:{n % 256}"], "n_tokens": 16}}


class Process:
    """One inference process of one sidecar: a sender thread and a command thread."""

    def __init__(self, server, name: str, batch: int, rate: float | None = None) -> None:
        self.server, self.batch, self.rate, self.stop = server, batch, rate, threading.Event()
        self.who = {"client": name, "instance": uuid.uuid4().hex[:16]}
        self.recorded = 0
        self.threads = [threading.Thread(target=self._send, daemon=True),
                        threading.Thread(target=self._answer, daemon=True)]

    def _client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.server.socket)), base_url="http://sidecar",
                            headers={"Authorization": f"Bearer {self.server.tokens['ingest']}"}, timeout=30)

    def _send(self) -> None:
        n, t0 = 0, time.monotonic()
        if self.rate == 0:
            return
        with self._client() as c:
            while not self.stop.is_set():
                if self.rate is not None:  # paced: no more than `rate` events a second
                    time.sleep(max(0.0, t0 + n / self.rate - time.monotonic()))
                r = c.post("/internal/v1/events", json={**self.who, "events": [event(i) for i in range(n, n + self.batch)]})
                if r.status_code == 200:
                    n = r.json()["up_to"] + 1
                    self.recorded += r.json()["recorded"]

    def _answer(self) -> None:
        with self._client() as c:
            while not self.stop.is_set():
                try:
                    for cmd in c.get("/internal/v1/commands", params={**self.who, "wait": 1}).json():
                        c.post(f"/internal/v1/commands/{cmd['id']}/ack", json={**self.who, "result": ZERO})
                except (httpx.HTTPError, ValueError, TypeError):
                    time.sleep(0.05)


def start_fleet(tmp: Path, db_url: str, n: int):
    first = start_server(tmp / "s0", db_url, extra_env=ENV)
    for i in range(1, n):  # the index and seal keys are the fleet's, shared
        data = tmp / f"s{i}" / "data"
        data.mkdir(parents=True, mode=0o700)
        for name in ("index.key", "seal.key"):
            shutil.copy2(first.data_dir / name, data / name)
    with ThreadPoolExecutor(4) as pool:
        rest = list(pool.map(lambda i: start_server(tmp / f"s{i}", db_url, tokens=first.tokens, extra_env=ENV),
                             range(1, n)))
    return [first, *rest]


def run(db_url: str, n: int, seconds: float, batch: int, rate: float | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-fleet-bench-"))
    servers, procs = [], []
    try:
        t0 = time.monotonic()
        servers = start_fleet(tmp, db_url, n)
        print(f"{n} sidecars ready in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        procs = [Process(s, f"bench-{i}", batch, rate) for i, s in enumerate(servers)]
        for p in procs:
            for t in p.threads:
                t.start()
        time.sleep(1.5)  # past each sidecar's reconnect window: erasures run from here on
        posted: dict[str, float] = {}
        latencies: dict[str, float] = {}
        done = threading.Event()

        def watch() -> None:  # on a thread of its own, so that posting keeps to its second
            with servers[0].client("admin") as c:
                while not done.is_set():
                    for rid, t in list(posted.items()):
                        if rid not in latencies and c.get(f"/v1/erasure-requests/{rid}").json()["state"] == "completed":
                            latencies[rid] = time.monotonic() - t
                    time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        start_recorded, start = sum(p.recorded for p in procs), time.monotonic()
        clients = [s.client("admin") for s in servers]
        for k in range(int(seconds)):  # one erasure a second, to the next sidecar in turn
            time.sleep(max(0.0, start + k - time.monotonic()))
            sent = time.monotonic()
            r = clients[k % n].post("/v1/erasure-requests", json={
                "tenant": "acme", "user": f"erased-{k}", "legal_basis": "gdpr-art17"},
                headers={"Idempotency-Key": f"bench-{uuid.uuid4().hex}"})
            r.raise_for_status()
            posted[r.json()["id"]] = sent
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        recorded_at_end, end = sum(p.recorded for p in procs), time.monotonic()
        deadline = end + 60
        while len(latencies) < len(posted) and time.monotonic() < deadline:
            time.sleep(0.1)
        done.set()
        watcher.join(5)
        for c in clients:
            c.close()
        lat = sorted(latencies.values())
        return {"sidecars": n, "seconds": end - start, "records_per_s": (recorded_at_end - start_recorded) / (end - start),
                "erasures": len(posted), "completed": len(lat),
                "p50": statistics.median(lat) if lat else float("nan"),
                "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
                "max": lat[-1] if lat else float("nan")}
    finally:
        for p in procs:
            p.stop.set()
        for s in servers:
            s.stop()
        for p in procs:
            for t in p.threads:
                t.join(5)
        shutil.rmtree(tmp, ignore_errors=True)


def scratch_database():
    import sqlalchemy as sa

    from tests.sidecar.conftest import PG_ADMIN

    name = f"kvguard_fleet_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop():
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", drop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sidecars", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30, help="how long the load and the erasures run")
    p.add_argument("--batch", type=int, default=32, help="events per batch a process sends")
    p.add_argument("--events-per-s", type=float, help="pace each process to this many events a second (0: none; "
                   "default: as fast as the sidecar acknowledges)")
    p.add_argument("--small", action="store_true", help="a quick run: 2 sidecars, 4 s (the test)")
    p.add_argument("--database-url", help="a PostgreSQL database (default: a scratch one on 127.0.0.1, dropped)")
    args = p.parse_args(argv)
    n, seconds = (2, 4.0) if args.small else (args.sidecars, args.seconds)
    if n < 1 or seconds < 1 or args.batch < 1 or (args.events_per_s or 0) < 0:
        p.error("--sidecars, --seconds (at least 1) and --batch must be positive, --events-per-s not negative")
    db_url, drop = (args.database_url, None) if args.database_url else scratch_database()
    try:
        r = run(db_url, n, seconds, args.batch, args.events_per_s)
    finally:
        if drop:
            drop()
    print("| sidecars | seconds | records/s (all sidecars) | erasures | completed | p50 s | p99 s | max s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {r['sidecars']} | {r['seconds']:.0f} | {r['records_per_s']:,.0f} | {r['erasures']} | {r['completed']} "
          f"| {r['p50']:.2f} | {r['p99']:.2f} | {r['max']:.2f} |")
    return 0 if r["completed"] == r["erasures"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
