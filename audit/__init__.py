"""kvguard's audit log: signed records, an RFC 9162 Merkle log, checkpoints, bundles.

Data path: record (audit.record) -> sign (audit.keys) -> store and tree
(audit.store, audit.tree) -> checkpoint (audit.checkpoint) -> bundle
(audit.bundle) -> verification (audit.verify, audit.bundle.verify).

Imports neither torch nor kvguard. The offline verifier needs only
`cryptography` and `rfc8785`: SQLAlchemy and Alembic are imported only by
audit.engine, audit.models, audit.store, audit.cosigstore, audit.log and
audit.bundle.export, so
keep this module and the verification path free of such imports.
"""

from .errors import (
    AuditError,
    BundleError,
    ChainConflictError,
    KeyFileError,
    ReceiptError,
    RecordFormatError,
    StoreError,
    TamperedLogError,
    VerificationError,
)

__all__ = [
    "AuditError",
    "BundleError",
    "ChainConflictError",
    "KeyFileError",
    "ReceiptError",
    "RecordFormatError",
    "StoreError",
    "TamperedLogError",
    "VerificationError",
]
