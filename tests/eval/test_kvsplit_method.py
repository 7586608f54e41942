"""kvsplit@F on SmolLM2-135M: the K/V split through the model, measured by the harness."""

from __future__ import annotations

import pytest

from kvguard.eval.harness import run, token_ids
from kvguard.eval.methods import Method, builtin_methods
from kvguard.eval.settings import Settings
from kvguard.eval.texts import stdlib_code

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
SMALL = Settings(prefix=128, score=48, chunk=16, generate=0)


def split(fraction: float) -> Method:
    return Method(f"kvsplit@{fraction}", "split", {"codec": "fp16", "kv_split": {"window": 32, "fraction": fraction}})


def test_the_builtin_split_methods():
    methods = builtin_methods()
    for pct in (5, 10, 25, 50):
        m = methods[f"kvsplit@{pct}"]
        assert m.kind == "split" and m.options["kv_split"]["fraction"] == pct / 100
        assert m.key == f"fp16+kvsplit@{pct}%/w128"


def test_every_page_fetched_is_the_reference_and_fewer_read_fewer_values(smollm2):
    model, tok = smollm2
    ids = token_ids(tok, stdlib_code(), SMALL.prefix + SMALL.score)
    full = run(model, ids, "stdlib-code", split(1.0), SMALL)
    assert full.deviation == [0.0] * 30 and full.read_ratio == 1.0  # exact: every value was fetched
    part = run(model, ids, "stdlib-code", split(0.25), SMALL)
    assert 0.3 < part.read_ratio < 0.8  # a quarter of the cold pages' values, all of the window's
    assert 0 < part.mean_layer_deviation < 0.5
    assert part.ppl != full.ppl
