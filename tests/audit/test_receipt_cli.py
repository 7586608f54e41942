"""`kvguard audit verify-receipt` on one log's receipt (the fleet's is run end to end in
tests/sidecar/test_fleet.py): verified, not verified, unreadable; and a fleet receipt whose
records state another fleet."""

from __future__ import annotations

import json

import pytest
from kvguard.audit.cli import main
from kvguard.audit.errors import VerificationError
from kvguard.audit.receipt import FLEET_RECEIPT_FORMAT, make_receipt, verify_fleet_receipt

from .audit_testlib import fill


@pytest.fixture
def receipt(audit_log):
    fill(audit_log, 3)
    erase = audit_log.append("erase", {"user": "cd" * 16}, {"request": "r-1", "fleet": {
        "origins": [audit_log.origin], "excluded": [{"origin": "gone.example/pod-9", "reason": "node lost"}]}})
    return make_receipt(audit_log, erase.seq)


def test_verify_receipt_command(receipt, signing_key, tmp_path, capsys):
    key = tmp_path / "log.pub"
    key.write_text(signing_key.public_key.to_pem())
    good = tmp_path / "receipt.json"
    good.write_text(json.dumps({"id": "r-1", "receipt": receipt}))  # as the admin API returns a request
    assert main(["verify-receipt", str(good), "--public-key", str(key)]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    receipt["record"]["details"]["request"] = "r-2"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(receipt))
    assert main(["verify-receipt", str(bad), "--public-key", str(key), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["check"] == "signature"
    (tmp_path / "junk.json").write_text("{not json")
    assert main(["verify-receipt", str(tmp_path / "junk.json"), "--public-key", str(key)]) == 2
    assert main(["verify-receipt", str(tmp_path / "missing.json"), "--public-key", str(key)]) == 2


def test_a_fleet_receipt_must_state_the_fleet_its_records_signed(receipt, signing_key, audit_log):
    fleet = {"format": FLEET_RECEIPT_FORMAT, "request": "r-1", "origins": [audit_log.origin],
             "excluded": [{"origin": "gone.example/pod-9", "reason": "node lost"}], "receipts": [receipt]}
    assert [r.seq for r in verify_fleet_receipt(fleet, [signing_key.public_key])] == [3]
    for changed in ({"excluded": []}, {"request": "r-2"}, {"origins": [audit_log.origin, "other.example/pod-2"]}):
        with pytest.raises(VerificationError):
            verify_fleet_receipt({**fleet, **changed}, [signing_key.public_key])
