"""Export and verify rates of a million-record log, beside raw Ed25519 in the same process.

    .venv/bin/python benchmarks/audit/audit_bundle_bench.py [--records 1000000] [--no-postgres]

Generates the log fast: records are signed in this process (a real chain, one
key) and bulk-inserted 10,000 at a time into SQLite and, unless --no-postgres,
a scratch PostgreSQL database (dropped afterwards), with a checkpoint every
10,000 records and an erasure every 100,000. Then times a whole-log export
from each store through `python -m audit export` (with the peak RSS of that
process: the export streams, so it holds a small fraction of the log; it
verifies every record it seals), the store check (`check`, also a child
process) and the offline verification of the bundle in this process.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvguard.audit.bundle.verify import verify_bundle  # noqa: E402
from kvguard.audit.checkpoint import Checkpoint  # noqa: E402
from kvguard.audit.fields import ZERO_HASH, format_time  # noqa: E402
from kvguard.audit.keys import SigningKey  # noqa: E402
from kvguard.audit.record import Record  # noqa: E402
from kvguard.audit.store import AuditStore, CheckpointEntry, migrate  # noqa: E402
from kvguard.audit.tree import HashTree  # noqa: E402

from benchmarks._lib.postgres import scratch_database  # noqa: E402
from benchmarks._lib.report import machine_line  # noqa: E402

ORIGIN = "bench.kvguard.example/million"
SUBJECT = {"tenant": "0f" * 16, "user": "a1" * 16, "session": "5e" * 16}
CHUNK = 10_000


def raw_verify_rate(key: SigningKey, n: int = 5000) -> float:
    msg = b"x" * 600
    sig = key.sign(msg)
    t = time.perf_counter()
    for _ in range(n):
        key.public_key.verify(sig, msg)
    return n / (time.perf_counter() - t)


def generate(stores: list[AuditStore], key: SigningKey, n: int) -> float:
    for store in stores:
        store.create_log(ORIGIN, key.public_key, 1_700_000_000_000)
    tree, prev, seq = HashTree(), ZERO_HASH, 0
    t = time.perf_counter()
    while seq < n:
        when = format_time(1_700_000_000_000 + seq)
        chunk = []
        for i in range(seq, min(seq + CHUNK, n)):
            if i % 100_000 == 99_999:
                op, details = "erase", {"scope": "user", "pages": 12, "bytes": 786432}
            else:
                op, details = "quantize", {"pages": [i, i + 1], "codec": "int8", "bytes": 65536,
                                           "digest": f"{i:064x}"}
            r = Record.sign_new(key, ORIGIN, i, when, op, SUBJECT, details, prev)
            chunk.append(r)
            prev = r.digest
        for store in stores:
            store.append(ORIGIN, chunk, seq)
        tree.extend(r.leaf_hash for r in chunk)
        seq += len(chunk)
        note = Checkpoint(ORIGIN, seq, tree.root()).sign(key)
        for store in stores:
            store.add_checkpoint(CheckpointEntry(ORIGIN, seq, tree.root(), 0, key.key_id, note))
        print(f"\rgenerated {seq:,}/{n:,}", end="", file=sys.stderr)
    print(file=sys.stderr)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--no-postgres", action="store_true")
    args = ap.parse_args()
    n = args.records
    print(machine_line())
    key = SigningKey.generate()
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp, ExitStack() as scratch:
        urls = {"SQLite": f"sqlite:///{tmp}/million.db"}
        if not args.no_postgres:
            urls["PostgreSQL"] = scratch.enter_context(scratch_database())
        stores = {}
        for label, url in urls.items():
            migrate(url)
            stores[label] = AuditStore(url)
        seconds = generate(list(stores.values()), key, n)
        rows.append((f"generate: sign + insert into {len(stores)} store(s)", n / seconds, seconds, ""))
        bundle = f"{tmp}/million.zip"
        key.save(f"{tmp}/log.key")
        for label, url in urls.items():  # through the CLI, in a child process, to see its memory
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "kvguard.audit", "export", "--database-url", url, "--origin",
                            ORIGIN, "--key", f"{tmp}/log.key", "-o", bundle, "--no-progress"],
                           check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - t
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            rows.append((f"export whole log from {label} (CLI)", n / seconds, seconds,
                         f"{os.path.getsize(bundle) / 2**20:.0f} MiB bundle, peak RSS {peak:.0f} MiB"))
        for label, url in urls.items():  # the store check (kvguard audit check), also a child process
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "kvguard.audit", "check", "--database-url", url,
                            "--no-progress"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - t
            rows.append((f"check whole store, {label} (CLI)", n / seconds, seconds, ""))
        raw_before = raw_verify_rate(key)
        t = time.perf_counter()
        result = verify_bundle(bundle, [key.public_key])
        seconds = time.perf_counter() - t
        raw = (raw_before + raw_verify_rate(key)) / 2
        assert result.records == n
        rows.append(("raw Ed25519 verify (1 thread)", raw, None, ""))
        rows.append(("verify bundle offline", n / seconds, seconds,
                     f"{n / seconds / raw:.2f} x raw verify"))
        for store in stores.values():
            store.dispose()
    print(f"# {n:,} records\n")
    print(f"| {'measurement':<40} | {'records/s':>10} | {'seconds':>7} | note |")
    print(f"|{'-' * 42}|{'-' * 12}|{'-' * 9}|------|")
    for label, rate, seconds, note in rows:
        secs = f"{seconds:7.1f}" if seconds is not None else " " * 7
        print(f"| {label:<40} | {rate:>10,.0f} | {secs} | {note} |")


if __name__ == "__main__":
    main()
