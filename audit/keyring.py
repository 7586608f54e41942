"""Key-encryption keys (KEKs) of the subjects' pseudonym secrets, kept outside the database.

A subject secret is stored in subject_keys wrapped with AES-256-GCM under a KEK:

    blob = nonce (12 bytes) || AES-GCM(KEK, nonce, secret, aad = "kvguard-subject-key" || 0x00 || kek id || 0x00 || idx)

The KEK is a 32-byte secret in the file `<kek id>.kek` (hex, mode 0600) of a directory
that is not part of the database; table `keks` names the current one (the newest not
destroyed). `rotate` makes a new KEK, re-wraps every live secret under it, then deletes
the old file. A deleted row's copies in PostgreSQL's dead tuples, WAL, archives and
backups were wrapped under a KEK that rotation destroys, so a shredded secret becomes
unreadable everywhere within one rotation period (docs/audit-format.md §6).

The aad binds a blob to its row: a blob moved to another subject's row does not open.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import KeyFileError
from .keys import read_private_file, write_private_file

KEK_BYTES = 32
NONCE_BYTES = 12


def _aad(kek_id: str, idx: bytes) -> bytes:
    return b"kvguard-subject-key\x00" + kek_id.encode("ascii") + b"\x00" + idx


class Keyring:
    """The KEK files of one directory, and wrapping under them. KEKs read from a file are
    kept in memory until `forget_destroyed` finds the file gone."""

    def __init__(self, directory: str | os.PathLike[str], store) -> None:
        self.directory, self._store = Path(directory), store
        self._keys: dict[str, bytes] = {}
        self.unreadable: list[bytes] = []  # idx of the rows the last rotation could not open

    def __repr__(self) -> str:
        return f"Keyring({str(self.directory)!r}, <keys hidden>)"

    def path(self, kek_id: str) -> Path:
        return self.directory / f"{kek_id}.kek"

    def key(self, kek_id: str) -> bytes:
        found = self._keys.get(kek_id)
        if found is not None:
            return found
        path = self.path(kek_id)
        if not path.exists():
            raise KeyFileError(f"key-encryption key {kek_id} is not in {self.directory}: it was destroyed by a "
                               "rotation (what it wrapped is unreadable on purpose), or the directory mounted "
                               "here is not the one every sidecar of this database shares")
        try:
            key = bytes.fromhex(read_private_file(path).decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            key = b""
        if len(key) != KEK_BYTES:
            raise KeyFileError(f"{path} must hold {KEK_BYTES} bytes as hex")
        self._keys[kek_id] = key
        return key

    def current(self) -> str:
        """The id of the KEK that wraps new secrets, creating the first one if there is none."""
        kek_id = self._store.current_kek()
        if kek_id is None:
            kek_id = self._create()
        return kek_id

    def wrap(self, idx: bytes, secret: bytes, kek_id: str | None = None) -> tuple[str, bytes]:
        kek_id = kek_id or self.current()
        nonce = os.urandom(NONCE_BYTES)
        return kek_id, nonce + AESGCM(self.key(kek_id)).encrypt(nonce, secret, _aad(kek_id, idx))

    def unwrap(self, idx: bytes, kek_id: str | None, blob: bytes) -> bytes:
        if kek_id is None:  # stored before wrapping: in the clear until the next rotation
            return blob
        try:
            return AESGCM(self.key(kek_id)).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], _aad(kek_id, idx))
        except InvalidTag:
            raise KeyFileError(f"a subject secret does not open under key-encryption key {kek_id}: the row was "
                               "altered or moved from another subject's row") from None

    def _create(self) -> str:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        kek_id = secrets.token_hex(8)
        key = secrets.token_bytes(KEK_BYTES)
        write_private_file(self.path(kek_id), key.hex().encode() + b"\n")
        _fsync_dir(self.directory)
        self._keys[kek_id] = key
        self._store.add_kek(kek_id, _now_ms())  # from here on, new secrets are wrapped under it
        return kek_id

    def due(self, period_s: float, now_ms: int | None = None) -> bool:
        """Whether the current KEK is older than `period_s` (or there is none yet)."""
        created = self._store.current_kek_created_ms()
        return created is None or (now_ms or _now_ms()) - created >= period_s * 1000

    def rotate(self, progress: Callable[[int], None] | None = None) -> str:
        """New KEK; every live secret re-wrapped under it; the older KEKs marked destroyed and
        their files deleted. The caller makes sure one rotation runs at a time
        (`AuditStore.kek_rotation_lock`). Returns the new KEK's id."""
        new = self._create()
        self.unreadable: list[bytes] = []
        self.rewrap(new, progress, self.unreadable)
        self._store.destroy_keks_except(new, _now_ms())
        self.rewrap(new, progress)  # a secret a writer wrapped under the old KEK while this ran
        for path in self.directory.glob("*.kek"):
            if path.stem != new:
                _destroy_file(path)
        _fsync_dir(self.directory)
        self.forget_destroyed()
        return new

    def rewrap(self, kek_id: str, progress: Callable[[int], None] | None = None,
               unreadable: list[bytes] | None = None) -> int:
        """Re-wrap every secret not yet under `kek_id` (also those stored before wrapping).
        A row that opens under no KEK here (a destroyed one's, restored from a backup; an
        altered one) stays as it is, unreadable, and its idx goes to `unreadable`: it must
        not stop the rotation that bounds every other secret's exposure."""
        done, after = 0, b""
        while batch := self._store.subject_rows_not_under(kek_id, after, limit=1000):
            after = batch[-1][0]
            rows = []
            for idx, old_id, blob in batch:
                try:
                    secret = self.unwrap(idx, old_id, blob)
                except KeyFileError:
                    if unreadable is not None:
                        unreadable.append(idx)
                    continue
                rows.append((idx, old_id, kek_id, self.wrap(idx, secret, kek_id)[1]))
            done += self._store.rewrap_subject_secrets(rows)  # one transaction a batch
            if progress is not None:
                progress(done)
        return done

    def forget_destroyed(self) -> None:
        """Drop from memory every KEK whose file is gone (another sidecar rotated)."""
        for kek_id in [k for k in self._keys if not self.path(k).exists()]:
            del self._keys[kek_id]


def _destroy_file(path: Path) -> None:
    """Overwrite, then unlink. On copy-on-write or journaling storage the overwrite may not
    reach the old blocks: keep the directory on storage that is not snapshotted or backed up."""
    with contextlib.suppress(FileNotFoundError):
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.write(os.urandom(size))
            fh.flush()
            os.fsync(fh.fileno())
        path.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
