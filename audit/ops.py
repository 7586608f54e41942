"""The registry of record operations: every `op` kvguard writes, in one place.

Every layer reads its ops from here: the log refuses to sign any other
(`fields.check_known_op`), the sidecar's ingest accepts the `EVENT_OPS` from an
inference process, the admin API filters records by `OPS`, the cache's events
take their `op` from these names, and receipts hold the `ERASE_OPS`.
docs/audit-format.md lists the same set; a test holds them together.

A verifier still accepts any `[a-z_]{1,32}` (the format's set is open): the
registry binds what kvguard writes, not what it reads. The cache imports this
module alone of kvguard.audit, so it imports nothing at all.
"""

from __future__ import annotations

# What an inference process's cache does, one event each (kvguard.cache.events, kvguard.policy):
OPEN = "open"  # a sequence opened for a subject (a served request began), under a policy
STORE = "store"  # blocks written with a request's K/V by an engine that keeps its own pool (vLLM)
QUANTIZE = "quantize"  # full 16-bit pages re-encoded into a codec
EVICT = "evict"  # one compaction: tokens dropped, pages freed
OFFLOAD = "offload"  # pages moved to a lower tier
FETCH = "fetch"  # pages brought back from a lower tier
FREE = "free"  # a sequence ended and its pages were overwritten
ERASE = "erase"  # a process's erasure of a subject, and the sidecar's signed erasure record
POLICY = "policy"  # a policy calibrated: accepted, downgraded or refused

# What the sidecar and the log write of their own:
KEY_ROTATION = "key_rotation"  # the signing key hands over to the next (docs/audit-format.md §3.2)
INGEST_ERROR = "ingest_error"  # an event that could not be recorded as sent, in its place
# An erasure a retention limit ordered. The sidecar records those as `erase` (legal basis
# pipl-art47); the name stays reserved, and receipts and bundles treat it as an erasure.
RETENTION_ERASE = "retention_erase"

EVENT_OPS = frozenset({OPEN, STORE, QUANTIZE, EVICT, OFFLOAD, FETCH, FREE, ERASE, POLICY})
ERASE_OPS = frozenset({ERASE, RETENTION_ERASE})
OPS = EVENT_OPS | {KEY_ROTATION, INGEST_ERROR, RETENTION_ERASE}
