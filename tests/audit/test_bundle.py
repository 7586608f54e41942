"""Bundles: export, offline verification, a tamper matrix over every part, chaining."""

from __future__ import annotations

import base64
import json
import re

import pytest
from kvguard.audit.bundle.export import export_bundle
from kvguard.audit.bundle.verify import verify_bundle
from kvguard.audit.errors import BundleError, VerificationError
from kvguard.audit.keys import SigningKey
from kvguard.audit.log import AuditLog, LogConfig
from kvguard.audit.pseudonym import Pseudonymizer

from .audit_testlib import fill, open_log, read_bundle, write_bundle

MEMBERS = ["records.jsonl", "checkpoints.json", "proofs.json", "keys.json", "receipts.jsonl",
           "manifest.dsse.json"]


ROGUE = SigningKey.from_seed(b"\x44" * 32)


@pytest.fixture
def keys():
    """The log's first key, which verifiers trust, and the key it rotates to."""
    return SigningKey.from_seed(b"\x11" * 32), SigningKey.from_seed(b"\x22" * 32)


@pytest.fixture
def populated(store, origin, keys):
    """60 records, an erasure, a key rotation, checkpoints every 16 records."""
    old, new = keys
    with open_log(store, origin, old, checkpoint_every=16) as log:
        fill(log, 30)
        log.append("erase", {"user": "ab" * 16}, {"scope": "user", "pages": 3})
        fill(log, 9)
        log.rotate_key(new)
        fill(log, 19)
        log.checkpoint()
    return store


def export(store, origin, path, key, **kw):
    return export_bundle(store, origin, str(path), key, progress=False, **kw)


@pytest.fixture
def bundle(populated, origin, keys, tmp_path):
    """Records 5..50 of 60: checkpoints at 30, 40 (before the rotation at seq 40) and 60
    (covering), an erasure at 30, and prefix and suffix hashes around the range."""
    path = tmp_path / "part.zip"
    export(populated, origin, path, keys[1], from_seq=5, to_seq=50)
    return path


def test_whole_log_and_ranges_verify(populated, origin, keys, tmp_path, bundle):
    s = verify_bundle(bundle, [keys[0].public_key])
    assert (s.from_seq, s.to_seq, s.records, s.tree_size, s.keys, s.receipts) == (5, 50, 46, 60, 2, 1)
    assert s.checkpoints == 3
    export(populated, origin, tmp_path / "all.zip", keys[1])
    s = verify_bundle(tmp_path / "all.zip", [keys[0].public_key])
    assert (s.from_seq, s.to_seq, s.records, s.tree_size, s.keys, s.receipts) == (0, 59, 60, 60, 2, 1)
    for a, b in [(0, 0), (5, 33), (17, 44), (40, 59), (30, 30)]:
        path = tmp_path / f"{a}-{b}.zip"
        out = export(populated, origin, path, keys[1], from_seq=a, to_seq=b)
        s = verify_bundle(path, [keys[0].public_key])
        assert (s.from_seq, s.to_seq, s.tree_size) == (a, b, out.tree_size)
        assert s.receipts == (1 if a <= 30 <= b else 0)
    assert list(read_bundle(bundle)) == MEMBERS


def test_time_range(populated, origin, keys, tmp_path):
    first = populated.record(origin, 0).time_ms
    out = export(populated, origin, tmp_path / "t.zip", keys[1], since_ms=first, until_ms=first + 10**9)
    assert (out.from_seq, out.to_seq) == (0, 59)
    with pytest.raises(BundleError, match="no records"):
        export(populated, origin, tmp_path / "none.zip", keys[1], since_ms=first - 10**6, until_ms=first - 1)


def test_export_refuses_what_no_checkpoint_covers(store, origin, keys, tmp_path):
    with open_log(store, origin, keys[0]) as log:
        fill(log, 3)
        with pytest.raises(BundleError, match="no checkpoint"):
            export(store, origin, tmp_path / "x.zip", keys[0])
        log.checkpoint()
        fill(log, 2)
        with pytest.raises(BundleError, match="not covered"):
            export(store, origin, tmp_path / "x.zip", keys[0], to_seq=4)
    assert not (tmp_path / "x.zip").exists()


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def _edit_json(data: bytes, change) -> bytes:
    doc = json.loads(data)
    change(doc)
    return json.dumps(doc).encode() + b"\n"


_deep = b"[" * 10**5 + b"]" * 10**5  # deeper than the JSON parser recurses


def _hex_flip(h: str) -> str:
    return ("1" if h[0] == "0" else "0") + h[1:]


# (member edited, edit, reseal? (True: with the key at the tree size), expected check, expected member,
#  expected seq or None)
TAMPER = [
    # raw edits: the manifest digest catches each, naming the member
    ("checkpoints.json", lambda b: _flip(b, 40), False, "digest", "checkpoints.json", None),
    ("proofs.json", lambda b: _flip(b, 30), False, "digest", "proofs.json", None),
    ("keys.json", lambda b: _flip(b, 30), False, "digest", "keys.json", None),
    ("receipts.jsonl", lambda b: _flip(b, 30), False, "digest", "receipts.jsonl", None),
    ("records.jsonl", lambda b: b.replace(b'"pages":3', b'"pages":4', 1), False,
     "signature", "records.jsonl", 30),
    ("records.jsonl", lambda b: b[: b.rindex(b"\n", 0, -1) + 1], False, "sequence", "records.jsonl", 50),
    # malformed fields: the format check, before any digest, never a crash
    ("records.jsonl", lambda b: re.sub(rb'"time":"[^"]*"', b'"time":[]', b, count=1), False, "format",
     "records.jsonl", 5),
    ("records.jsonl", lambda b: b.replace(b'"details":{', b'"details":' + _deep + b',"x":{', 1), False,
     "format", "records.jsonl", 5),
    ("manifest.dsse.json", lambda b: _edit_json(b, lambda d: d.update(
        payload=base64.b64encode(
            base64.b64decode(d["payload"]).replace(b'"count":46', b'"count":47')).decode())),
     False, "envelope_signature", "manifest.dsse.json", None),
    ("manifest.dsse.json", lambda b: _edit_json(b, lambda d: d["signatures"][0].update(
        sig=base64.b64encode(b"\x00" * 64).decode())), False, "envelope_signature", "manifest.dsse.json",
     None),
    ("manifest.dsse.json", lambda b: _deep, False, "envelope", "manifest.dsse.json", None),
    # resealed edits (digests recomputed, manifest re-signed): the deeper checks catch them
    ("checkpoints.json", lambda b: _deep, True, "format", "checkpoints.json", None),
    ("receipts.jsonl", lambda b: _deep + b"\n", True, "format", "receipts.jsonl", None),
    ("proofs.json", lambda b: _edit_json(b, lambda d: d["suffix"].__setitem__(0, _hex_flip(d["suffix"][0]))),
     True, "merkle_root", "proofs.json", None),
    ("proofs.json", lambda b: _edit_json(b, lambda d: d["prefix"].__setitem__(1, _hex_flip(d["prefix"][1]))),
     True, "merkle_root", "records.jsonl", 29),  # caught at the first checkpoint inside the range
    ("proofs.json", lambda b: _edit_json(b, lambda d: d["consistency"][0]["proof"].__setitem__(
        0, _hex_flip(d["consistency"][0]["proof"][0]))), True, "consistency", "proofs.json", None),
    ("keys.json", lambda b: _edit_json(b, lambda d: d["keys"][1].update(
        public_key=ROGUE.public_key.to_base64())), ROGUE, "key", "keys.json", None),
    ("keys.json", lambda b: _edit_json(b, lambda d: d["keys"][1]["rotation"]["inclusion_proof"].__setitem__(
        0, _hex_flip(d["keys"][1]["rotation"]["inclusion_proof"][0]))), True, "inclusion", "keys.json", 40),
    ("checkpoints.json", lambda b: _edit_json(b, lambda d: d["checkpoints"][-1].update(
        note=d["checkpoints"][-1]["note"].replace("\n60\n", "\n61\n"))), True, "checkpoint_format",
     "checkpoints.json", None),
    ("records.jsonl", lambda b: b.replace(b'"scope":"user"', b'"scope":"useR"'), True, "signature",
     "records.jsonl", 30),
    ("receipts.jsonl", lambda b: b"", True, "receipt", "receipts.jsonl", 30),
    ("receipts.jsonl", lambda b: _edit_json(b, lambda d: d["inclusion_proof"].__setitem__(
        0, _hex_flip(d["inclusion_proof"][0]))), True, "inclusion", "receipts.jsonl", 30),
]


@pytest.mark.parametrize("member,edit,reseal,check,named,seq", TAMPER,
                         ids=[f"{t[0]}-{t[3]}-{'resealed' if t[2] else 'raw'}" for t in TAMPER])
def test_tamper_matrix(bundle, keys, origin, tmp_path, member, edit, reseal, check, named, seq):
    members = read_bundle(bundle)
    members[member] = edit(members[member])
    bad = tmp_path / "bad.zip"
    write_bundle(bad, members, reseal_with=keys[1] if reseal is True else (reseal or None))
    with pytest.raises(VerificationError) as err:
        verify_bundle(bad, [keys[0].public_key])
    assert (err.value.check, err.value.member) == (check, named), str(err.value)
    if seq is not None:
        assert (err.value.origin, err.value.seq) == (origin, seq)
        assert f"record {origin}#{seq}" in str(err.value)


def test_container_shape_is_fixed(bundle, keys, tmp_path):
    members = read_bundle(bundle)
    for shuffled in ({k: members[k] for k in reversed(members)}, {**members, "extra.txt": b"x"},
                     {k: v for k, v in members.items() if k != "receipts.jsonl"}):
        write_bundle(tmp_path / "bad.zip", shuffled)
        with pytest.raises(VerificationError) as err:
            verify_bundle(tmp_path / "bad.zip", [keys[0].public_key])
        assert err.value.check == "container"
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    with pytest.raises(VerificationError, match="container"):
        verify_bundle(tmp_path / "junk.zip", [keys[0].public_key])


def test_untrusted_key_and_old_key(bundle, keys):
    for trusted in ([SigningKey.generate().public_key], [keys[1].public_key]):  # a later key is not enough
        with pytest.raises(VerificationError) as err:
            verify_bundle(bundle, trusted)
        assert (err.value.check, err.value.member) == ("key", "keys.json")
        assert "first key" in err.value.message
    s = verify_bundle(bundle, [keys[0].public_key])
    assert s.signer == keys[1].public_key.key_id  # the key at the tree size, by rotation from the first


def test_a_trusted_manifest_does_not_vouch_for_another_log(store, origin, keys, tmp_path):
    # every record signed by a key nobody trusts; the manifest re-signed by a trusted key
    with open_log(store, origin, ROGUE, checkpoint_every=4) as log:
        fill(log, 9)
        log.checkpoint()
    export(store, origin, tmp_path / "rogue.zip", ROGUE)
    write_bundle(tmp_path / "bad.zip", read_bundle(tmp_path / "rogue.zip"), reseal_with=keys[0])
    with pytest.raises(VerificationError) as err:
        verify_bundle(tmp_path / "bad.zip", [keys[0].public_key])
    assert (err.value.check, err.value.member) == ("key", "keys.json")
    assert ROGUE.public_key.key_id[:16] in err.value.message


def test_the_manifest_is_signed_by_the_key_at_the_tree_size(bundle, keys, tmp_path):
    # the log is trusted, but the manifest's signer is another trusted key: the retired first
    # key, or an unrelated one
    other = SigningKey.generate()
    for signer in (keys[0], other):
        write_bundle(tmp_path / "bad.zip", read_bundle(bundle), reseal_with=signer)
        with pytest.raises(VerificationError) as err:
            verify_bundle(tmp_path / "bad.zip", [keys[0].public_key, other.public_key])
        assert (err.value.check, err.value.member) == ("envelope_signature", "manifest.dsse.json")
        assert f"{keys[1].public_key.key_id[:16]}..., the log's key at tree size 60" in err.value.message


def test_export_signs_with_the_key_at_the_tree_size(populated, origin, keys, tmp_path):
    old, new = keys
    # records 0..9: the first covering checkpoint (30) is the old key's; the new key covers them
    # with its first checkpoint after the rotation at seq 40
    assert export(populated, origin, tmp_path / "old.zip", old, to_seq=9).tree_size == 30
    assert export(populated, origin, tmp_path / "new.zip", new, to_seq=9).tree_size == 60
    for path in ("old.zip", "new.zip"):
        assert verify_bundle(tmp_path / path, [old.public_key]).to_seq == 9
    with pytest.raises(BundleError, match="signs no checkpoint"):
        export(populated, origin, tmp_path / "x.zip", old, from_seq=45, to_seq=50)  # rotated out
    with pytest.raises(BundleError, match="signs no checkpoint"):
        export(populated, origin, tmp_path / "x.zip", ROGUE, to_seq=9)
    assert not (tmp_path / "x.zip").exists()


def test_bundles_before_and_after_an_erasure_are_consistent(store, origin, keys, tmp_path):
    pz = Pseudonymizer(store, b"\x05" * 32)
    key = keys[0]
    with open_log(store, origin, key, checkpoint_every=8) as log:
        alice = pz.subject(tenant="acme", user="alice")
        log.append_many([("quantize", alice, {"pages": [i]}) for i in range(20)])
        log.checkpoint()
        before = tmp_path / "before.zip"
        export(store, origin, before, key)
        log.append("erase", {"user": alice["user"]}, {"scope": "user", "pages": 20})
        pz.shred("user", "alice", tenant="acme")
        fill(log, 5)
        log.checkpoint()
    after_all, after_tail = tmp_path / "after.zip", tmp_path / "tail.zip"
    export(store, origin, after_all, key)
    export(store, origin, after_tail, key, from_seq=20)  # starts where `before` ended
    for after in (after_all, after_tail):
        s = verify_bundle(after, [key.public_key], previous=before)
        assert s.previous_tree_size == 20 and s.receipts == 1
    with pytest.raises(VerificationError) as err:
        verify_bundle(before, [key.public_key], previous=after_all)  # the wrong way round
    assert err.value.check == "consistency"


def test_previous_bundle_across_a_rotation(populated, origin, keys, tmp_path, bundle):
    old, new = keys
    before = tmp_path / "before.zip"
    export(populated, origin, before, old, to_seq=9)  # tree size 30, the old key's
    assert verify_bundle(bundle, [old.public_key], previous=before).previous_tree_size == 30
    write_bundle(tmp_path / "resealed.zip", read_bundle(before), reseal_with=new)  # not the key at 30
    with pytest.raises(VerificationError) as err:
        verify_bundle(bundle, [old.public_key, new.public_key], previous=tmp_path / "resealed.zip")
    assert (err.value.check, err.value.member) == ("envelope_signature", "previous:manifest.dsse.json")


def test_previous_from_a_forked_log_is_refused(origin, keys, tmp_path):
    from kvguard.audit.store import AuditStore, migrate

    key, paths = keys[0], []
    for i in range(2):  # the same origin and key in two databases, different content: a fork
        url = f"sqlite:///{tmp_path / f'fork{i}.db'}"
        migrate(url)
        store = AuditStore(url)
        with open_log(store, origin, key) as log:
            log.append_many([("evict", {}, {"fork": i, "n": n}) for n in range(10)])
            log.checkpoint()  # both have a checkpoint at 10, so the new bundle has a proof from 10
            if i:
                log.append("evict")
                log.checkpoint()
        paths.append(tmp_path / f"{i}.zip")
        export(store, origin, paths[-1], key)
        store.dispose()
    verify_bundle(paths[1], [key.public_key])  # each is fine on its own
    with pytest.raises(VerificationError) as err:
        verify_bundle(paths[1], [key.public_key], previous=paths[0])
    assert (err.value.check, err.value.member) == ("consistency", "proofs.json")
    assert "does not link" in err.value.message


@pytest.mark.postgres
def test_postgres_and_sqlite_bundles_verify_alike(sqlite_url, pg_url, origin, tmp_path):
    from kvguard.audit.store import AuditStore

    key = SigningKey.from_seed(b"\x33" * 32)
    results = []
    for url in (sqlite_url, pg_url):
        store = AuditStore(url)
        ticks = iter(range(1_700_000_000_000, 1_700_000_000_000 + 10**6, 7))
        log = AuditLog(store, origin, key, LogConfig(checkpoint_every=10**9, checkpoint_interval_ms=10**9),
                       clock=lambda: next(ticks))  # noqa: B023 (this log is used up in this turn)
        for n in range(4):
            log.append_many([("evict", {}, {"batch": n, "i": i}) for i in range(10)])
        log.append("erase", {"session": "cd" * 16}, {"scope": "session"})
        log.close()
        # one checkpoint each, at the same size: signatures are deterministic (Ed25519)
        log = AuditLog(store, origin, key, LogConfig(checkpoint_every=10**9, checkpoint_interval_ms=10**9),
                       clock=lambda: 1_700_000_001_000)
        log.checkpoint()
        log.close()
        path = tmp_path / f"{store.dialect}.zip"
        export(store, origin, path, key)
        results.append((verify_bundle(path, [key.public_key]), read_bundle(path)))
        store.dispose()
    (s1, m1), (s2, m2) = results
    assert s1 == s2
    for name in MEMBERS[:-1]:
        assert m1[name] == m2[name], name
