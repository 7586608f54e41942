"""Values read in place in pinned host memory: the decode kernel over pages whose value fields
live in the host (the K/V split's pool), against the same pages on the device, on CUDA.

A pinned host page is mapped into the device's address space, so the decode kernels read it
over the bus as they read device memory (kernels/_checks.py lets value fields be pinned host
tensors). Prints the results' difference (none expected), each variant's time and the value
bytes it reads per second, and a plain pinned host-to-device copy's rate as the ceiling.

    python benchmarks/kernels/mapped_reads.py
"""

from __future__ import annotations

import time

import torch
from kvguard.kernels.paged_decode import paged_decode


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("mapped_reads needs CUDA")
    dev = torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name())
    b, h, g, d, s, p, used = 4, 8, 4, 128, 16, 4096, 512  # llama-8b's KV heads and head dim, int8 pages
    pages = {"k": torch.randint(-127, 128, (p, h, s, d), dtype=torch.int8, device=dev),
             "k_scale": (torch.rand(p, h, d, device=dev) * 0.02 + 0.01).half(),
             "v": torch.randint(-127, 128, (p, h, d, s), dtype=torch.int8, device=dev),
             "v_scale": (torch.rand(p, h, s, device=dev) * 0.02 + 0.01).half()}
    host = dict(pages, v=pages["v"].cpu().pin_memory(), v_scale=pages["v_scale"].cpu().pin_memory())
    q = torch.randn(b, h * g, d, device=dev, dtype=torch.float16)
    table = torch.stack([torch.randperm(p, device=dev)[:used] for _ in range(b)]).int()  # pages in random order
    lens = torch.full((b,), used * s, device=dev, dtype=torch.int32)
    o1, l1 = paged_decode(q, pages, table, lens)
    o2, l2 = paged_decode(q, host, table, lens)
    torch.cuda.synchronize()
    print(f"values on the device vs in pinned host memory: max|diff| out {(o1 - o2).abs().max().item():.1e}, "
          f"lse {(l1 - l2).abs().max().item():.1e}")
    nbytes = b * used * h * s * (d + 2)
    for name, pg in (("values on the device", pages), ("values in pinned host memory", host)):
        dt = timed(lambda pg=pg: paged_decode(q, pg, table, lens))
        print(f"{name}: {dt * 1e3:.3f} ms, {nbytes / 2**20:.1f} MiB of values, {nbytes / dt / 1e9:.1f} GB/s")
    x = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    y = torch.empty_like(x, device=dev)
    dt = timed(lambda: y.copy_(x, non_blocking=True), 5)
    print(f"pinned host-to-device copy: {x.numel() / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
