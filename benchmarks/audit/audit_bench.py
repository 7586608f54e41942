"""Audit log throughput, as ratios against raw Ed25519 in the same process.

    .venv/bin/python benchmarks/audit/audit_bench.py [--records 50000] [--no-postgres]

Measures (1) raw Ed25519 sign and verify of a record-sized message, one thread;
(2) records/s signed and durably stored end to end through AuditLog with group
commit, on SQLite (WAL, synchronous=FULL) and PostgreSQL (a scratch database,
dropped afterwards): one caller handing over 1,000 records per append_many call
and waiting for each; four callers doing the same with 250 records each (as the
sidecar's request threads would); one record per submit() future;
(3) verify_store over the SQLite log just written; (4) storage alone: records signed
beforehand, stored through AuditStore.append one slice per transaction, its cost per
record beside a raw signature's.

Each end-to-end run is measured with the writer signing on a thread (LogConfig's
default) and in a child process (sign_process=True, what the sidecar runs), and
its ratio is taken against the raw sign rate measured right before and right
after it (the mean of the two), so drift of a shared machine hits both sides.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvguard.audit import fields  # noqa: E402
from kvguard.audit.keys import SigningKey  # noqa: E402
from kvguard.audit.log import AuditLog, LogConfig  # noqa: E402
from kvguard.audit.record import Record, encode_parts  # noqa: E402
from kvguard.audit.signproc import sign_chain  # noqa: E402
from kvguard.audit.store import AuditStore, migrate  # noqa: E402
from kvguard.audit.verify import verify_store  # noqa: E402

from benchmarks._lib.postgres import scratch_database  # noqa: E402
from benchmarks._lib.report import machine_line  # noqa: E402

SUBJECT = {"tenant": "0f" * 16, "user": "a1" * 16, "session": "5e" * 16}


def details(i: int) -> dict:
    return {"pages": [i, i + 1, i + 2, i + 3], "codec": "int8", "bytes": 65536, "layers": 30,
            "digest": f"{i:064x}"}


def raw_rates(n: int, verify: bool = True) -> tuple[float, float, int]:
    key = SigningKey.generate()
    r = Record("bench.kvguard.example/raw", 123456, "2025-01-31T12:00:00.123Z", "quantize", SUBJECT,
               details(1), "0" * 64, key.key_id)
    msg = r.signing_bytes()
    t = time.perf_counter()
    for _ in range(n):
        sig = key.sign(msg)
    sign = n / (time.perf_counter() - t)
    size = len(r.with_signature(sig, msg).leaf_bytes)
    if not verify:
        return sign, 0.0, size
    pub = key.public_key
    t = time.perf_counter()
    for _ in range(n):
        pub.verify(sig, msg)
    return sign, n / (time.perf_counter() - t), size


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU of a process, all its threads (this process when pid is None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def end_to_end(url: str, n: int, mode: str, sign_process: bool) -> tuple[float, float, float]:
    """Records/s, and CPU microseconds per record of this process and of the signer child."""
    store = AuditStore(url)
    log = AuditLog(store, f"bench.kvguard.example/{uuid.uuid4().hex[:8]}", SigningKey.generate(),
                   LogConfig(sign_process=sign_process))
    log.append("policy", {}, {"warmup": True})
    child = log._signproc.pid if sign_process else None
    cpu0, child0 = _cpu_seconds(), _cpu_seconds(child) if child else 0.0
    t = time.perf_counter()
    if mode == "append_many":
        for start in range(0, n, 1000):
            log.append_many([("quantize", SUBJECT, details(i)) for i in range(start, start + 1000)])
    elif mode == "4 callers":
        def caller(k: int) -> None:
            for start in range(k * 250, n, 1000):
                log.append_many([("quantize", SUBJECT, details(i)) for i in range(start, start + 250)])

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    else:
        futures = [log.submit("quantize", SUBJECT, details(i)) for i in range(n)]
        for f in futures:
            f.result()
    rate = n / (time.perf_counter() - t)
    cpu = (_cpu_seconds() - cpu0) / n * 1e6
    child_cpu = (_cpu_seconds(child) - child0) / n * 1e6 if child else 0.0
    log.close()
    store.dispose()
    return rate, cpu, child_cpu


def store_only(url: str, n: int, slice_size: int) -> float:
    """Records/s of AuditStore.append alone (records signed beforehand, one transaction per
    `slice_size` records, as the committer receives them): what storage costs per record."""
    key = SigningKey.generate()
    origin = f"bench.kvguard.example/{uuid.uuid4().hex[:8]}"
    parts = [("quantize", SUBJECT, d, encode_parts(SUBJECT, d)) for d in map(details, range(n))]
    records = sign_chain(key, origin, 0, fields.format_time(0), fields.ZERO_HASH, parts)
    store = AuditStore(url)
    store.create_log(origin, key.public_key, 0)
    t = time.perf_counter()
    for start in range(0, n, slice_size):
        store.append(origin, records[start:start + slice_size], start)
    rate = n / (time.perf_counter() - t)
    store.dispose()
    return rate


def verify_rate(url: str) -> tuple[float, int]:
    store = AuditStore(url)
    origin = [o for o in store.origins()][0]
    keys = [k.key for k in store.keys(origin)]
    t = time.perf_counter()
    summary = verify_store(store, origin, keys)
    rate = summary.size / (time.perf_counter() - t)
    store.dispose()
    return rate, summary.size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--no-postgres", action="store_true")
    args = ap.parse_args()
    n = args.records
    print(machine_line())
    sign, verify, size = raw_rates(20_000)
    rows = [("raw Ed25519 sign (1 thread)", sign, ""), ("raw Ed25519 verify (1 thread)", verify, "")]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as scratch:
        sqlite = f"sqlite:///{tmp}/bench.db"
        migrate(sqlite)
        targets = [("SQLite", sqlite)]
        if not args.no_postgres:
            pg = scratch.enter_context(scratch_database())
            migrate(pg)
            targets.append(("PostgreSQL", pg))
        for label, url in targets:
            rate = store_only(url, min(n, 20_000), LogConfig().sign_slice)
            rows.append((f"store only, {label}, {LogConfig().sign_slice}-record transactions", rate,
                         f"{1e6 / rate:.1f} us/record = {sign / rate:.2f} x a raw signature"))
            for where in ("thread", "process"):
                for mode in ("append_many", "4 callers", "submit"):
                    before = raw_rates(5000, verify=False)[0]
                    rate, cpu, child_cpu = end_to_end(url, n, mode, where == "process")
                    around = (before + raw_rates(5000, verify=False)[0]) / 2
                    split = f"{cpu:.0f} + {child_cpu:.0f} signer" if child_cpu else f"{cpu:.0f}"
                    rows.append((f"end to end, {label}, {mode}, sign in {where}", rate,
                                 f"{rate / around:.2f} x raw sign ({around:,.0f}/s around it); "
                                 f"CPU us/record {split}"))
        vrate, vn = verify_rate(sqlite)
        rows.append((f"verify_store, SQLite ({vn} records)", vrate, f"{vrate / verify:.2f} x raw verify"))
    print(f"# {n} records per end-to-end run, ~{size}-byte records; "
          f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print(f"| {'measurement':<60} | {'records/s':>10} | ratio |")
    print(f"|{'-' * 62}|{'-' * 12}|-------|")
    for label, rate, ratio in rows:
        print(f"| {label:<60} | {rate:>10,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
