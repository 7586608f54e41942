"""Rotation of the sidecar's Ed25519 signing key, safe against a crash at any step.

1. a new key is written beside the key file, as `<key file>.next` (mode 0600, fsynced);
2. the current key signs a `key_rotation` record naming it (AuditLog.rotate_key), stored
   with the new key's row in one transaction: from the next record on the new key signs;
3. the new key replaces the key file (rename, directory fsynced).

A crash between 2 and 3 leaves a log signed onward by the `.next` key while the key file
holds the old one: `finish_rotation`, run at every start before the key is loaded, moves
it in. A crash before 2 leaves a `.next` key the log never named: it is deleted.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvguard.audit.keys import SigningKey
from kvguard.audit.log import AuditLog
from kvguard.audit.record import Record
from kvguard.audit.store import AuditStore

from .logs import log


def next_path(key_path: Path) -> Path:
    return key_path.with_name(key_path.name + ".next")


def finish_rotation(key_path: Path, store: AuditStore, origin: str) -> None:
    """Complete or undo a rotation that a crash interrupted (see the module's docstring)."""
    pending = next_path(key_path)
    if not pending.exists():
        return
    new = SigningKey.load(pending)
    keys = store.keys(origin) if store.has_log(origin) else []
    if keys and keys[-1].key.key_id == new.key_id:
        _install(pending, key_path)
        log.warning("signing key rotation completed at start", key_id=new.key_id)
    else:
        pending.unlink()
        log.warning("signing key rotation that never reached the log discarded", key_id=new.key_id)


def rotate_signing_key(key_path: Path, audit_log: AuditLog) -> tuple[SigningKey, Record]:
    """Rotate `audit_log` to a fresh key and make it the key file's. The caller makes sure no
    other rotation of this log runs meanwhile."""
    new = SigningKey.generate()
    pending = next_path(key_path)
    with contextlib.suppress(FileNotFoundError):
        pending.unlink()  # left by a rotation whose record failed: the log never named it
    new.save(pending)
    try:
        record = audit_log.rotate_key(new)
    except BaseException:
        if audit_log.key.key_id == new.key_id:  # stored after all: the log is the new key's
            _install(pending, key_path)
        else:
            pending.unlink()
        raise
    _install(pending, key_path)
    return new, record


def _install(pending: Path, key_path: Path) -> None:
    os.replace(pending, key_path)
    fd = os.open(key_path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
