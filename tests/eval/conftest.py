"""SmolLM2-135M on the CPU (loaded once per process) for the harness tests."""

from __future__ import annotations

import pytest
import torch

from kvguard.hf import load_smollm2


@pytest.fixture(scope="session")
def smollm2():
    return load_smollm2()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: these tests run many small tensor operations, which more threads
    slow down several times over on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
