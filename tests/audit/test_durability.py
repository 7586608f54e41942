"""A write acknowledged to its caller survives kill -9 of the writing process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvguard.audit.keys import SigningKey
from kvguard.audit.store import AuditStore
from kvguard.audit.verify import verify_store

REPO = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent("""
    import sys
    from kvguard.audit.keys import SigningKey
    from kvguard.audit.log import AuditLog, LogConfig
    from kvguard.audit.store import AuditStore

    url, origin, key_path, sign_process = sys.argv[1:5]
    log = AuditLog(AuditStore(url), origin, SigningKey.load(key_path),
                   LogConfig(checkpoint_every=64, sign_process=sign_process == "process"))
    n = 0
    while True:  # keep several batches in flight; print each seq once its commit returned
        futures = [log.submit("evict", {}, {"pages": [n + i]}) for i in range(16)]
        n += 16
        for f in futures:
            print(f.result().seq, flush=True)
""")


@pytest.mark.parametrize("sign", ["thread", "process"])
def test_acknowledged_records_survive_sigkill(db_url, origin, tmp_path, sign):
    key = SigningKey.generate()
    key.save(tmp_path / "log.key")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, db_url, origin, str(tmp_path / "log.key"), sign],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    acked = []
    try:
        for line in proc.stdout:
            acked.append(int(line))
            if len(acked) == 400:
                proc.send_signal(signal.SIGKILL)  # mid-stream: more batches are signed or committing
                break
    finally:
        proc.kill()
        proc.wait()
    assert len(acked) == 400, proc.stderr.read()
    store = AuditStore(db_url)
    stored = store.size(origin)
    assert stored >= len(acked) and set(acked) <= set(range(stored))
    summary = verify_store(store, origin, [key.public_key])
    assert summary.size == stored and summary.checkpoints >= 1
    store.dispose()
