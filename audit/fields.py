"""Validation of every record field, so nothing that looks like raw content is signed.

The rule for `details` (docs/audit-format.md, "details"):

* a JSON object; object keys match `[a-z][a-z0-9_]{0,63}` at every depth;
* no key is a name that carries content or a raw subject id (`FORBIDDEN_KEYS`),
  starts with `raw_`, or ends in one of `FORBIDDEN_SUFFIXES`;
* values are null, booleans, integers within +-(2**53 - 1), strings of at most
  256 Unicode scalar values, arrays of at most 4096 items, or objects; nesting
  at most 4 deep. Floats are refused: integers (bytes, counts, parts per
  million) encode the same way in every JSON implementation.

Subjects carry pseudonyms only (32 lowercase hex digits, `audit.pseudonym`).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from . import ops
from .canonical import MAX_SAFE_INTEGER
from .errors import RecordFormatError

FORMAT_VERSION = 1
ZERO_HASH = "0" * 64
SUBJECT_KINDS = ("tenant", "user", "session")
# The operations kvguard writes (audit.ops); a record read may name any `[a-z_]{1,32}`.
KNOWN_OPS = ops.OPS
FORBIDDEN_KEYS = frozenset(
    {
        "prompt", "prompts", "text", "texts", "content", "contents", "completion", "completions",
        "message", "messages", "token", "tokens", "token_ids", "input_ids", "output_ids",
        "input_text", "output_text", "kv", "kv_values", "keys_data", "values_data",
        "user", "session", "tenant", "user_id", "session_id", "tenant_id", "username", "user_name",
        "email", "ip", "ip_address", "phone",
    }
)
FORBIDDEN_SUFFIXES = ("_text", "_prompt", "_token_ids", "_content", "_user_id", "_session_id", "_tenant_id")
MAX_STRING = 256
MAX_ARRAY = 4096
MAX_DEPTH = 4

_OP = re.compile(r"[a-z_]{1,32}")
_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PSEUDONYM = re.compile(r"[0-9a-f]{32}")
# A C2SP note key name too (the checkpoint is signed under the origin): no spaces, no '+'.
_ORIGIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~:/-]{0,254}")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z")
_SIG = re.compile(r"[A-Za-z0-9+/]{86}==")


def check_origin(origin: Any) -> str:
    if not isinstance(origin, str) or not _ORIGIN.fullmatch(origin):
        raise RecordFormatError(
            f"origin {origin!r} must be 1-255 characters of [A-Za-z0-9._~:/-] (e.g. 'kvguard.example/pod-1')"
        )
    return origin


def check_op(op: Any) -> str:
    if not isinstance(op, str) or not _OP.fullmatch(op):
        raise RecordFormatError(f"op {op!r} must match [a-z_]{{1,32}}")
    return op


def check_known_op(op: Any) -> str:
    """An op kvguard may write: one of the registry's (audit.ops), which a new one joins first."""
    if check_op(op) not in KNOWN_OPS:
        raise RecordFormatError(f"op {op!r} is not one of kvguard's operations {sorted(KNOWN_OPS)}; "
                                "register a new one in kvguard.audit.ops")
    return op


def check_hex64(value: Any, field: str) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise RecordFormatError(f"{field} must be 64 lowercase hex digits, got {value!r}")
    return value


def check_seq(value: Any, field: str = "seq") -> int:
    if type(value) is not int or not 0 <= value <= MAX_SAFE_INTEGER:
        raise RecordFormatError(f"{field} must be an integer in [0, 2**53 - 1], got {value!r}")
    return value


def check_sig(value: Any) -> str:
    if not isinstance(value, str) or not _SIG.fullmatch(value):
        raise RecordFormatError("sig must be the standard base64 (with padding) of a 64-byte signature")
    return value


def check_subject(subject: Any) -> dict[str, str]:
    if subject is None:
        return {}
    if not isinstance(subject, dict):
        raise RecordFormatError("subject must be an object of pseudonyms")
    for kind, value in subject.items():
        if kind not in SUBJECT_KINDS:
            raise RecordFormatError(f"subject key {kind!r} is not one of {SUBJECT_KINDS}")
        if not isinstance(value, str) or not _PSEUDONYM.fullmatch(value):
            raise RecordFormatError(
                f"subject.{kind} must be a 32-hex-digit pseudonym (audit.pseudonym), never a raw id"
            )
    return dict(subject)


def check_details(details: Any) -> dict[str, Any]:
    if details is None:
        return {}
    if not isinstance(details, dict):
        raise RecordFormatError("details must be a JSON object")
    if not _valid(details, 1):  # the fast check says no: walk again, naming the offending path
        _check_value(details, "details", 1)
    return details


def _valid(value: Any, depth: int) -> bool:
    """The rule of `_check_value` without building paths for messages: every record passes
    through here on the caller's thread, so it must cost far less than signing. False sends
    the value through `_check_value`, which raises (or admits a key not seen before)."""
    kind = type(value)
    if kind is str:
        return len(value) <= MAX_STRING and (value.isascii() or _utf8(value))
    if kind is int:
        return -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER
    if kind is dict:
        if depth > MAX_DEPTH:
            return False
        for key, item in value.items():
            if key not in _GOOD_KEYS or not _valid(item, depth + 1):
                return False
        return True
    if kind is list:
        if len(value) > MAX_ARRAY:
            return False
        for item in value:
            if not _valid(item, depth):
                return False
        return True
    return value is None or kind is bool


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_value(value: Any, path: str, depth: int) -> None:
    if value is None or value is True or value is False:
        return
    kind = type(value)
    if kind is int:
        if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            raise RecordFormatError(f"{path}: integer outside +-(2**53 - 1)")
    elif kind is str:
        if len(value) > MAX_STRING:
            raise RecordFormatError(f"{path}: string longer than {MAX_STRING} (store a digest, not content)")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordFormatError(f"{path}: string is not valid Unicode") from None
    elif kind is list:
        if len(value) > MAX_ARRAY:
            raise RecordFormatError(f"{path}: array longer than {MAX_ARRAY}")
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]", depth)
    elif kind is dict:
        if depth > MAX_DEPTH:
            raise RecordFormatError(f"{path}: nested deeper than {MAX_DEPTH}")
        for key, item in value.items():
            _check_key(key, path)
            _check_value(item, f"{path}.{key}", depth + 1)
    elif kind is float:
        raise RecordFormatError(f"{path}: floats are not allowed; use an integer (bytes, count, ppm)")
    else:
        raise RecordFormatError(f"{path}: {kind.__name__} is not a JSON value")


def _check_key(key: Any, path: str) -> None:
    if key not in _GOOD_KEYS:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise RecordFormatError(f"{path}: key {key!r} must match [a-z][a-z0-9_]{{0,63}}")
        if key in FORBIDDEN_KEYS or key.startswith("raw_") or key.endswith(FORBIDDEN_SUFFIXES):
            raise RecordFormatError(
                f"{path}: key {key!r} names content or a raw subject id; log digests, counts or pseudonyms"
            )
        if len(_GOOD_KEYS) < 4096:  # the same few keys recur in every record
            _GOOD_KEYS.add(key)


_GOOD_KEYS: set[str] = set()


def format_time(ms: int) -> str:
    """RFC 3339 UTC with exactly three fractional digits: 2025-01-31T12:00:00.123Z."""
    dt = datetime.fromtimestamp(ms // 1000, UTC)
    return f"{dt:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


def parse_time(value: Any) -> int:
    """Milliseconds since the Unix epoch of a record time; refuses any other spelling."""
    if not isinstance(value, str):  # before the cache, which cannot hash a list or object
        raise RecordFormatError(f"time must look like 2025-01-31T12:00:00.123Z, got {value!r}")
    return _parse_time(value)


@lru_cache(maxsize=4096)  # a batch of records shares one time; verifiers see each many times
def _parse_time(value: str) -> int:
    if not _TIME.fullmatch(value):
        raise RecordFormatError(f"time must look like 2025-01-31T12:00:00.123Z, got {value!r}")
    try:
        dt = datetime(int(value[0:4]), int(value[5:7]), int(value[8:10]), int(value[11:13]),
                      int(value[14:16]), int(value[17:19]), tzinfo=UTC)
    except ValueError as exc:
        raise RecordFormatError(f"time {value!r}: {exc}") from None
    return int(dt.timestamp()) * 1000 + int(value[20:23])
