"""Witness cosignatures (C2SP tlog-cosignature): docs/audit-format.md's example recomputed from
first principles, and what a verifier refuses."""

from __future__ import annotations

import base64
import hashlib
import re
import struct
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from kvguard.audit.checkpoint import Checkpoint, open_checkpoint, split_note
from kvguard.audit.cosignature import Witness, cosign, cosignatures, require_cosignatures
from kvguard.audit.errors import KeyFileError, VerificationError
from kvguard.audit.keys import SigningKey

DOC = Path(__file__).resolve().parents[2] / "docs" / "audit-format.md"
T = 1738324800  # 2025-01-31T12:00:00Z


@pytest.fixture(scope="module")
def ex() -> dict[str, str]:
    return dict(re.findall(r"<!-- example: ([\w-]+) -->\n```[a-z]*\n(.*?)\n```", DOC.read_text(), re.S))


def test_the_worked_example_byte_for_byte(ex):
    wkey = Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64)))
    raw = wkey.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    name = "witness.example/w1"
    key_id = hashlib.sha256(name.encode() + b"\n\x04" + raw).digest()[:4]
    vkey_blob = base64.b64encode(b"\x04" + raw).decode()
    assert ex["witness-vkey"] == f"{name}+{key_id.hex()}+{vkey_blob}"

    note = ex["checkpoint"] + "\n"
    text = note[: note.index("\n\n") + 1]
    message = f"cosignature/v1\ntime {T}\n{text}".encode()
    assert ex["cosigned-message"] + "\n" == message.decode()
    line = f"— {name} " + base64.b64encode(key_id + struct.pack(">Q", T) + wkey.sign(message)).decode() + "\n"
    assert ex["cosigned-checkpoint"] + "\n" == note + line

    # and through the audit package: the same line, and it verifies, with the log's signature intact
    log_key = SigningKey.from_seed(bytes.fromhex(ex["seed"]))
    witness = Witness.from_vkey(ex["witness-vkey"])
    assert cosign(SigningKey.from_seed(bytes(range(32, 64))), name, text, T) == line
    [found] = require_cosignatures(note + line, [witness], 1)
    assert (found.witness, found.timestamp) == (witness, T)
    assert open_checkpoint(note + line, log_key.public_key).size == 2


@pytest.fixture
def signed() -> tuple[str, str]:
    log = SigningKey.generate()
    note = Checkpoint("test.example/log", 5, hashlib.sha256(b"root").digest()).sign(log)
    return note, split_note(note)[0]


def _witness(name: str = "w.example/1") -> tuple[SigningKey, Witness]:
    key = SigningKey.generate()
    return key, Witness(name, key.public_key)


def test_bad_cosignature_wrong_key_too_few_and_stale_are_refused(signed):
    note, text = signed
    (k1, w1), (k2, w2), (_, stranger) = _witness("w1"), _witness("w2"), _witness("w1")
    both = note + cosign(k1, "w1", text, T) + cosign(k2, "w2", text, T + 5)
    assert len(require_cosignatures(both, [w1, w2], 2)) == 2
    # too few: one of two
    with pytest.raises(VerificationError, match="1 valid cosignature.*2 required") as e:
        require_cosignatures(note + cosign(k1, "w1", text, T), [w1, w2], 2)
    assert e.value.check == "witness"
    # wrong key: a witness of the same name but another key counts for nothing
    with pytest.raises(VerificationError, match="0 valid"):
        require_cosignatures(both, [stranger], 1)
    # a bad signature by a trusted witness is an error, not just ignored
    line = cosign(k1, "w1", text, T)
    blob = bytearray(base64.b64decode(line.split(" ")[2]))
    blob[-1] ^= 1
    forged = note + f"— w1 {base64.b64encode(bytes(blob)).decode()}\n"
    with pytest.raises(VerificationError, match="by witness w1 .* does not verify") as e:
        cosignatures(forged, [w1])
    assert e.value.check == "cosignature"
    # a cosignature of another checkpoint moved onto this one
    other = Checkpoint("test.example/log", 6, hashlib.sha256(b"x").digest()).text()
    with pytest.raises(VerificationError, match="does not verify"):
        cosignatures(note + cosign(k1, "w1", other, T), [w1])
    # stale: outside the accepted window, named as such
    with pytest.raises(VerificationError, match="1 more, but cosigned outside"):
        require_cosignatures(note + cosign(k1, "w1", text, T), [w1], 1, not_before_s=T + 1)


def test_witness_keys_parse_strictly():
    _, w = _witness("witness.example/w1")
    assert Witness.from_vkey(w.vkey()) == w
    name, kid, blob = w.vkey().split("+", 2)
    wrong_type = base64.b64encode(b"\x01" * 33).decode()
    for bad in (f"{name}+00000000+{blob}", f"{name}+{kid}", f"{name}+{kid}+{wrong_type}"):
        with pytest.raises(KeyFileError):
            Witness.from_vkey(bad)
    with pytest.raises(KeyFileError, match="name"):
        Witness("with space", w.key)
