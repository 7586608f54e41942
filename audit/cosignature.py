"""Witness cosignatures on checkpoints: C2SP tlog-cosignature, Ed25519 `cosignature/v1`.

    signed message  = "cosignature/v1\\n" "time <T>\\n" <checkpoint note text>
    signature line  = "— <witness name> " base64(key id (4) || u64 big-endian T || Ed25519 signature (64))
    key id          = SHA-256(<witness name> || "\\n" || 0x04 || 32-byte public key)[:4]
    verifier key    = <witness name>+<hex key id>+base64(0x04 || 32-byte public key)   (a C2SP vkey)

T is the cosigning time in POSIX seconds. A cosignature states that, as of T, the
checkpoint is the largest tree the witness has seen for the origin and that it is
consistent with every smaller one the witness saw before (https://c2sp.org/tlog-cosignature).
A cosignature line is one more signature line of the checkpoint's signed note, so a
cosigned checkpoint is the log's note with the witnesses' lines appended.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .checkpoint import EM_DASH, Checkpoint, split_note
from .errors import KeyFileError, VerificationError
from .keys import PublicKey, SigningKey

COSIGNATURE_ALG = b"\x04"  # the signed-note signature type of an Ed25519 cosignature/v1
HEADER = "cosignature/v1\n"
MAX_TIMESTAMP = 2**63 - 1
_SIG_BYTES = 4 + 8 + 64


def cosigned_message(note_text: str, timestamp: int) -> bytes:
    """The bytes a witness signs: header line, time line, the checkpoint's note text."""
    if not 0 <= timestamp <= MAX_TIMESTAMP:
        raise ValueError(f"cosignature timestamp {timestamp} is outside 0..2^63-1")
    return f"{HEADER}time {timestamp}\n{note_text}".encode()


@dataclass(frozen=True, slots=True)
class Witness:
    """A witness a verifier or a log trusts: its name (the key name of its signature lines)
    and its Ed25519 public key."""

    name: str
    key: PublicKey

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() or c == "+" for c in self.name):
            raise KeyFileError(f"witness name {self.name!r} must be non-empty, without spaces or '+'")

    @property
    def key_id(self) -> bytes:
        return hashlib.sha256(self.name.encode() + b"\n" + COSIGNATURE_ALG + self.key.raw).digest()[:4]

    def vkey(self) -> str:
        return f"{self.name}+{self.key_id.hex()}+{base64.b64encode(COSIGNATURE_ALG + self.key.raw).decode()}"

    @classmethod
    def from_vkey(cls, text: str) -> Witness:
        """Parse `<name>+<hex key id>+<base64(0x04 || key)>`, checking the key id."""
        parts = text.strip().split("+", 2)  # the name has no '+'; base64 may
        if len(parts) != 3:
            raise KeyFileError("a witness key is <name>+<key id hex>+<base64 key> (kvguard witness keygen "
                               "prints it)")
        name, key_id, blob = parts
        try:
            raw = base64.b64decode(blob, validate=True)
        except binascii.Error:
            raise KeyFileError("the witness key's last part is not base64") from None
        if len(raw) != 33 or raw[:1] != COSIGNATURE_ALG:
            raise KeyFileError("the witness key is not an Ed25519 cosignature/v1 key (type 0x04, 32 bytes)")
        witness = cls(name, PublicKey.from_raw(raw[1:]))
        if witness.key_id.hex() != key_id.lower():
            raise KeyFileError(f"the witness key's id {key_id} does not match its name and key")
        return witness

    @classmethod
    def load(cls, text_or_path: str) -> Witness:
        """A vkey given on the command line, or a file holding one."""
        try:
            return cls.from_vkey(text_or_path)
        except KeyFileError:
            pass  # a file name, then
        try:
            with open(text_or_path, encoding="utf-8") as fh:
                text = fh.read(4096)
        except OSError as exc:
            raise KeyFileError(f"{text_or_path} is neither a witness key nor a readable file: "
                               f"{exc.strerror}") from None
        return cls.from_vkey(text)


def cosign(key: SigningKey, name: str, note_text: str, timestamp: int) -> str:
    """The cosignature line (with its newline) of witness `name` on a checkpoint's note text."""
    Checkpoint.parse_text(note_text)  # a witness signs checkpoints only
    key_id = Witness(name, key.public_key).key_id
    sig = key.sign(cosigned_message(note_text, timestamp))
    return f"{EM_DASH} {name} {base64.b64encode(key_id + struct.pack('>Q', timestamp) + sig).decode()}\n"


@dataclass(frozen=True, slots=True)
class Cosigned:
    witness: Witness
    timestamp: int
    line: str


def cosignatures(note: str, witnesses: Iterable[Witness]) -> list[Cosigned]:
    """The valid cosignatures on a signed checkpoint by the given witnesses, one per witness.
    Lines of other names or key ids are ignored (as signed-note requires); a line that names a
    given witness and its key id but does not verify is an error, naming the witness."""
    text, sigs = split_note(note)
    cp = Checkpoint.parse_text(text)
    by_id = {(w.name, w.key_id): w for w in witnesses}
    found: dict[Witness, Cosigned] = {}
    for sig in sigs:
        witness = by_id.get((sig.name, sig.key_id))
        if witness is None:
            continue
        if len(sig.signature) != _SIG_BYTES - 4:
            raise VerificationError("cosignature", f"cosignature by witness {witness.name} on checkpoint "
                                    f"{cp.origin}@{cp.size} is not a timestamped Ed25519 signature")
        (timestamp,) = struct.unpack(">Q", sig.signature[:8])
        try:
            if timestamp > MAX_TIMESTAMP:
                raise VerificationError("cosignature", "timestamp beyond 2^63-1")
            witness.key.verify(sig.signature[8:], cosigned_message(text, timestamp))
        except VerificationError:
            raise VerificationError("cosignature", f"cosignature by witness {witness.name} on checkpoint "
                                    f"{cp.origin}@{cp.size} does not verify") from None
        line = f"{EM_DASH} {sig.name} {base64.b64encode(sig.key_id + sig.signature).decode()}\n"
        previous = found.get(witness)
        if previous is None or timestamp > previous.timestamp:
            found[witness] = Cosigned(witness, timestamp, line)
    return list(found.values())


def require_cosignatures(note: str, witnesses: list[Witness], count: int, *,
                         not_before_s: int | None = None, not_after_s: int | None = None) -> list[Cosigned]:
    """At least `count` distinct trusted witnesses cosigned the checkpoint, each (if bounds are
    given) at a time within [not_before_s, not_after_s]; raises VerificationError otherwise."""
    text, _ = split_note(note)
    cp = Checkpoint.parse_text(text)
    valid = cosignatures(note, witnesses)
    fresh = [c for c in valid if (not_before_s is None or c.timestamp >= not_before_s)
             and (not_after_s is None or c.timestamp <= not_after_s)]
    if len(fresh) < count:
        stale = len(valid) - len(fresh)
        why = f" ({stale} more, but cosigned outside the accepted time window: the log may have been " \
              "rolled back, or its witnesses not reached since)" if stale else ""
        raise VerificationError("witness", f"checkpoint {cp.origin}@{cp.size} has {len(fresh)} valid "
                                f"cosignature(s) by the {len(witnesses)} trusted witness(es), {count} "
                                f"required{why}", origin=cp.origin)
    return fresh


def with_cosignatures(note: str, lines: Iterable[str]) -> str:
    """The note with cosignature lines appended (each once, and only lines not already in it)."""
    out = note
    for line in lines:
        if line not in out.split("\n\n", 1)[-1]:
            out += line if line.endswith("\n") else line + "\n"
    return out
