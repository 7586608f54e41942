"""The audit package's errors: one base, one subclass per kind of failure.

Callers catch `AuditError` at the edge (the CLI prints it, the API maps it to a
status code); verification failures carry enough to name what failed.
"""

from __future__ import annotations


class AuditError(Exception):
    """Base of every error the audit package raises on purpose."""


class RecordFormatError(AuditError, ValueError):
    """A record, subject or details object does not follow the format (a caller bug)."""


class KeyFileError(AuditError):
    """A key file is missing, unreadable, malformed or has unsafe permissions."""


class StoreError(AuditError):
    """The audit store refused an operation or is not at the expected schema."""


class ChainConflictError(StoreError):
    """Another writer appended to the same log first; reload the tail and retry."""


class ReceiptError(AuditError):
    """An erasure receipt cannot be made (e.g. the record is not an erase record)."""


class BundleError(AuditError):
    """A bundle cannot be written or read as a container (before any verification)."""


class VerificationError(AuditError):
    """Verification failed. Names the check and, where there is one, the record and member.

    `check` is a short stable word (signature, chain, sequence, merkle_root, ...),
    `origin`/`seq` identify the record, `member` the bundle file it came from.
    """

    def __init__(
        self,
        check: str,
        message: str,
        *,
        origin: str | None = None,
        seq: int | None = None,
        member: str | None = None,
    ) -> None:
        self.check = check
        self.message = message
        self.origin = origin
        self.seq = seq
        self.member = member
        super().__init__(str(self))

    @property
    def record(self) -> str | None:
        """`origin#seq`, the way the docs and CLI name a record."""
        if self.seq is None:
            return None
        return f"{self.origin}#{self.seq}"

    def with_member(self, member: str) -> VerificationError:
        """The same failure, attributed to the bundle member it was found in."""
        return VerificationError(self.check, self.message, origin=self.origin, seq=self.seq, member=member)

    def to_dict(self) -> dict[str, object]:
        return {
            "check": self.check,
            "message": self.message,
            "origin": self.origin,
            "seq": self.seq,
            "record": self.record,
            "member": self.member,
        }

    def __str__(self) -> str:
        where = [p for p in (self.member, f"record {self.record}" if self.record else None) if p]
        prefix = ": ".join(where)
        return f"{prefix + ': ' if prefix else ''}{self.check}: {self.message}"

    def __reduce__(self):  # keep pickling (multiprocessing) working with keyword fields
        return (_rebuild, (self.check, self.message, self.origin, self.seq, self.member))


def _rebuild(check, message, origin, seq, member) -> VerificationError:
    return VerificationError(check, message, origin=origin, seq=seq, member=member)


class TamperedLogError(StoreError):
    """A stored record that this writer did not write fails verification (signature, key,
    chain, leaf hash or query columns): the writer stops signing and acknowledges nothing
    until an operator has repaired the store and restarted it. `failure` names the record."""

    def __init__(self, failure: VerificationError) -> None:
        self.failure = failure
        super().__init__(
            f"record {failure.record or failure.origin} fails verification ({failure.check}: "
            f"{failure.message}); the audit writer stopped signing: run `kvguard audit check`, "
            "repair the store (docs/audit-format.md, \"When the writer stops\") and restart")
