"""The quality bars on a real model and real text (docs/fidelity.md has the full-size
run): INT8 with a 16-bit recent window under 0.5 % attention deviation and 0.05
perplexity change, plain INT8 within the 1 % gate, INT4 KIVI-style under 0.5
perplexity change."""

from __future__ import annotations

import pytest

from kvguard.eval.evaluate import evaluate
from kvguard.eval.methods import builtin_methods
from kvguard.eval.settings import Settings
from kvguard.eval.texts import stdlib_code

pytestmark = pytest.mark.xdist_group("eval-goals")  # its module fixture runs once, on one worker

@pytest.fixture(scope="module")
def rows(smollm2):
    model, tok = smollm2
    m = builtin_methods()
    chosen = [m[n] for n in ("none", "int8", "int8-window", "int4", "int8-rot", "int4-rot")]
    s = Settings(prefix=256, score=256, generate=2)
    return evaluate(model, tok, {"stdlib-code": stdlib_code()[20_000:]}, chosen, s, progress=False).by_method()


def test_int8_with_a_16bit_window(rows):
    got = rows["int8-window"]
    assert got.mean_layer_deviation < 0.005, f"int8 attention deviation {got.mean_layer_deviation:.3%}"
    assert abs(got.ppl_delta) < 0.05, f"int8 perplexity change {got.ppl_delta:+.4f}"


def test_int8_passes_the_gate(rows):
    got = rows["int8"]
    assert got.mean_layer_deviation < 0.01 and abs(got.ppl_delta) < 0.05 and got.held_ratio < 0.6
    assert got.mean_layer_deviation > rows["int8-window"].mean_layer_deviation  # the recent window is what INT8 loses most on


def test_int4_kivi_perplexity(rows):
    got = rows["int4"]
    assert got.ppl_delta < 0.5 and got.held_ratio < rows["int8"].held_ratio


def test_rotation_cuts_the_deviation(rows):
    # the Hadamard rotation (kvguard/compress/codecs/rotation.py) on the model's own K/V: the same
    # codes, pages and bytes, less error
    for name in ("int8", "int4"):
        plain, rot = rows[name], rows[f"{name}-rot"]
        assert rot.held_ratio == plain.held_ratio
        assert rot.mean_layer_deviation < 0.9 * plain.mean_layer_deviation, (name, rot, plain)
        assert rot.worst_layer_deviation < plain.worst_layer_deviation, (name, rot, plain)
