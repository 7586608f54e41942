"""Canonical JSON (RFC 8785, JCS): the bytes that get signed and hashed.

Two encoders give the same bytes on the value subset a record may hold:

* `canonical(obj)` is the `rfc8785` package, for any JSON value (bundle manifests).
* `record_bytes(obj)` is the standard library's encoder with sorted keys and no
  whitespace. On the record subset (ASCII object keys, integers within
  +-(2**53 - 1), no floats, strings of Unicode scalar values) RFC 8785 reduces
  to exactly that: keys sorted by code unit, integers in decimal, strings with
  only `"`, `\\` and U+0000..U+001F escaped (\\b \\t \\n \\f \\r or \\u00xx).
  It is ~4x faster than the general encoder, which keeps signing and
  verification near the raw Ed25519 rates. A property test checks the two
  agree on generated records. Callers must validate first (`audit.record`).
"""

from __future__ import annotations

import json
from typing import Any

import rfc8785

from .errors import RecordFormatError

# Largest integer an IEEE-754 double (and so every RFC 8785 implementation) holds exactly.
MAX_SAFE_INTEGER = 2**53 - 1

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical(obj: Any) -> bytes:
    """RFC 8785 bytes of any JSON value."""
    try:
        return rfc8785.dumps(obj)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"not canonicalizable as JSON: {exc}") from exc


def record_bytes(obj: dict[str, Any]) -> bytes:
    """RFC 8785 bytes of a validated record-subset object (see module docstring)."""
    try:
        return _ENCODER.encode(obj).encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate slipped past validation
        raise RecordFormatError("strings must be valid Unicode (no lone surrogates)") from exc


def subject_bytes(subject: dict[str, str]) -> bytes:
    """RFC 8785 bytes of a validated subject (`audit.fields.check_subject`): its keys are
    among tenant/user/session and its values 32 lowercase hex digits, so nothing needs
    escaping and the bytes are the sorted members spliced together (tested against
    `canonical`)."""
    return b"{%b}" % b",".join([b'"%b":"%b"' % (k.encode(), subject[k].encode()) for k in sorted(subject)])


def loads(data: bytes | str) -> Any:
    """Parse JSON, refusing NaN/Infinity (not JSON) so they never reach a canonical check, and
    nesting too deep for the parser with ValueError too, as every other malformed input."""

    def _refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(data, parse_constant=_refuse)
    except RecursionError:
        raise ValueError("nested too deeply") from None
