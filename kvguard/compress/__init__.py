"""Compression layers: codecs (how a page is encoded) and evictors (which tokens stay)."""
