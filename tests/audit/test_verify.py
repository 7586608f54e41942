"""Offline verification of a record stream: every check, in seq order, on worker threads or not."""

from __future__ import annotations

import pytest
from kvguard.audit.checkpoint import Checkpoint
from kvguard.audit.errors import VerificationError
from kvguard.audit.fields import ZERO_HASH
from kvguard.audit.keys import SigningKey, rotation_details
from kvguard.audit.record import Record
from kvguard.audit.tree import HashTree
from kvguard.audit.verify import LogVerifier, verify_records

ORIGIN = "kvguard.example/offline"
KEY = SigningKey.from_seed(b"\x44" * 32)


def chain(n: int, key: SigningKey = KEY, rotate_at: int | None = None, new_key: SigningKey | None = None):
    records, prev = [], ZERO_HASH
    for seq in range(n):
        op, details = ("evict", {"n": seq})
        if seq == rotate_at:
            op, details = "key_rotation", rotation_details(new_key.public_key)
        r = Record.sign_new(key, ORIGIN, seq, "2025-01-31T12:00:00.000Z", op, {}, details, prev)
        records.append(r)
        prev = r.digest
        if seq == rotate_at:
            key = new_key
    return records


def checkpoint(records, size, key=KEY) -> str:
    tree = HashTree()
    tree.extend(r.leaf_hash for r in records[:size])
    return Checkpoint(ORIGIN, size, tree.root()).sign(key)


def resign(r: Record, key: SigningKey, **changes) -> Record:
    d = {**r.unsigned_dict(), **changes}
    base = Record(d["origin"], d["seq"], d["time"], d["op"], d["subject"], d["details"], d["prev"],
                  d["key_id"])
    data = base.signing_bytes()
    return base.with_signature(key.sign(data), data)


@pytest.mark.parametrize("workers", [0, 2])
def test_intact_stream_with_checkpoints(workers):
    records = chain(700)
    notes = [checkpoint(records, n) for n in (0, 1, 256, 700)]
    summary = verify_records([r.leaf_bytes for r in records], [KEY.public_key], checkpoints=notes)
    assert (summary.size, summary.checkpoints, summary.last_checkpoint) == (700, 4, 700)
    v = LogVerifier(ORIGIN, [KEY.public_key], workers=workers)
    for r in records:
        v.add(r)
    assert v.summary().root == summary.root


@pytest.mark.parametrize("workers", [0, 2])
def test_the_earliest_failure_is_reported(workers):
    records = chain(900)
    forged = records[3].to_dict()
    forged["sig"] = records[4].sig  # a signature failure early, found by a worker thread
    records[3] = Record.parse(forged)
    records[600] = resign(records[600], KEY, prev="ab" * 32)  # a chain break later
    v = LogVerifier(ORIGIN, [KEY.public_key], workers=workers, prev=ZERO_HASH)
    with pytest.raises(VerificationError) as err:
        for r in records:
            v.add(r)
        v.finish()
    assert (err.value.check, err.value.seq) == ("signature", 3)


def test_each_check_names_the_record():
    base = chain(10)
    other = SigningKey.from_seed(b"\x55" * 32)
    cases = {
        "origin": base[:4] + [resign(base[4], KEY, origin="kvguard.example/other")],
        "sequence": base[:4] + base[5:],
        "chain": base[:4] + [resign(base[4], KEY, prev=base[2].digest)],
        "key": base[:4] + [resign(base[4], other, key_id=other.key_id)],
        "signature": base[:4] + [resign(base[4], other)],
    }
    for check, records in cases.items():
        with pytest.raises(VerificationError) as err:
            verify_records(records, [KEY.public_key])
        assert (err.value.check, err.value.seq, err.value.origin) == (check, 4, ORIGIN), check
    with pytest.raises(VerificationError) as err:
        verify_records([r.leaf_bytes for r in base[:6]], [KEY.public_key], checkpoints=[checkpoint(base, 9)])
    assert (err.value.check, err.value.seq) == ("truncation", 6)
    with pytest.raises(VerificationError) as err:
        verify_records(base, [KEY.public_key], checkpoints=[checkpoint(base[:3] + base[4:], 5)])
    assert (err.value.check, err.value.seq) == ("merkle_root", 4)
    with pytest.raises(VerificationError) as err:
        verify_records([base[0].leaf_bytes, base[1].leaf_bytes + b" "], [KEY.public_key])
    assert (err.value.check, err.value.seq) == ("format", 1)


def test_rotation_hands_over_and_retires_the_old_key():
    new = SigningKey.from_seed(b"\x66" * 32)
    records = chain(8, rotate_at=4, new_key=new)
    notes = [checkpoint(records, 4), checkpoint(records, 8, new)]
    assert verify_records(records, [KEY.public_key], checkpoints=notes).size == 8
    # the old key signing after its rotation is "not valid at that seq"
    late = resign(records[6], KEY, key_id=KEY.key_id)
    with pytest.raises(VerificationError) as err:
        verify_records(records[:6] + [late], [KEY.public_key])
    assert (err.value.check, err.value.seq) == ("key", 6) and "not valid at seq 6" in err.value.message
    # a checkpoint after the rotation signed by the old key is refused
    with pytest.raises(VerificationError) as err:
        verify_records(records, [KEY.public_key], checkpoints=[checkpoint(records, 8, KEY)])
    assert err.value.check == "checkpoint_signature"
