"""DSSE envelopes (github.com/secure-systems-lab/dsse, protocol v1) around in-toto Statements.

    PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body

LEN is the decimal byte length; the signature is Ed25519 over PAE(payloadType,
payload); keyid is our record key id (a hint only: verification tries the
keys it is given, never trusts the hint).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ..canonical import canonical, loads
from ..errors import VerificationError
from ..keys import PublicKey, SigningKey
from .layout import MANIFEST, PAYLOAD_TYPE


def pae(payload_type: str, body: bytes) -> bytes:
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def sign_envelope(statement: dict[str, Any], key: SigningKey) -> bytes:
    """The envelope's JSON bytes; the payload is the statement's RFC 8785 bytes."""
    body = canonical(statement)
    envelope = {
        "payload": base64.b64encode(body).decode("ascii"),
        "payloadType": PAYLOAD_TYPE,
        "signatures": [{"keyid": key.key_id,
                        "sig": base64.b64encode(key.sign(pae(PAYLOAD_TYPE, body))).decode("ascii")}],
    }
    return canonical(envelope) + b"\n"


def open_envelope(data: bytes, keys: list[PublicKey], who: str = "a trusted key"
                  ) -> tuple[dict[str, Any], PublicKey]:
    """Verify the envelope against `keys` (`who` names them in the failure); return the
    statement and the key that signed."""
    def fail(check: str, message: str) -> VerificationError:
        return VerificationError(check, message, member=MANIFEST)

    try:
        envelope = loads(data)
        body = _b64(envelope["payload"])
        payload_type = envelope["payloadType"]
        sigs = [_b64(s["sig"]) for s in envelope["signatures"]]
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise fail("envelope", f"not a DSSE envelope: {exc}") from None
    if not isinstance(payload_type, str):
        raise fail("envelope", "payloadType is not a string")
    message = pae(payload_type, body)
    signer = None
    for sig in sigs:
        for key in keys:
            try:
                key.verify(sig, message)
            except VerificationError:
                continue
            signer = key
            break
        if signer:
            break
    if signer is None:
        raise fail("envelope_signature", f"no signature by {who} verifies")
    if payload_type != PAYLOAD_TYPE:  # after the signature, as DSSE orders it
        raise fail("envelope", f"payloadType {payload_type!r} is not {PAYLOAD_TYPE!r}")
    try:
        statement = loads(body)
    except ValueError as exc:
        raise fail("statement", f"payload is not JSON: {exc}") from None
    if not isinstance(statement, dict):
        raise fail("statement", "payload is not a JSON object")
    return statement, signer


def _b64(text: str) -> bytes:
    """DSSE allows standard or URL-safe base64; accept both, with or without padding."""
    if not isinstance(text, str):
        raise ValueError("base64 field is not a string")
    text = text.replace("-", "+").replace("_", "/")
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
