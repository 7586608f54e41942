"""The harness end to end on SmolLM2-135M and the standard library's source, at a
small size: its numbers against independent references, its report files."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvguard.eval import report
from kvguard.eval.evaluate import evaluate
from kvguard.eval.harness import run, token_ids
from kvguard.eval.methods import Method, builtin_methods
from kvguard.eval.settings import Settings
from kvguard.eval.texts import stdlib_code
from kvguard.policy import parse_policy

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
SMALL = Settings(prefix=128, score=64, chunk=16, generate=6, budget=32)
POLICY = """
name: tiny
scenario: code
codec: {name: int8, fp_sink: 4}
evictor: {name: h2o, budget: 48, sink: 4, window: 16}
retention: {max_age: 1h}
on_violation: downgrade
downgrade:
  - codec: {name: int8, fp_sink: 4}
"""


@pytest.fixture(scope="module")
def result(smollm2):
    model, tok = smollm2
    methods = builtin_methods(SMALL.budget)
    chosen = [methods[n] for n in ("none", "int8", "streamingllm", "h2o-prefix", "sparse")]
    return evaluate(model, tok, {"stdlib-code": stdlib_code()}, chosen, SMALL, [parse_policy(POLICY)],
                    progress=False)


def test_reference_is_exact_and_its_perplexity_matches_dynamic_cache(smollm2, result):
    model, tok = smollm2
    none = result.by_method()["none"]
    assert none.deviation == 0.0 and none.ppl_delta == 0.0 and none.agreement == 1.0
    ids = tok(stdlib_code(), return_tensors="pt").input_ids[:, : SMALL.prefix + SMALL.score]
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = model(ids, past_key_values=DynamicCache(config=model.config)).logits[0]
    finally:
        model.set_attn_implementation("kvguard")
    targets = ids[0, SMALL.prefix :]
    ppl = math.exp(F.cross_entropy(logits[SMALL.prefix - 1 : -1], targets).item())
    assert none.ppl == pytest.approx(ppl, rel=5e-3)  # the pages are fp16, DynamicCache holds fp32


def test_codec_and_evictor_rows(result):
    rows = result.by_method()
    int8, stream, sparse = rows["int8"], rows["streamingllm"], rows["sparse"]
    assert 0 < int8.deviation < 0.01 and abs(int8.ppl_delta) < 0.1
    assert int8.held_ratio < 0.75 and int8.read_ratio == 1.0 and int8.evicted == 0
    assert stream.evicted > 0 and stream.held_ratio < 0.5
    assert stream.deviation > 5 * int8.deviation and stream.worst_layer >= stream.deviation
    assert sparse.held_ratio > 0.99 and sparse.read_ratio < 0.6 and sparse.deviation > 0
    once = rows["h2o-prefix"]  # the prefix compressed once to the budget, the rest kept
    assert once.evicted == SMALL.prefix - SMALL.budget
    assert once.held_ratio == pytest.approx((SMALL.budget + SMALL.score - 1) / (SMALL.prefix + SMALL.score - 1),
                                            abs=16 / 191)
    for s in result.summaries:
        assert len(s.deviation_per_layer) == 30 and len(s.texts[0].tokens) == SMALL.generate
        assert s.passed == (s.worst_text_deviation < 0.01 and s.worst_ppl_delta < 0.5)


def test_policy_is_calibrated_on_what_was_measured(result):
    (decision,) = result.decisions
    measured = result.by_method()["tiny"]
    assert decision.policy == "tiny" and decision.deviation == measured.worst_text_deviation
    if measured.passed:
        assert decision.outcome == "accept"
    else:
        assert decision.outcome in ("downgrade", "refuse")
        step = result.by_method()["tiny~1"]
        assert (decision.outcome == "downgrade") == step.passed
        assert step.key == "int8(sink 4)" and step.deviation == result.by_method()["int8"].deviation


def test_report_files(result, tmp_path):
    paths = report.write(result, tmp_path)
    assert sorted(p.name for p in paths) == ["fidelity.csv", "fidelity.html", "fidelity.json", "fidelity.md"]
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert [s["method"] for s in data["summaries"]][:5] == ["none", "int8", "streamingllm", "h2o-prefix", "sparse"]
    assert len(data["summaries"][1]["texts"][0]["deviation"]) == 30
    assert data["decisions"][0]["op"] == "policy"
    rows = list(csv.DictReader((tmp_path / "fidelity.csv").open()))
    assert len(rows) == 2 * len(result.summaries)
    md = (tmp_path / "fidelity.md").read_text()
    assert "| int8 | `int8(sink 4)` |" in md and "Against the seeds' table" in md
    html = (tmp_path / "fidelity.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "<table>" in html
    again = report.from_json(data)  # what --from-json renders
    assert report.to_markdown(again) == md and report.to_rows(again) == report.to_rows(result)


def test_a_budget_near_the_whole_text_still_compacts(smollm2):
    """Compaction writes the survivors before freeing the old pages: the harness's
    pools must hold both, or compact() finds no room and the evictor never fires."""
    model, tok = smollm2
    s = Settings(prefix=256, score=160, generate=2)  # compacts once, at 400 of 415 tokens
    method = Method("h2o", "evictor", {"evictor": "h2o", "evictor_options": {"budget": 384, "sink": 4, "window": 64}})
    got = run(model, token_ids(tok, stdlib_code(), 416), "stdlib-code", method, s)
    assert got.evicted > 0


def test_compare_without_greedy_tokens():
    from kvguard.eval.evaluate import Report
    from kvguard.eval.harness import TextResult, compare, summarize

    def result(ppl):
        return TextResult("m", "codec", "int8", "t", [0.01], ppl, 0.5, 1.0, 0, [], 1.0, math.nan)

    r = result(10.25)
    compare(r, result(10.0))  # --generate 0: nothing to agree on, still a ΔPPL
    assert r.ppl_delta == 0.25 and math.isnan(r.agreement)
    # and the report, written and read back from its JSON, renders it
    summary = summarize(Method("int8", "codec", {"codec": "int8"}), [r], 0.01, 0.5)
    again = report.from_json(json.loads(json.dumps(report.to_json(
        Report("m", Settings(generate=0), {"t": 1}, [summary])))))
    assert math.isnan(again.summaries[0].agreement) and math.isnan(again.summaries[0].decode_tps)
    assert "| int8 | `int8` |" in report.to_markdown(again)


def test_a_policy_is_not_taken_as_measured_at_another_page_size(monkeypatch):
    import kvguard.eval.evaluate as ev
    from kvguard.eval.harness import TextResult

    pages = {}  # method -> the page size its cache was made with

    def fake_run(model, ids, text, method, s):
        pages[method.name] = method.options.get("page_size", s.page_size)
        return TextResult(method.name, method.kind, method.key, text, [0.001 * pages[method.name]], 10.0, 0.5,
                          1.0, 0, [1], 1.0, 1.0)

    monkeypatch.setattr(ev, "run", fake_run)
    def tokenizer(text, return_tensors):
        return type("T", (), {"input_ids": torch.zeros(1, 64, dtype=torch.long)})
    policy = parse_policy(POLICY.replace("evictor: {name: h2o, budget: 48, sink: 4, window: 16}\n", ""))
    methods = [builtin_methods(32)["int8"]]  # the same layers as the policy: int8(sink 4)
    got = evaluate(None, tokenizer, {"t": "x"}, methods, Settings(prefix=32, score=32, page_size=32), [policy],
                   progress=False)
    assert pages == {"none": 32, "int8": 32, "tiny": 16}  # the policy measured at its own page size
    assert got.by_method()["tiny"].deviation == pytest.approx(0.016)
    pages.clear()  # at the same page size, the same configuration is measured once
    got = evaluate(None, tokenizer, {"t": "x"}, methods, Settings(prefix=32, score=32), [policy], progress=False)
    assert pages == {"none": 16, "int8": 16} and "measured as int8" in got.by_method()["tiny"].description
