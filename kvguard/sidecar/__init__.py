"""The sidecar daemon (`kvguard serve`): signing key, audit store, admin API, erasure.

event (from the inference process, kvguard.client) → ingest (pseudonymize)
→ record → sign → store (audit.log) ; erasure requests → commands to every
connected inference process → signed erase record → receipt.
"""
