"""Erasure receipts: made from the log, verified offline, every part tamper-evident."""

from __future__ import annotations

import copy
import json

import pytest
from kvguard.audit.errors import ReceiptError, VerificationError
from kvguard.audit.keys import SigningKey
from kvguard.audit.receipt import make_receipt, verify_receipt

from .audit_testlib import fill, open_log


@pytest.fixture
def receipt(audit_log, signing_key):
    fill(audit_log, 11)
    erase = audit_log.append("erase", {"user": "cd" * 16}, {"scope": "user", "pages": 12, "bytes": 786432})
    fill(audit_log, 5)
    return make_receipt(audit_log, erase.seq)


def test_receipt_verifies_and_survives_json(receipt, signing_key):
    record = verify_receipt(json.loads(json.dumps(receipt)), signing_key.public_key)
    assert (record.op, record.seq, record.subject) == ("erase", 11, {"user": "cd" * 16})
    assert receipt["tree_size"] == 17  # a checkpoint was issued for it


def _mutations(receipt):
    def flip_hex(h):
        return ("0" if h[0] != "0" else "1") + h[1:]

    yield "format", lambda r: r.update(format="other")
    yield "signature", lambda r: r["record"]["details"].update(pages=13)
    yield "inclusion", lambda r: r["inclusion_proof"].__setitem__(0, flip_hex(r["inclusion_proof"][0]))
    yield "inclusion", lambda r: r.update(inclusion_proof=r["inclusion_proof"][:-1])
    yield "checkpoint_signature", lambda r: r.update(checkpoint=r["checkpoint"].replace("\n17\n", "\n18\n"))
    yield "checkpoint_format", lambda r: r.update(tree_size=16)
    yield "format", lambda r: r.update(leaf_index=10)
    yield "key", lambda r: r.update(public_key=SigningKey.generate().public_key.to_base64())


def test_every_part_is_checked(receipt, signing_key):
    for check, mutate in _mutations(receipt):
        bad = copy.deepcopy(receipt)
        mutate(bad)
        with pytest.raises(VerificationError) as err:
            verify_receipt(bad, signing_key.public_key)
        assert err.value.check == check


def test_wrong_trusted_key(receipt):
    with pytest.raises(VerificationError) as err:
        verify_receipt(receipt, SigningKey.generate().public_key)
    assert err.value.check == "key" and err.value.seq == 11


def test_only_erasures_get_receipts(audit_log):
    fill(audit_log, 2)
    with pytest.raises(ReceiptError, match="not an erasure"):
        make_receipt(audit_log, 1)


def test_receipt_after_rotation_uses_the_records_own_key(store, origin, signing_key):
    new_key = SigningKey.generate()
    with open_log(store, origin, signing_key) as log:
        erase = log.append("erase", {}, {"scope": "session"})
        log.rotate_key(new_key)
        fill(log, 3)
        log.checkpoint()
        receipt = make_receipt(log, erase.seq)
    assert receipt["tree_size"] == 1  # the checkpoint issued before the rotation
    verify_receipt(receipt, signing_key.public_key)
