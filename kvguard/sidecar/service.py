"""The sidecar's state: settings, signing key, audit log, pseudonyms, sealed requests.

Keys live in the data directory, mode 0600: the Ed25519 signing key, the index
key of the pseudonyms, and the key that seals the subject ids of a pending
erasure request; the key-encryption keys of the pseudonym secrets in their own
directory (audit.keyring). None of them is ever logged.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from kvguard.audit.errors import TamperedLogError
from kvguard.audit.keyring import Keyring
from kvguard.audit.keys import SigningKey
from kvguard.audit.log import AuditLog, LogConfig
from kvguard.audit.pseudonym import Pseudonymizer, generate_index_key, load_index_key
from kvguard.audit.store import AuditStore, check_current, make_engine, migrate

from ..errors import ConfigError
from .auth import any_admin_token, tenant_index
from .fleet import Fleet
from .ingest import Ingestor
from .logs import log
from .metrics import Metrics
from .models import ErasurePart, ErasureRequest
from .registry import Registry
from .roles import check_runtime_role
from .settings import Settings, check_secure
from .signing import finish_rotation

READY_VERIFY_S = 2.0  # how long /readyz waits for the writer to verify the log's tail
NO_WITNESS = ("no witness is configured: a rollback of the log together with the checkpoints covering it "
              "is consistent in itself, and only a witness (or an earlier bundle) shows it (KVGUARD_WITNESSES, "
              "docs/sidecar.md \"Witnesses\")")


def load_or_create_secret(path: Path) -> bytes:
    """A 32-byte secret kept as hex in a mode-0600 file, created on first start."""
    return load_index_key(path) if path.exists() else generate_index_key(path)


def secure_data_dir(path: Path) -> None:
    """The data directory holds keys, the SQLite database and the socket: mode 0700. One made
    earlier with a looser mode is tightened; one that another user owns is refused, since
    whoever owns it can loosen it again."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise ConfigError(f"the data directory {path} belongs to uid {st.st_uid}, not to this user "
                          f"(uid {os.geteuid()}): use a directory of your own (KVGUARD_DATA_DIR)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        path.chmod(0o700)


@contextlib.contextmanager
def private_files():
    """Files created inside are readable by their owner only (umask 077): the SQLite database
    holds the subjects' pseudonym secrets. The umask is the process's; it is restored after."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def secure_sqlite_files(url: str) -> None:
    """Mode 0600 for a SQLite database and its -wal and -shm files, also when an earlier
    version created them world-readable. Nothing to do for another database."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            f = Path(parsed.database + suffix)
            if stat.S_IMODE(f.stat().st_mode) != 0o600:
                f.chmod(0o600)


class Sidecar:
    def __init__(self, settings: Settings, *, migrate_db: bool = True) -> None:
        self.settings = s = settings
        secure_data_dir(s.data_dir)
        # pre-ping: connections left dead by a database outage are replaced, not handed out
        self.engine = make_engine(s.db_url, pool_pre_ping=True)
        with private_files():  # the database and the files SQLite makes beside it
            if migrate_db and s.migrates_at_start:
                migrate(s.db_url)
            check_current(s.db_url)
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))  # SQLite opens its -wal and -shm files here
                if s.postgres and not s.development:
                    check_runtime_role(conn)
        secure_sqlite_files(s.db_url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        with self.sessions() as db:
            check_secure(s, tokens_exist=any_admin_token(db))
        self.store = AuditStore(self.engine)
        key_path = s.signing_key_path
        finish_rotation(key_path, self.store, s.origin)  # one a crash interrupted
        if not key_path.exists():
            SigningKey.generate().save(key_path)
            log.info("signing key created", path=str(key_path))
        self.key = SigningKey.load(key_path)  # refuses a file others can read
        self._index_key = index_key = load_or_create_secret(s.index_key_path)
        self._seal = AESGCM(load_or_create_secret(s.seal_key_path))
        self.registry = Registry(s.inference_live_s)
        self.metrics = Metrics(self.db, self.registry, s.origin, s.fleet_deadline_s)
        self.keyring = Keyring(s.kek_path, self.store)
        self.rotate_kek_if_due(wrap_only=True)  # the first KEK; secrets stored before wrapping
        # the writer verifies every record it did not write, here on open and at each catch-up
        try:
            self.log = AuditLog(self.store, s.origin, self.key,
                                LogConfig(checkpoint_every=s.checkpoint_every, checkpoint_interval_ms=s.checkpoint_ms,
                                          sign_process=s.audit_sign_process), on_halt=self._halted)
        except BaseException:  # e.g. a forged record: the sidecar does not start, and holds no connection
            self.engine.dispose()
            raise
        self.metrics.audit_log = self.log
        # a secret an erase record destroyed, put back, is refused on every use (audit.pseudonym)
        self.pseudonyms = Pseudonymizer(self.store, index_key, self.keyring, shredded=self.log.shredded,
                                        on_shredded=self._shredded_secret_refused)
        self.key_lock = threading.Lock()  # one signing-key rotation at a time
        self.ingest = Ingestor(self.log, self.pseudonyms, self.sessions)
        # registered once its log opened: a sidecar refused at start is never counted in the fleet
        self.fleet = Fleet(self.sessions, s.origin, self.key.key_id, heartbeat_s=s.fleet_heartbeat_s,
                           deadline_s=s.fleet_deadline_s)
        self.fleet.register()
        self.witnessing = None
        if not s.witnesses and not s.development:
            log.warning("audit log without a witness", detail=NO_WITNESS)
        if s.witnesses:
            from kvguard.audit.cosignature import Witness

            from .witnessing import Witnessing

            self.witnessing = Witnessing(self.log, [(w.url, Witness.from_vkey(w.vkey)) for w in s.witnesses],
                                         self.metrics, timeout_s=s.witness_timeout_s, refresh_s=s.witness_refresh_s,
                                         retry_max_s=s.witness_retry_max_s)
            self.witnessing.start()
        self.metrics.kek_created_ms = self.store.current_kek_created_ms
        self._socket: tuple[Path, tuple[int, int] | None] | None = None
        log.info("sidecar ready", origin=s.origin, key_id=self.key.key_id, database=self.engine.url.get_backend_name())

    def _halted(self, exc: TamperedLogError) -> None:
        f = exc.failure
        log.critical("audit writer halted: a stored record it did not write fails verification; nothing "
                     "more is signed or acknowledged until the store is repaired and the sidecar restarted",
                     origin=f.origin, seq=f.seq, check=f.check, reason=f.message)

    def _shredded_secret_refused(self, origin: str, seq: int) -> None:
        log.critical("a subject secret that an erase record destroyed was put back in the database; it was "
                     "deleted, not used, and the subject gets a fresh secret: find who wrote to subject_keys",
                     erase_record=f"{origin}#{seq}")

    def check_audit_state(self) -> None:
        """The writer's periodic check of the store it relies on (audit.state); a failure halts it."""
        self.log.check_state()

    def db(self) -> Session:
        return self.sessions()

    # --- key-encryption keys --------------------------------------------------------------------

    def rotate_kek_if_due(self, *, force: bool = False, wrap_only: bool = False) -> str | None:
        """Rotate the key-encryption key when it is older than kek_rotation_s (or `force`):
        one sidecar of a database at a time, the others skip. `wrap_only`: just make sure a
        KEK exists and every secret is wrapped under the current one. Returns the new KEK's id."""
        ring, period = self.keyring, self.settings.kek_rotation_s
        ring.forget_destroyed()
        with self.store.kek_rotation_lock() as mine:
            if wrap_only:
                current = ring.current() if mine else self.store.current_kek()
                if current is not None:
                    ring.key(current)  # a KEK directory that is not the shared one fails the start
                if mine and (wrapped := ring.rewrap(current)):
                    log.info("subject secrets wrapped", kek_id=current, secrets=wrapped)
                return None
            if not mine:
                return None
            if not (force or ring.due(period)):
                return None
            started = time.monotonic()
            new = ring.rotate()
        self.metrics.kek_rotations.inc()
        if ring.unreadable:  # by index prefix (an HMAC, no subject id): restored or altered rows
            log.warning("subject secrets that open under no key-encryption key were left unreadable",
                        count=len(ring.unreadable), first_index=ring.unreadable[0].hex()[:16])
        log.info("key-encryption key rotated", kek_id=new, seconds=round(time.monotonic() - started, 3))
        return new

    @property
    def idempotency_key(self) -> bytes:
        """The key of erasure requests' body digests: the index key, which every sidecar of a
        database shares, so a retry sent to another sidecar is recognized."""
        return self._index_key

    def tenant_index(self, tenant: str) -> str:
        """The tenant's keyed index, as tenant-bound ingest tokens name their tenants."""
        return tenant_index(self._index_key, tenant)

    # --- sealing of pending subject ids ---------------------------------------------------------

    def seal(self, obj: dict) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._seal.encrypt(nonce, json.dumps(obj).encode(), b"kvguard-erasure")

    def unseal(self, blob: bytes) -> dict:
        return json.loads(self._seal.decrypt(blob[:12], blob[12:], b"kvguard-erasure"))

    # --- health ---------------------------------------------------------------------------------

    def socket_bound(self, path: Path, identity: tuple[int, int] | None) -> None:
        """The ingest socket this process listens on: (device, inode) of the file it bound."""
        self._socket = (path, identity)

    def readiness(self) -> dict[str, str]:
        """What /readyz reports; a value other than 'ok' makes it fail."""
        out = {}
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            out["database"] = "ok"
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            out["database"] = f"unreachable: {type(e).__name__}"
        try:
            check_current(self.engine)  # its pool: a probe opens no engine of its own
            out["migrations"] = "ok"
        except Exception as e:  # noqa: BLE001
            out["migrations"] = str(e)[:200]
        out["signing_key"] = "ok" if self.key is not None else "missing"
        try:  # another sidecar rotated to a KEK this one's directory lacks: it could not wrap or unwrap
            current = self.store.current_kek()
            if current is not None:
                self.keyring.key(current)
            out["kek"] = "ok"
        except Exception as e:  # noqa: BLE001
            out["kek"] = str(e)[:200]
        if self.log.halted is None and out["database"] == "ok":
            # what was stored past the writer's tail is verified now, not at the next append
            with contextlib.suppress(Exception):  # a failure halts the writer; anything else: below
                self.log.verify_tail(timeout=READY_VERIFY_S)
        halted = self.log.halted
        out["audit_writer"] = "ok" if halted is None else (
            f"halted: record {halted.failure.record} fails {halted.failure.check}")
        if self._socket is not None:  # another process may have replaced or removed it
            path, identity = self._socket
            try:
                st = path.stat()
                same = identity == (st.st_dev, st.st_ino)
            except OSError:
                same = False
            out["ingest_socket"] = "ok" if same else "not the socket this server bound"
        try:
            missed = self.missed_erasures()
            out["erasures"] = "ok" if not missed else f"carrying out {missed} erasure(s) received while it was away"
        except Exception as e:  # noqa: BLE001
            out["erasures"] = f"unknown: {type(e).__name__}"
        return out

    def witness_status(self) -> dict[str, str]:
        """Each witness's state, shown by /readyz without failing it: an unreachable witness
        delays cosignatures, never signing."""
        return {} if self.witnessing is None else self.witnessing.status()

    def witness_warning(self) -> str | None:
        """Why the log is weaker than it could be, shown by /readyz without failing it."""
        return None if self.settings.witnesses else NO_WITNESS

    def missed_erasures(self) -> int:
        """Open requests received before this start whose processes here have not erased yet:
        a sidecar that comes back carries them out before it reports ready."""
        with self.db() as db:
            return db.scalar(select(func.count()).select_from(ErasurePart).join(
                ErasureRequest, ErasureRequest.id == ErasurePart.request_id).where(
                ErasurePart.origin == self.settings.origin, ErasurePart.state == "pending",
                ErasurePart.created_ms < self.fleet.started_ms,
                ErasureRequest.state.in_(("received", "executing")))) or 0

    def close(self) -> None:
        if self.witnessing is not None:
            self.witnessing.close()
        self.fleet.close()
        try:
            self.fleet.leave()
        except Exception as e:  # noqa: BLE001 - the database is away: it counts as down, not as left
            log.warning("could not leave the fleet", error=type(e).__name__)
        self.log.close()
        self.engine.dispose()
