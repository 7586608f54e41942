"""Ed25519 keys of a log: generate, save (0600), load (refusing unsafe files), ids, export.

Two ids name a public key (docs/audit-format.md, "Keys"):

* record key id: hex SHA-256 of the 32-byte raw public key, in every record's `key_id`;
* note key id: C2SP signed-note, SHA-256(name || 0x0A || 0x01 || raw key)[:4], in
  checkpoint signature lines, where the name is the log origin.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import KeyFileError, VerificationError

NOTE_SIG_TYPE_ED25519 = b"\x01"


class PublicKey:
    """An Ed25519 public key with the ids the log uses for it."""

    __slots__ = ("_key", "raw", "key_id")

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key
        self.raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = hashlib.sha256(self.raw).hexdigest()

    @classmethod
    def from_raw(cls, raw: bytes) -> PublicKey:
        if len(raw) != 32:
            raise KeyFileError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
        return cls(Ed25519PublicKey.from_public_bytes(raw))

    @classmethod
    def from_text(cls, text: str) -> PublicKey:
        """Accepts PEM (SubjectPublicKeyInfo), base64 of the raw key, or its hex."""
        text = text.strip()
        if text.startswith("-----BEGIN"):
            try:
                key = serialization.load_pem_public_key(text.encode())
            except ValueError as exc:
                raise KeyFileError(f"not a PEM public key: {exc}") from None
            if not isinstance(key, Ed25519PublicKey):
                raise KeyFileError("the PEM public key is not an Ed25519 key")
            return cls(key)
        try:
            raw = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
        except (ValueError, binascii.Error):
            raise KeyFileError("expected a PEM, base64 or hex Ed25519 public key") from None
        return cls.from_raw(raw)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PublicKey:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"cannot read public key {path}: {exc}") from None
        try:
            return cls.from_text(text)
        except KeyFileError as exc:
            raise KeyFileError(f"{path}: {exc}") from None

    def to_pem(self) -> str:
        return self._key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ).decode("ascii")

    def to_base64(self) -> str:
        return base64.b64encode(self.raw).decode("ascii")

    def note_key_id(self, name: str) -> bytes:
        """C2SP signed-note key id (4 bytes) of this key under `name`."""
        return hashlib.sha256(name.encode() + b"\n" + NOTE_SIG_TYPE_ED25519 + self.raw).digest()[:4]

    def verify(self, signature: bytes, data: bytes) -> None:
        """Raises VerificationError(check='signature'); callers add the record or member."""
        try:
            self._key.verify(signature, data)
        except InvalidSignature:
            raise VerificationError(
                "signature", f"Ed25519 signature by key {self.key_id[:16]}... does not verify"
            ) from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"PublicKey(key_id={self.key_id!r})"


class SigningKey:
    """An Ed25519 private key. Its repr and str never show key material."""

    __slots__ = ("_key", "public_key")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key = PublicKey(key.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        """Deterministic key from a 32-byte seed (test vectors, docs); use `generate` otherwise."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def key_id(self) -> str:
        return self.public_key.key_id

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def private_bytes_raw(self) -> bytes:
        """The 32-byte seed, for handing the key to the log's own signer process over a
        pipe (audit.signproc); never write or log it."""
        return self._key.private_bytes_raw()

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """PKCS#8 PEM, created with mode 0600 (never readable by group or others)."""
        pem = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_private_file(path, pem, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        data = read_private_file(path)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise KeyFileError(f"{path} is not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} is not an Ed25519 private key")
        return cls(key)

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r})"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a SigningKey is not picklable: load it from its file in each process")


def read_private_file(path: str | os.PathLike[str]) -> bytes:
    """Read a secret file, refusing one that group or others could read or write."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise KeyFileError(f"cannot read private key {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"private key {path} is accessible by group or others (mode {stat.S_IMODE(mode):04o});"
            f" run `chmod 600 {path}`"
        )
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read private key {path}: {exc.strerror}") from None


def write_private_file(path: str | os.PathLike[str], data: bytes, *, overwrite: bool = False) -> None:
    """Create a secret file with mode 0600 (refusing to replace one unless told to)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} exists; refusing to overwrite a private key") from None
    except OSError as exc:
        raise KeyFileError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)  # O_CREAT's mode does not apply to an existing file
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def rotation_details(new_key: PublicKey) -> dict[str, str]:
    """The details of a key_rotation record: which key signs from the next record on."""
    return {"new_key_id": new_key.key_id, "new_public_key": new_key.to_base64()}
