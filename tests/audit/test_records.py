"""Record fields, the details rule, and canonical bytes (fast encoder vs the rfc8785 package)."""

from __future__ import annotations

import json

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st
from kvguard.audit.canonical import MAX_SAFE_INTEGER, record_bytes
from kvguard.audit.errors import RecordFormatError
from kvguard.audit.fields import (
    check_details,
    check_known_op,
    check_op,
    check_subject,
    format_time,
    parse_time,
)
from kvguard.audit.keys import SigningKey
from kvguard.audit.record import Record

KEY = SigningKey.from_seed(bytes(32))


def make(seq=0, details=None, subject=None, op="evict") -> Record:
    r = Record("kvguard.example/t", seq, "2025-01-31T12:00:00.123Z", op, subject or {}, details or {},
               "0" * 64, KEY.key_id)
    data = r.signing_bytes()
    return r.with_signature(KEY.sign(data), data)


def _ok(d) -> bool:
    try:
        check_details(d)
        return True
    except RecordFormatError:
        return False


keys = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True).filter(lambda k: _ok({k: 1}))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
details_st = st.dictionaries(keys, values, max_size=5).filter(_ok)


origins = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._~:/-]{0,40}", fullmatch=True)
subjects = st.dictionaries(st.sampled_from(["tenant", "user", "session"]),
                           st.from_regex(r"[0-9a-f]{32}", fullmatch=True))


@settings(max_examples=300, deadline=None)
@given(details=details_st, seq=st.integers(0, MAX_SAFE_INTEGER), origin=origins, subject=subjects,
       op=st.from_regex(r"[a-z_]{1,32}", fullmatch=True))
def test_fast_encoders_match_rfc8785(details, seq, origin, subject, op):
    r = make(seq, details, subject, op)
    assert r.signing_bytes() == rfc8785.dumps(r.unsigned_dict())
    assert r.leaf_bytes == rfc8785.dumps(r.to_dict())
    assert Record.from_leaf_bytes(r.leaf_bytes) == r
    # the writer's path: assembled around the encoded objects
    w = Record.sign_new(KEY, origin, seq, "2025-01-31T12:00:00.123Z", op, subject, details, "f" * 64)
    assert w.signing_bytes() == rfc8785.dumps(w.unsigned_dict())
    assert w.leaf_bytes == rfc8785.dumps(w.to_dict())
    assert w.signing_bytes_from_leaf() == w.signing_bytes()
    KEY.public_key.verify(w.signature, w.signing_bytes())


def test_escapes_and_unicode_match_rfc8785():
    tricky = {"codec": "\u0000\u001f\"\\\u007f\u2028\ud7ff\ue000\U0001f600 é", "n": -(2**53 - 1)}
    assert record_bytes(tricky) == rfc8785.dumps(tricky)


@pytest.mark.parametrize("details", [
    {"prompt": "hello"}, {"nested": {"text": "x"}}, {"token_ids": [1, 2]}, {"user_id": "alice"},
    {"session_id": "s"}, {"tenant_id": "t"}, {"raw_bytes": 1}, {"input_text": "x"},
    {"items": [{"messages": []}]}, {"ratio": 0.5}, {"big": 2**53}, {"s": "x" * 257},
    {"Bad": 1}, {"a-b": 1}, {1: 2}, {"blob": b"x"}, {"d": {"e": {"f": {"g": {"h": 1}}}}},
    {"many": list(range(4097))}, {"nan": float("nan")},
])
def test_details_that_look_like_content_are_refused(details):
    with pytest.raises(RecordFormatError):
        check_details(details)


def test_details_accepts_digests_counts_codec():
    d = {"pages": [1, 2, 3], "bytes": 65536, "codec": "int8", "digest": "ab" * 32, "num_tokens": 16,
         "tier": {"from": "gpu", "to": "cpu"}, "ok": True, "note": None}
    assert check_details(d) is d


@pytest.mark.parametrize("op", ["", "Evict", "evict-1", "a" * 33, None, "évict", ["evict"]])
def test_op_must_be_lowercase_word(op):
    with pytest.raises(RecordFormatError):
        check_op(op)
    with pytest.raises(RecordFormatError):
        check_known_op(op)


def test_kvguard_writes_only_the_registered_ops_and_reads_any():
    assert check_known_op("evict") == "evict"
    assert check_op("evicted") == "evicted"  # the format's set is open to readers
    with pytest.raises(RecordFormatError, match="register a new one in kvguard.audit.ops"):
        check_known_op("evicted")


@pytest.mark.parametrize("subject", [{"user": "alice"}, {"user": "AB" * 16}, {"email": "a" * 32}, ["x"]])
def test_subject_only_holds_pseudonyms(subject):
    with pytest.raises(RecordFormatError):
        check_subject(subject)


def test_time_round_trip():
    assert format_time(1738324800123) == "2025-01-31T12:00:00.123Z"
    assert parse_time("2025-01-31T12:00:00.123Z") == 1738324800123
    for bad in ["2025-01-31T12:00:00Z", "2025-01-31T12:00:00.123+00:00", "2025-02-30T00:00:00.000Z", 5,
                [], {}]:  # unhashable: refused before the cache
        with pytest.raises(RecordFormatError):
            parse_time(bad)


def test_non_canonical_bytes_are_refused():
    r = make(details={"b": 1, "a": 2})
    pretty = json.dumps(r.to_dict(), indent=1).encode()
    with pytest.raises(RecordFormatError, match="canonical"):
        Record.from_leaf_bytes(pretty)
    duplicated = r.leaf_bytes.replace(b'{"details":{', b'{"details":{"a":2,', 1)
    with pytest.raises(RecordFormatError):
        Record.from_leaf_bytes(duplicated)
    with pytest.raises(RecordFormatError, match="fields"):
        Record.parse({**r.to_dict(), "extra": 1})


def test_prev_and_leaf_hash_definitions():
    import hashlib

    r = make()
    assert r.digest == hashlib.sha256(r.leaf_bytes).hexdigest()
    assert r.leaf_hash == hashlib.sha256(b"\x00" + r.leaf_bytes).digest()
    assert b'"sig":' not in r.signing_bytes() and b'"sig":' in r.leaf_bytes


any_keys = st.one_of(keys, st.sampled_from(["prompt", "user_id", "raw_x", "Bad", "a-b", "x_text", "é"]),
                     st.integers(0, 3))
any_scalars = st.one_of(scalars, st.floats(allow_nan=True), st.binary(max_size=3),
                        st.text(max_size=300), st.just("\ud800"), st.integers())
any_values = st.recursive(any_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(any_keys, inner, max_size=4)), max_leaves=20)


@settings(max_examples=500, deadline=None)
@given(value=st.dictionaries(any_keys, any_values, max_size=5))
def test_fast_details_check_never_admits_what_the_full_check_refuses(value):
    from kvguard.audit import fields

    try:
        fields._check_value(value, "details", 1)
        refused = False
    except RecordFormatError:
        refused = True
    if refused:
        assert not fields._valid(value, 1)
        with pytest.raises(RecordFormatError):
            check_details(value)
    else:
        assert check_details(value) is value
        if len(fields._GOOD_KEYS) < 4096:  # the full check admitted its keys: the fast one agrees now
            assert fields._valid(value, 1)
