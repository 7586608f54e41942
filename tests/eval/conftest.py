"""SmolLM2-135M on the CPU (loaded once per process) for the harness tests."""

from __future__ import annotations

from tests.hf.conftest import one_thread, smollm2  # noqa: F401  (the same fixtures as the hf tests)
