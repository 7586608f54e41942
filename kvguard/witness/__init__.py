"""`kvguard witness`: a C2SP tlog-witness that cosigns kvguard checkpoints.

A separate service with its own Ed25519 key and its own storage. For each log it
is configured with (origin and the log's public keys), it keeps the latest
checkpoint it cosigned and cosigns a new one only if a consistency proof links it
to that one (https://c2sp.org/tlog-witness). A log that was rolled back, or that
shows two histories, cannot get both cosigned.
"""
