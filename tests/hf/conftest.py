"""SmolLM2-135M (float32 on the CPU, loaded once per process) and real text: the
standard library's own sources. A deprecation warning of transformers (a keyword it renamed,
such as `past_key_values` for `cache`) fails every test here."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from kvguard.hf import cache_kwarg, load_smollm2

HERE = Path(__file__).resolve().parent
# transformers warns of a deprecated keyword with a FutureWarning ("`x` is deprecated ...")
DEPRECATED = pytest.mark.filterwarnings("error:.*is deprecated:FutureWarning")


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(DEPRECATED)


def kv(model, cache) -> dict:
    """The keyword arguments that hand `cache` to the model's forward or generate."""
    return {cache_kwarg(model): cache}


@pytest.fixture(scope="session")
def smollm2():
    return load_smollm2()


@pytest.fixture(scope="session")
def model(smollm2):
    return smollm2[0]


@pytest.fixture(scope="session")
def tok(smollm2):
    return smollm2[1]


def stdlib_text(*modules: str) -> str:
    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)


@pytest.fixture(scope="session")
def code_ids(tok) -> torch.Tensor:
    """[1, 400] token ids of real Python source."""
    return tok(stdlib_text("json.decoder", "textwrap"), return_tensors="pt").input_ids[:, :400]


@contextlib.contextmanager
def attn(model, name: str):
    """Run with another attention implementation, then switch back to kvguard."""
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation("kvguard")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: these tests run many small tensor operations, which more threads
    slow down several times over on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
