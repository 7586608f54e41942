"""SmolLM2-135M on the CPU (loaded once per process) for the harness tests."""

from __future__ import annotations

import pytest

from kvguard.hf import load_smollm2


@pytest.fixture(scope="session")
def smollm2():
    return load_smollm2()
