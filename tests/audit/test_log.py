"""The writer: batching, futures, checkpoints every N records / T ms, rotation, proofs."""

from __future__ import annotations

import threading
import time

import pytest
from kvguard.audit.checkpoint import open_checkpoint
from kvguard.audit.errors import RecordFormatError, StoreError, VerificationError
from kvguard.audit.keys import SigningKey
from kvguard.audit.log import _slices
from kvguard.audit.merkle import leaf_hash, verify_consistency, verify_inclusion
from kvguard.audit.record import Record
from kvguard.audit.verify import verify_store

from .audit_testlib import fill, open_log


def test_append_returns_the_stored_signed_record(audit_log, store, origin, signing_key):
    r = audit_log.append("quantize", {"tenant": "ab" * 16}, {"pages": [3], "codec": "int8"})
    assert (r.seq, r.prev, r.key_id) == (0, "0" * 64, signing_key.key_id)
    signing_key.public_key.verify(r.signature, r.signing_bytes())
    assert store.record(origin, 0) == r
    r2 = audit_log.append("evict")
    assert r2.prev == r.digest


def test_submit_and_append_many_keep_order(audit_log):
    futures = [audit_log.submit("evict", None, {"n": i}) for i in range(50)]
    many = audit_log.append_many([("offload", {}, {"n": i}) for i in range(50)])
    seqs = [f.result(timeout=10).seq for f in futures] + [r.seq for r in many]
    assert seqs == list(range(100))
    assert [r.details["n"] for r in many] == list(range(50))
    assert audit_log.append_many([]) == []


def test_bad_records_fail_at_the_call(audit_log):
    with pytest.raises(RecordFormatError):
        audit_log.append("evict", {}, {"prompt": "secret text"})
    with pytest.raises(RecordFormatError):
        audit_log.submit("Evict!")
    with pytest.raises(RecordFormatError):
        audit_log.append("evict", {"user": "alice"})
    with pytest.raises(RecordFormatError, match="register a new one in kvguard.audit.ops"):
        audit_log.append("evicted", {}, {"pages": [1]})  # well formed, but not an op kvguard writes
    assert audit_log.size == 0


def test_checkpoint_every_n_records(store, origin, signing_key):
    with open_log(store, origin, signing_key, checkpoint_every=10, max_batch=7) as log:
        for _ in range(5):
            fill(log, 7)
    sizes = [cp.size for cp in store.checkpoints(origin)]
    assert sizes and all(b - a >= 10 for a, b in zip([0] + sizes, sizes))
    for cp in store.checkpoints(origin):
        c = open_checkpoint(cp.note, signing_key.public_key, origin)
        assert (c.size, c.root) == (cp.size, cp.root)


def test_checkpoint_after_interval_when_idle(store, origin, signing_key):
    with open_log(store, origin, signing_key, checkpoint_interval_ms=50) as log:
        fill(log, 3)
        deadline = time.monotonic() + 5
        while not store.checkpoints(origin) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [cp.size for cp in store.checkpoints(origin)] == [3]
        assert store.checkpoints(origin)[0].root == log.root()


def test_forced_checkpoint_and_reopen(store, origin, signing_key):
    with open_log(store, origin, signing_key) as log:
        fill(log, 9)
        cp = log.checkpoint()
        assert (cp.size, cp.root) == (9, log.root())
        assert log.checkpoint() == cp  # nothing new: the same checkpoint
        root = log.root()
    with open_log(store, origin, signing_key) as log:  # a restart rebuilds tail and tree
        assert (log.size, log.root()) == (9, root)
        assert log.append("evict").seq == 9


def test_proofs_from_the_log(audit_log):
    records = fill(audit_log, 37)
    old = audit_log.checkpoint()
    fill(audit_log, 20)
    new = audit_log.checkpoint()
    for seq in (0, 17, 36):
        proof = audit_log.inclusion_proof(seq, new.size)
        verify_inclusion(seq, new.size, records[seq].leaf_hash, proof, new.root)
    proof = audit_log.consistency_proof(old.size, new.size)
    verify_consistency(old.size, new.size, old.root, new.root, proof)
    with pytest.raises(VerificationError):
        verify_inclusion(3, new.size, leaf_hash(b"forged"), audit_log.inclusion_proof(3, new.size), new.root)


def test_key_rotation(store, origin, signing_key):
    new_key = SigningKey.generate()
    with open_log(store, origin, signing_key) as log:
        fill(log, 4)
        rotation = log.rotate_key(new_key)
        after = log.append("evict")
        log.checkpoint()
    assert rotation.op == "key_rotation" and rotation.key_id == signing_key.key_id
    assert rotation.details == {"new_key_id": new_key.key_id,
                                "new_public_key": new_key.public_key.to_base64()}
    assert after.key_id == new_key.key_id
    # every record has a checkpoint signed by its own key: one at size 4 by the old key
    cps = {cp.size: cp for cp in store.checkpoints(origin)}
    open_checkpoint(cps[4].note, signing_key.public_key)
    open_checkpoint(cps[6].note, new_key.public_key)
    assert [(k.key.key_id, k.valid_from_seq, k.rotation_seq) for k in store.keys(origin)] == [
        (signing_key.key_id, 0, None), (new_key.key_id, 5, 4)]
    assert verify_store(store, origin, [signing_key.public_key]).size == 6
    with pytest.raises(StoreError, match="open it with that key"):
        with open_log(store, origin, signing_key) as stale:
            stale.append("evict")
    with open_log(store, origin, new_key) as log:
        assert log.append("evict").seq == 6


def test_closed_log_refuses_writes(audit_log):
    audit_log.close()
    with pytest.raises(StoreError, match="closed"):
        audit_log.append("evict")


def test_records_are_canonical_in_the_store(audit_log, store, origin):
    fill(audit_log, 3)
    for seq, body, sig, leaf in store.iter_bodies(origin):
        record = Record.from_leaf_bytes(body.encode())
        assert (record.seq, record.sig, record.leaf_hash) == (seq, sig, leaf)


def test_nothing_queued_behind_close_waits_forever(audit_log):
    from kvguard.audit.pending import STOP

    audit_log._queue.put(STOP)  # a close() racing with a submit()
    try:
        future = audit_log.submit("evict")
    except StoreError:
        pass  # the writer had already stopped: refused at the call
    else:
        with pytest.raises(StoreError, match="closed"):
            future.result(timeout=10)
    audit_log._signer.join(timeout=10)
    assert audit_log._queued == 0  # every record counted in was counted out


@pytest.mark.parametrize("n, size, tail", [(1, 256, 64), (64, 256, 64), (65, 256, 64), (256, 256, 64),
                                           (1000, 256, 64), (1024, 256, 64), (300, 256, 300), (7, 3, 2)])
def test_slices_cover_the_batch_with_a_short_last_one(n, size, tail):
    bounds = _slices(n, size, tail)
    assert [s for s, _ in bounds] == [0] + [e for _, e in bounds[:-1]] and bounds[-1][1] == n
    assert all(0 < e - s <= size for s, e in bounds)
    assert bounds[-1][1] - bounds[-1][0] <= tail or n <= tail


@pytest.mark.parametrize("sign_process", [False, True], ids=["thread", "process"])
def test_a_calls_records_are_contiguous_beside_other_writers(store, origin, signing_key, sign_process):
    """append_many queues a long call a slice at a time; nothing lands between its slices."""
    with open_log(store, origin, signing_key, sign_slice=16, tail_slice=4, sign_process=sign_process) as log:
        stop = threading.Event()

        def other() -> None:
            while not stop.is_set():
                log.append_many([("evict", {}, {"n": -1})] * 3)

        threads = [threading.Thread(target=other) for _ in range(2)]
        [t.start() for t in threads]
        try:
            calls = [log.append_many([("offload", {}, {"call": c, "n": i}) for i in range(100)])
                     for c in range(5)]
        finally:
            stop.set()
            [t.join() for t in threads]
        assert log.size > 500
    for records in calls:
        assert [r.details["n"] for r in records] == list(range(100))
        assert [r.seq for r in records] == list(range(records[0].seq, records[0].seq + 100))
    verify_store(store, origin, [signing_key.public_key])


def test_a_bad_record_late_in_a_long_call_stores_nothing(store, origin, signing_key):
    with open_log(store, origin, signing_key, sign_slice=8) as log:
        items = [("evict", {}, {"n": i}) for i in range(100)] + [("evict", {}, {"prompt": "x"})]
        with pytest.raises(RecordFormatError):
            log.append_many(items)
        assert log.append("evict").seq == 0


def test_callers_wait_for_room_in_the_queue(store, origin, signing_key):
    """A caller that never waits for its futures is held back at max_queued records; a call
    larger than that is let in alone."""
    with open_log(store, origin, signing_key, max_queued=50, sign_slice=16) as log:
        seen, stop = [], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(log._queued)
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            futures = [log.submit("evict", {}, {"n": i}) for i in range(1000)]
            assert [f.result(timeout=60).seq for f in futures] == list(range(1000))
        finally:
            stop.set()
            watcher.join()
        assert seen and max(seen) <= 50
        assert len(log.append_many([("evict", {}, {"n": i}) for i in range(200)])) == 200
        assert log._queued == 0
    verify_store(store, origin, [signing_key.public_key])
