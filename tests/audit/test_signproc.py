"""Signing in a child process: same bytes as in-process, survives the child's death,
dies with its parent, and the writer built on it verifies on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kvguard.audit.keys import SigningKey
from kvguard.audit.record import Record, encode_parts
from kvguard.audit.signproc import SignerProcess
from kvguard.audit.verify import verify_store

from .audit_testlib import fill, open_log

SUBJECT = {"tenant": "0f" * 16, "user": "a1" * 16}
ROOT = Path(__file__).resolve().parents[2]


def _parts(n: int) -> list:
    parts = [("quantize", SUBJECT, {"pages": [i, i + 1], "codec": "int8", "note": "é\n\"x\""})
             for i in range(n)]
    return [(op, subject, details, encode_parts(subject, details)) for op, subject, details in parts]


def _in_process(key, origin, seq, when, prev, parts) -> list[Record]:
    out = []
    for op, subject, details, _ in parts:
        r = Record.sign_new(key, origin, seq, when, op, subject, details, prev)
        out.append(r)
        seq, prev = seq + 1, r.digest
    return out


@pytest.fixture
def signer():
    s = SignerProcess()
    yield s
    s.close()


def test_child_signs_the_same_bytes_as_the_parent(signer):
    key, other = SigningKey.generate(), SigningKey.generate()
    args = ("test.kvguard.example/sp", 7, "2025-01-31T12:00:00.123Z", "ab" * 32)
    for k in (key, other, key):  # a key change is handed over before the batch it signs
        got = signer.sign(k, *args, _parts(40))
        want = _in_process(k, *args, _parts(40))
        assert [(r.leaf_bytes, r.leaf_hash, r.sig, r.prev, r.seq, r.key_id) for r in got] == [
            (r.leaf_bytes, r.leaf_hash, r.sig, r.prev, r.seq, r.key_id) for r in want]
        assert got == want and got[0].digest == want[0].digest
        assert Record.from_leaf_bytes(got[-1].leaf_bytes) == want[-1]
    assert not signer.fallen_back


def test_pipelined_batches_continue_the_chain_in_order(signer):
    key = SigningKey.generate()
    origin, when = "test.kvguard.example/sp", "2025-01-31T12:00:00.123Z"
    want = _in_process(key, origin, 0, when, "0" * 64, _parts(90))
    futures = [signer.submit(key, origin, 0, when, "0" * 64, _parts(90)[:30])]
    futures += [signer.submit(key, origin, start, when, None, _parts(90)[start:start + 30]) for start in (30, 60)]
    assert [r for f in futures for r in f.result(timeout=30)] == want


def test_a_dead_child_falls_back_to_signing_in_process(signer):
    key = SigningKey.generate()
    origin, when = "test.kvguard.example/sp", "2025-01-31T12:00:00.123Z"
    want = _in_process(key, origin, 0, when, "0" * 64, _parts(12))
    got = signer.sign(key, origin, 0, when, "0" * 64, _parts(12)[:2])
    signer._proc.kill()
    signer._proc.join()
    got += signer.sign(key, origin, 2, when, None, _parts(12)[2:7])  # continues from the child's last
    got += signer.sign(key, origin, 7, when, got[-1].digest, _parts(12)[7:])
    assert got == want
    assert signer.fallen_back


def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from kvguard.audit.signproc import SignerProcess
        if __name__ == "__main__":
            s = SignerProcess()
            print(s.pid, flush=True)
            time.sleep(60)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        # a zombie whose parent is gone is reaped by init; read its state to be sure
        try:
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the signer process outlived its killed parent")


def test_log_signing_in_a_child_process_verifies(store, origin, signing_key):
    new_key = SigningKey.generate()
    with open_log(store, origin, signing_key, sign_process=True) as log:
        fill(log, 300)
        futures = [log.submit("evict", SUBJECT, {"n": i}) for i in range(200)]
        assert [f.result(timeout=30).seq for f in futures] == list(range(300, 500))
        log.rotate_key(new_key)
        assert log.append("evict").key_id == new_key.key_id
        log.checkpoint()
    summary = verify_store(store, origin, [signing_key.public_key])
    assert summary.size == 502
