"""C2SP checkpoints and signed notes."""

from __future__ import annotations

import base64
import hashlib

import pytest
from kvguard.audit.checkpoint import Checkpoint, open_checkpoint, split_note
from kvguard.audit.errors import VerificationError
from kvguard.audit.keys import SigningKey

KEY = SigningKey.from_seed(b"\x01" * 32)
ORIGIN = "kvguard.example/pod-1"


def test_text_layout_and_signature_line():
    root = hashlib.sha256(b"root").digest()
    cp = Checkpoint(ORIGIN, 20852163, root)
    note = cp.sign(KEY)
    text, sigs = split_note(note)
    assert text == f"{ORIGIN}\n20852163\n{base64.b64encode(root).decode()}\n"
    blob = base64.b64encode(sigs[0].key_id + sigs[0].signature).decode()
    assert note == text + "\n" + f"\u2014 {ORIGIN} {blob}\n"
    assert sigs[0].key_id == hashlib.sha256(ORIGIN.encode() + b"\n\x01" + KEY.public_key.raw).digest()[:4]
    KEY.public_key.verify(sigs[0].signature, text.encode())
    assert open_checkpoint(note, KEY.public_key) == cp


def test_extension_lines_and_unknown_signatures():
    cp = Checkpoint(ORIGIN, 5, bytes(32), ("ext one",))
    note = cp.sign(KEY)
    other = SigningKey.from_seed(b"\x02" * 32)
    cosigned = note + f"\u2014 witness.example {base64.b64encode(b'abcd' + other.sign(b'x')).decode()}\n"
    assert open_checkpoint(cosigned, KEY.public_key) == cp  # unknown signers are ignored
    with pytest.raises(VerificationError) as err:
        open_checkpoint(note, other.public_key)
    assert err.value.check == "checkpoint_signature"


def test_tampered_or_malformed_notes_are_refused():
    note = Checkpoint(ORIGIN, 7, bytes(32)).sign(KEY)
    bad_sig = note[:-10] + ("A" if note[-10] != "A" else "B") + note[-9:]
    cases = {
        "checkpoint_signature": [note.replace("\n7\n", "\n8\n"), bad_sig],
        "checkpoint_format": [
            note.replace("\n\n", "\n"), note.replace("\n7\n", "\n07\n"), note.replace("\u2014", "-"),
            note.replace(ORIGIN, ORIGIN + "\x01", 1), note.replace("AAAA", "AAA", 1),
        ],
    }
    for check, notes in cases.items():
        for bad in notes:
            with pytest.raises(VerificationError) as err:
                open_checkpoint(bad, KEY.public_key)
            assert err.value.check == check, bad
    with pytest.raises(VerificationError, match="not 'other'"):
        open_checkpoint(note, KEY.public_key, origin="other")
