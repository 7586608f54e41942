"""kvguard: a compliance-audited KV-cache manager for LLM inference.

The data path, by folder:

    write → encode → page         kvguard/cache (manager, pool), kvguard/compress/codecs
    evict / offload               kvguard/compress/evictors, kvguard/cache/tiers.py
    event                         kvguard/cache/events.py (frozen events in a queue)
    record → sign → store         kvguard/sidecar (drains events), audit/ (records, signing, SQL)
    bundle                        audit/bundle

Importing this package imports nothing heavy: the auditor's CLI runs without torch.
"""

__version__ = "0.1.0"

from . import _checkout  # noqa: E402  (Hugging Face's `kernels` before the checkout's folder of that name)

_checkout.install()
