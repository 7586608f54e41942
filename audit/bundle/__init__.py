"""Sealed audit bundles: one zip file with a log range, its proofs and a signed manifest.

`export_bundle` (audit.bundle.export) needs the store extra; `verify_bundle`
(audit.bundle.verify) needs only cryptography and rfc8785. The layout is in
audit.bundle.layout and docs/audit-format.md, "Bundles".
"""

from .layout import MEMBERS, PREDICATE_TYPE

__all__ = ["MEMBERS", "PREDICATE_TYPE"]
