"""The quality bar for INT8 on a real model and real text: attention deviation under
0.5 % and perplexity change under 0.05 (docs/fidelity.md has the full-size run)."""

from __future__ import annotations

from kvguard.eval.evaluate import evaluate
from kvguard.eval.methods import builtin_methods
from kvguard.eval.settings import Settings
from kvguard.eval.texts import stdlib_code


def test_int8_deviation_and_perplexity(smollm2):
    model, tok = smollm2
    s = Settings(prefix=256, score=192, generate=2)
    m = builtin_methods()
    got = evaluate(model, tok, {"stdlib-code": stdlib_code()[20_000:]}, [m["none"], m["int8"]], s,
                   progress=False).by_method()["int8"]
    assert got.deviation < 0.005, f"int8 attention deviation {got.deviation:.3%}"
    assert abs(got.ppl_delta) < 0.05, f"int8 perplexity change {got.ppl_delta:+.4f}"
    assert got.held_ratio < 0.65
