"""A real inference process for the sidecar tests: a kvguard cache with two users
decoding, connected to the sidecar through `SidecarClient`.

It prints one JSON line per milestone on stdout, and reads commands on stdin:
`decode N [NAME]` (N more decode steps for every open sequence, or only NAME's), `report` (what is
held, digests of bob's outputs, tier contents), `quit`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import redis
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.cache.tiers import DiskTier, RedisTier
from kvguard.client import SidecarClient
from kvguard.errors import UnknownSequence
from kvguard.types import Subject

LAYERS, HEADS, QHEADS, DIM = 2, 2, 4, 64


def inputs(name: str, n: int):
    g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    k = torch.randn(LAYERS, n, HEADS, DIM, generator=g).half()
    v = torch.randn(LAYERS, n, HEADS, DIM, generator=g).half()
    q = torch.randn(LAYERS, n, QHEADS, DIM, generator=g).half()
    return k, v, q


class Runner:
    def __init__(self, cache: CacheManager, client: SidecarClient | None):
        self.cache, self.client = cache, client
        self.seqs: dict[str, tuple] = {}
        self.pos: dict[str, int] = {}
        self.digest: dict[str, hashlib._Hash] = {}

    def open(self, name: str, subject: Subject, prompt: int, total: int = 400):
        seq = self.client.open(subject) if self.client else self.cache.open(subject)
        self.seqs[name] = (seq, inputs(name, total))
        self.pos[name] = 0
        self.digest[name] = hashlib.sha256()
        self.step(name, prompt)

    def step(self, name: str, t: int = 1):
        seq, (k, v, q) = self.seqs[name]
        lo, hi = self.pos[name], self.pos[name] + t
        for layer in range(LAYERS):
            assert self.cache.append(seq, layer, k[layer, lo:hi], v[layer, lo:hi])
            out = self.cache.attend(seq, layer, q[layer, lo:hi])
            self.digest[name].update(out.numpy().tobytes())
        self.pos[name] = hi

    def decode(self, n: int, only: str | None = None):
        for _ in range(n):
            for name, (seq, _) in list(self.seqs.items()):
                if (only is None or name == only) and seq in self.cache.sequences():
                    try:
                        self.step(name)
                    except UnknownSequence:  # erased between the check and the step
                        pass


def make_cache(tmp: Path, redis_prefix: str):
    tiers = {"disk": DiskTier(tmp / "disk"),
             "redis": RedisTier(redis.Redis(host="127.0.0.1", port=6379), prefix=redis_prefix)}
    cfg = CacheConfig(num_layers=LAYERS, num_kv_heads=HEADS, num_query_heads=QHEADS, head_dim=DIM,
                      num_pages=256, codec="int8", fp_sink=4)
    return CacheManager(cfg, tiers=tiers)


def main() -> None:
    socket, token, tmp, redis_prefix = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    cache = make_cache(tmp, redis_prefix)
    client = SidecarClient(cache, socket=socket, token=token, client_id="test-proc").start()
    r = Runner(cache, client)
    r.open("alice-1", Subject("acme", "alice-raw-id-7f3a", "alice-session-1"), 64)
    r.open("alice-2", Subject("acme", "alice-raw-id-7f3a", "alice-session-2"), 40)
    r.open("bob", Subject("acme", "bob-raw-id-22c1", "bob-session-1"), 64)
    alice_pages = {(p.where, int(p.page)) for n in ("alice-1", "alice-2")
                   for p in cache._seq(r.seqs[n][0]).pages if p.where in cache.pools}
    print(json.dumps({"ready": True, "flushed": client.flush(20)}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "decode":
            r.decode(int(cmd[1]), cmd[2] if len(cmd) > 2 else None)
            print(json.dumps({"decoded": int(cmd[1])}), flush=True)
        elif cmd[0] == "offload":  # alice's oldest pages to disk and Redis (the next attend fetches them)
            cache.offload(r.seqs["alice-1"][0], "disk", max_pages=2)
            cache.offload(r.seqs["alice-2"][0], "redis", max_pages=1)
            print(json.dumps({"offloaded": {"disk": len(cache.tiers["disk"].keys()),
                                            "redis": len(cache.tiers["redis"].keys())}}), flush=True)
        elif cmd[0] == "report":
            client.flush(20)
            residue = sum(int(t[p].view(torch.uint8).count_nonzero()) for where, p in alice_pages
                          if cache.pools[where].ref[p] == 0
                          for layer in cache.pools[where].fields for t in layer.values())
            print(json.dumps({
                "open": sorted(n for n, (s, _) in r.seqs.items() if s in cache.sequences()),
                "bob_digest": r.digest["bob"].hexdigest(), "bob_pos": r.pos["bob"],
                "alice_residue_bytes": residue,
                "disk_pages": cache.tiers["disk"].keys(), "redis_pages": cache.tiers["redis"].keys(),
                "erasures": client.erasures, "pending": client.pending,
            }), flush=True)
        elif cmd[0] == "quit":
            break
    client.close()


if __name__ == "__main__":
    main()
