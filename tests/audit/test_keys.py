"""Key files, ids and export."""

from __future__ import annotations

import hashlib
import os
import pickle

import pytest
from kvguard.audit.errors import KeyFileError, VerificationError
from kvguard.audit.keys import PublicKey, SigningKey


def test_save_is_0600_and_load_round_trips(tmp_path):
    key = SigningKey.generate()
    path = tmp_path / "log.key"
    key.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert SigningKey.load(path).key_id == key.key_id
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        key.save(path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_load_refuses_group_or_world_readable_key(tmp_path, mode):
    path = tmp_path / "log.key"
    SigningKey.generate().save(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileError) as err:
        SigningKey.load(path)
    assert str(path) in str(err.value) and f"chmod 600 {path}" in str(err.value)


def test_load_refuses_garbage_and_missing(tmp_path):
    path = tmp_path / "bad.key"
    path.write_text("not a key")
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match="not an unencrypted PEM"):
        SigningKey.load(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        SigningKey.load(tmp_path / "missing.key")


def test_private_key_never_shows_in_repr_or_pickle():
    key = SigningKey.from_seed(b"\x07" * 32)
    pem_body = key._key.private_bytes_raw().hex()
    assert pem_body not in repr(key) and pem_body not in str(key)
    assert repr(key) == f"SigningKey(key_id={key.key_id!r})"
    with pytest.raises(TypeError):
        pickle.dumps(key)


def test_ids_and_public_formats():
    key = SigningKey.from_seed(bytes(32)).public_key
    assert key.key_id == hashlib.sha256(key.raw).hexdigest()
    expected = hashlib.sha256(b"example.com/log\n\x01" + key.raw).digest()[:4]
    assert key.note_key_id("example.com/log") == expected
    for text in (key.to_pem(), key.to_base64(), key.raw.hex()):
        assert PublicKey.from_text(text) == key
    with pytest.raises(KeyFileError):
        PublicKey.from_text("abcd")


def test_verify_raises():
    key = SigningKey.generate()
    sig = key.sign(b"data")
    key.public_key.verify(sig, b"data")
    with pytest.raises(VerificationError) as err:
        key.public_key.verify(sig, b"datA")
    assert err.value.check == "signature"
