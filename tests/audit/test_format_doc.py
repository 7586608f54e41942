"""docs/audit-format.md's worked example: every value is recomputed here, once from first
principles (hashlib, cryptography, rfc8785) and once through the audit package."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from pathlib import Path

import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from kvguard.audit import ops
from kvguard.audit.bundle.dsse import pae
from kvguard.audit.checkpoint import open_checkpoint
from kvguard.audit.keys import SigningKey
from kvguard.audit.record import Record
from kvguard.audit.verify import verify_records

DOC = Path(__file__).resolve().parents[2] / "docs" / "audit-format.md"
ORIGIN = "kvguard.example/doc"


@pytest.fixture(scope="module")
def ex() -> dict[str, str]:
    blocks = re.findall(r"<!-- example: ([\w-]+) -->\n```[a-z]*\n(.*?)\n```", DOC.read_text(), re.S)
    assert len(blocks) == 20  # 17, and the witness cosignature's 3 (test_cosignature.py)
    return dict(blocks)


def test_the_ops_listed_are_the_registry():
    text = DOC.read_text()
    listed = re.search(r"Operations kvguard writes \(its\nregistry, `kvguard.audit.ops`\):\n(.*?) \(\[", text, re.S)
    assert listed, "docs/audit-format.md §1 lists the ops kvguard writes"
    assert set(re.findall(r"`([a-z_]+)`", listed.group(1))) == ops.OPS


@pytest.fixture(scope="module")
def key(ex) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(ex["seed"]))


def test_key_ids(ex, key):
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert ex["public-key"] == base64.b64encode(raw).decode()
    assert ex["key-id"] == hashlib.sha256(raw).hexdigest()
    assert ex["note-key-id"] == hashlib.sha256(ORIGIN.encode() + b"\n\x01" + raw).digest()[:4].hex()
    assert SigningKey.from_seed(bytes.fromhex(ex["seed"])).key_id == ex["key-id"]


def test_pseudonyms(ex):
    index_key, secret = b"\x01" * 32, b"\x02" * 32
    for name, data in (("pseudonym-tenant", b"tenant\x00acme"), ("pseudonym-user", b"user\x00acme\x00alice")):
        data_hex, index, pseudonym = ex[name].split("\n")
        assert data_hex == data.hex()
        assert index == hmac.new(index_key, data, hashlib.sha256).hexdigest()
        assert pseudonym == hmac.new(secret, data, hashlib.sha256).hexdigest()[:32]


def test_records_bytes_signatures_and_hashes(ex, key):
    prev = "0" * 64
    leaf_hashes = []
    for n in (0, 1):
        signing = ex[f"record-{n}-signing-bytes"].encode()
        obj = json.loads(signing)
        assert rfc8785.dumps(obj) == signing  # canonical
        assert obj["prev"] == prev and obj["key_id"] == ex["key-id"] and obj["seq"] == n
        sig = key.sign(signing)
        assert ex[f"record-{n}-sig"] == base64.b64encode(sig).decode()
        leaf = rfc8785.dumps({**obj, "sig": ex[f"record-{n}-sig"]})
        if n == 0:
            assert ex["record-0-leaf-bytes"].encode() == leaf
            assert ex["record-0-digest"] == hashlib.sha256(leaf).hexdigest()
        assert ex[f"record-{n}-leaf-hash"] == hashlib.sha256(b"\x00" + leaf).hexdigest()
        record = Record.from_leaf_bytes(leaf)
        assert record.signing_bytes() == signing and record.leaf_hash.hex() == ex[f"record-{n}-leaf-hash"]
        leaf_hashes.append(bytes.fromhex(ex[f"record-{n}-leaf-hash"]))
        prev = hashlib.sha256(leaf).hexdigest()
    root = hashlib.sha256(b"\x01" + leaf_hashes[0] + leaf_hashes[1]).digest()
    assert ex["root"] == root.hex()


def test_checkpoint_note(ex, key):
    note = ex["checkpoint"] + "\n"
    text, sig_line = note.split("\n\n")
    assert text + "\n" == f"{ORIGIN}\n2\n{base64.b64encode(bytes.fromhex(ex['root'])).decode()}\n"
    dash, name, blob = sig_line.rstrip("\n").split(" ")
    assert (dash, name) == ("\u2014", ORIGIN)
    blob = base64.b64decode(blob)
    assert blob[:4].hex() == ex["note-key-id"]
    assert blob[4:] == key.sign((text + "\n").encode())
    public = SigningKey.from_seed(bytes.fromhex(ex["seed"])).public_key
    cp = open_checkpoint(note, public, ORIGIN)
    assert (cp.size, cp.root.hex()) == (2, ex["root"])
    leaves = [ex["record-0-leaf-bytes"].encode(), None]
    leaves[1] = rfc8785.dumps({**json.loads(ex["record-1-signing-bytes"]), "sig": ex["record-1-sig"]})
    assert verify_records(leaves, [public], checkpoints=[note]).checkpoints == 1


def test_pae(ex):
    body = b'{"_type":"https://in-toto.io/Statement/v1"}'
    assert ex["pae"].encode() == pae("application/vnd.in-toto+json", body)
    # and the DSSE specification's own example
    assert pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
