"""Checkpoints: C2SP tlog-checkpoint text in a C2SP signed note, signed with Ed25519.

    <origin>\\n<tree size>\\n<base64 root>\\n[<extension line>\\n...]
    \\n
    — <origin> base64(note key id (4 bytes) || Ed25519 signature over the text)\\n

Specs: https://c2sp.org/tlog-checkpoint and https://c2sp.org/signed-note. The
key name is the log origin; the note key id is `PublicKey.note_key_id(origin)`.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import VerificationError
from .keys import PublicKey, SigningKey

EM_DASH = "\u2014"
_SIZE = re.compile(r"0|[1-9][0-9]{0,19}")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def text(self) -> str:
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode("ascii"), *self.extensions]
        return "".join(line + "\n" for line in lines)

    def sign(self, key: SigningKey) -> str:
        """The signed note: text, blank line, one signature line by `key` under the origin."""
        text = self.text()
        sig = key.public_key.note_key_id(self.origin) + key.sign(text.encode("utf-8"))
        return f"{text}\n{EM_DASH} {self.origin} {base64.b64encode(sig).decode('ascii')}\n"

    @classmethod
    def parse_text(cls, text: str) -> Checkpoint:
        def bad(why: str) -> VerificationError:
            return VerificationError("checkpoint_format", why)

        if not text.endswith("\n"):
            raise bad("checkpoint text must end with a newline")
        lines = text[:-1].split("\n")
        if len(lines) < 3 or any(not line for line in lines):
            raise bad("checkpoint text needs origin, size and root hash lines, none empty")
        origin, size, root, *ext = lines
        if not _SIZE.fullmatch(size):
            raise bad(f"tree size {size!r} is not a decimal without leading zeros")
        try:
            root_bytes = base64.b64decode(root, validate=True)
        except binascii.Error:
            raise bad("root hash is not base64") from None
        if len(root_bytes) != 32 or base64.b64encode(root_bytes).decode() != root:
            raise bad("root hash is not the canonical base64 of 32 bytes")
        return cls(origin, int(size), root_bytes, tuple(ext))


@dataclass(frozen=True, slots=True)
class NoteSignature:
    name: str
    key_id: bytes
    signature: bytes


def split_note(note: str) -> tuple[str, list[NoteSignature]]:
    """Text and signature lines of a signed note; raises on any malformed byte."""
    def bad(why: str) -> VerificationError:
        return VerificationError("checkpoint_format", why)

    if any(ord(c) < 0x20 and c != "\n" for c in note):
        raise bad("signed notes must not contain control characters other than newline")
    cut = note.rfind("\n\n")
    if cut < 0 or not note.endswith("\n"):
        raise bad("no blank line between the note text and its signatures")
    text, sig_block = note[: cut + 1], note[cut + 2 :]
    sigs = []
    for line in sig_block[:-1].split("\n"):
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != EM_DASH or not parts[1]:
            raise bad(f"malformed signature line {line!r}")
        try:
            blob = base64.b64decode(parts[2], validate=True)
        except binascii.Error:
            raise bad("signature is not base64") from None
        if len(blob) < 5:
            raise bad("signature is shorter than a key id")
        sigs.append(NoteSignature(parts[1], blob[:4], blob[4:]))
    return text, sigs


def open_checkpoint(note: str, keys: PublicKey | Iterable[PublicKey],
                    origin: str | None = None) -> Checkpoint:
    """Verify a signed checkpoint and return it. A signature counts when its name is the
    checkpoint origin and its key id is one of `keys`' note key ids; signatures by other
    keys are ignored (as the signed-note spec requires), but one known key must verify
    and none may fail."""
    keys = [keys] if isinstance(keys, PublicKey) else list(keys)
    text, sigs = split_note(note)
    cp = Checkpoint.parse_text(text)
    if origin is not None and cp.origin != origin:
        raise VerificationError("checkpoint_format", f"checkpoint is for log {cp.origin!r}, not {origin!r}")
    known = {k.note_key_id(cp.origin): k for k in keys}
    verified = 0
    for sig in sigs:
        key = known.get(sig.key_id) if sig.name == cp.origin else None
        if key is None:
            continue
        try:
            key.verify(sig.signature, text.encode("utf-8"))
        except VerificationError:
            raise VerificationError(
                "checkpoint_signature", f"signature on checkpoint {cp.origin}@{cp.size} does not verify"
            ) from None
        verified += 1
    if not verified:
        raise VerificationError(
            "checkpoint_signature", f"checkpoint {cp.origin}@{cp.size} is not signed by the expected key"
        )
    return cp
