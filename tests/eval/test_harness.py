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

pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated"),
              pytest.mark.xdist_group("eval-harness")]  # its module fixtures run once, on one worker
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
# an evictor whose budget the small run never reaches: its codec alone is measured
IDLE = POLICY.replace("name: tiny", "name: idle").replace("budget: 48", "budget: 4096")


@pytest.fixture(scope="module")
def result(smollm2):
    model, tok = smollm2
    methods = builtin_methods(SMALL.budget)
    chosen = [methods[n] for n in ("none", "int8", "streamingllm", "h2o-prefix", "sparse", "int4")]
    return evaluate(model, tok, {"stdlib-code": stdlib_code()}, chosen, SMALL,
                    [parse_policy(POLICY), parse_policy(IDLE)], progress=False)


def test_reference_is_exact_and_its_perplexity_matches_dynamic_cache(smollm2, result):
    model, tok = smollm2
    none = result.by_method()["none"]
    assert none.mean_layer_deviation == 0.0 and none.ppl_delta == 0.0 and none.agreement == 1.0
    assert none.kl == 0.0 and none.top1 == 1.0 and none.ppl_delta_rel == 0.0 and none.status == "PASS"
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
    assert 0 < int8.mean_layer_deviation < 0.01 and abs(int8.ppl_delta) < 0.1
    assert int8.held_ratio < 0.75 and int8.read_ratio == 1.0 and int8.evicted == 0
    assert stream.evicted > 0 and stream.held_ratio < 0.5
    assert stream.mean_layer_deviation > 5 * int8.mean_layer_deviation
    assert stream.worst_layer_deviation > stream.mean_layer_deviation
    assert sparse.held_ratio > 0.99 and sparse.read_ratio < 0.6 and sparse.mean_layer_deviation > 0
    once = rows["h2o-prefix"]  # the prefix compressed once to the budget, the rest kept
    assert once.evicted == SMALL.prefix - SMALL.budget
    assert once.held_ratio == pytest.approx((SMALL.budget + SMALL.score - 1) / (SMALL.prefix + SMALL.score - 1),
                                            abs=16 / 191)
    for s in result.summaries:
        assert len(s.deviation_per_layer) == 30 and len(s.texts[0].tokens) == SMALL.generate
        within = s.worst_text_deviation < 0.01 and s.worst_ppl_delta < 0.5 and s.worst_layer_deviation < 0.03
        assert s.status == ("FAIL" if not within else "evictor not measured" if s.evictor_fired is False else "PASS")
        assert s.passed == (s.status == "PASS")


def test_policy_is_calibrated_on_what_was_measured(result):
    decision = result.decisions[0]
    measured = result.by_method()["tiny"]
    assert decision.policy == "tiny" and decision.mean_layer_deviation == measured.worst_text_deviation
    assert decision.worst_layer_deviation == measured.worst_layer_deviation and decision.evictor == "measured"
    assert decision.ppl_increase_rel == measured.worst_ppl_delta_rel and decision.max_layer_deviation == 0.03
    if measured.passed:
        assert decision.outcome == "accept"
    else:
        assert decision.outcome in ("downgrade", "refuse")
        step = result.by_method()["tiny~1"]
        assert (decision.outcome == "downgrade") == step.passed
        assert step.key == "int8(sink 4)"
        assert step.mean_layer_deviation == result.by_method()["int8"].mean_layer_deviation


def test_report_files(result, tmp_path):
    paths = report.write(result, tmp_path)
    assert sorted(p.name for p in paths) == ["fidelity.csv", "fidelity.html", "fidelity.json", "fidelity.md"]
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert [s["method"] for s in data["summaries"]][:5] == ["none", "int8", "streamingllm", "h2o-prefix", "sparse"]
    for s in data["summaries"]:
        assert {"mean_layer_deviation", "worst_layer_deviation", "kl", "top1", "ppl_delta_rel", "status"} <= set(s)
        assert {"mean_layer_deviation", "worst_layer_deviation", "kl", "top1"} <= set(s["texts"][0])
    assert {"worst_layer_deviation", "evictor", "max_layer_deviation"} <= set(data["decisions"][0])
    assert len(data["summaries"][1]["texts"][0]["deviation"]) == 30
    assert data["decisions"][0]["op"] == "policy"
    rows = list(csv.DictReader((tmp_path / "fidelity.csv").open()))
    assert len(rows) == 2 * len(result.summaries)
    md = (tmp_path / "fidelity.md").read_text()
    assert "| int8 | `int8(sink 4)` |" in md and "Against the seeds' table" in md
    for column in ("worst layer", "ΔPPL/PPL", "ΔPPL, texts min–max", "KL (nats)", "top-1 agreement",
                   "greedy agreement (info)", "layer <3.00 %"):
        assert column in md
    assert set(rows[0]) >= {"mean_layer_deviation", "worst_layer_deviation", "ppl_delta_rel", "kl", "top1", "status"}
    assert "evictor not measured" in md and "| idle |" in md
    html = (tmp_path / "fidelity.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "<table>" in html and "KL (nats)" in html
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
    from kvguard.policy import Fidelity

    def result(ppl):
        return TextResult("m", "codec", "int8", "t", [0.01], ppl, 0.5, 1.0, 0, [], 1.0, math.nan)

    r = result(10.25)
    compare(r, result(10.0))  # --generate 0: nothing to agree on, still a ΔPPL
    assert r.ppl_delta == 0.25 and math.isnan(r.agreement)
    # and the report, written and read back from its JSON, renders it
    summary = summarize(Method("int8", "codec", {"codec": "int8"}), [r], Fidelity())
    again = report.from_json(json.loads(json.dumps(report.to_json(
        Report("m", Settings(generate=0), {"t": 1}, [summary])))))
    assert math.isnan(again.summaries[0].agreement) and math.isnan(again.summaries[0].decode_tps)
    assert "| int8 | `int8` |" in report.to_markdown(again)


def test_a_policy_is_not_taken_as_measured_at_another_page_size(monkeypatch):
    import kvguard.eval.evaluate as ev
    from kvguard.eval.harness import TextResult

    pages = {}  # method -> the page size its cache was made with

    def fake_run(model, ids, text, method, s, **kw):
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
    assert got.by_method()["tiny"].mean_layer_deviation == pytest.approx(0.016)
    pages.clear()  # at the same page size, the same configuration is measured once
    got = evaluate(None, tokenizer, {"t": "x"}, methods, Settings(prefix=32, score=32), [policy], progress=False)
    assert pages == {"none": 16, "int8": 16} and "measured as int8" in got.by_method()["tiny"].description


def test_kl_and_top1_against_the_reference(result):
    rows = result.by_method()
    none, int8, int4, stream = rows["none"], rows["int8"], rows["int4"], rows["streamingllm"]
    assert none.kl == 0.0 and none.top1 == 1.0
    for s in result.summaries:
        assert s.kl >= 0 and 0 <= s.top1 <= 1
    # dropping all but 32 tokens moves the next-token distribution far more than INT8 does
    assert 0 < int8.kl < 0.05 < stream.kl and int8.top1 > 0.9 > stream.top1
    assert int8.ppl_delta_rel == pytest.approx(int8.ppl_delta / none.ppl)
    # the mean over layers hides single layers: INT4's worst layer is well above its mean
    assert int4.worst_layer_deviation > 2 * int4.mean_layer_deviation > 0


def test_kl_is_zero_for_the_same_cache_again(smollm2):
    """The reference's kept next tokens, compared with a second run of the same cache: exactly
    0 and 1 (nothing in the run is random), where int8 is not."""
    model, tok = smollm2
    s = Settings(prefix=64, score=32, chunk=16, generate=0)
    ids = token_ids(tok, stdlib_code(), 96)
    methods = builtin_methods(32)
    ref = run(model, ids, "t", methods["none"], s, keep=True)
    again = run(model, ids, "t", methods["none"], s, reference=ref.reference)
    assert (again.kl, again.top1) == (0.0, 1.0)
    int8 = run(model, ids, "t", methods["int8"], s, reference=ref.reference)
    assert int8.kl > 0 and again.reference is None


def test_next_tokens_kl_against_the_full_distribution(monkeypatch):
    from kvguard.eval import harness

    torch.manual_seed(0)
    p = torch.randn(5, 50).mul(3).log_softmax(-1)
    q = (p.exp() + 0.02 * torch.rand(5, 50)).log().log_softmax(-1)
    full = F.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    kept = harness.NextTokens()
    kept.add(p)  # TOP_K >= 50: every token kept, the KL is exact
    kl, same = kept.compare(0, q)
    assert torch.allclose(kl, full, atol=1e-6) and same.tolist() == (p.argmax(-1) == q.argmax(-1)).tolist()
    monkeypatch.setattr(harness, "TOP_K", 8)  # the rest lumped into one outcome: a lower bound, and close
    kept = harness.NextTokens()
    kept.add(p)
    lumped, _ = kept.compare(0, q)
    assert (lumped <= full + 1e-6).all() and (lumped > 0.5 * full).all()
    with pytest.raises(ValueError, match="other positions"):
        kept.compare(0, q[:3])


def test_an_evictor_that_never_fired_is_not_measured(result):
    idle = result.by_method()["idle"]
    assert idle.evicted == 0 and idle.evictor_fired is False
    assert idle.status == "evictor not measured" and not idle.passed
    assert result.by_method()["int8"].status == "PASS"  # the same numbers, without an evictor
    decision = result.decisions[1]
    assert decision.policy == "idle" and decision.evictor == "not measured"
    assert decision.outcome == "downgrade" and decision.config == "int8(sink 4)"  # not accepted as written


def test_fire_evictors_measures_at_a_length_where_the_evictor_runs(monkeypatch):
    import kvguard.eval.evaluate as ev
    from kvguard.eval.harness import TextResult

    runs = []  # (method, prefix, score)

    def fake_run(model, ids, text, method, s, **kw):
        runs.append((method.name, s.prefix, s.score))
        assert ids.shape[1] == s.prefix + s.score
        fired = bool(method.options.get("evictor")) and method.options["evictor_options"]["budget"] + 16 <= (
            s.prefix + s.score - 1)
        return TextResult(method.name, method.kind, method.key, text, [0.001, 0.002], 10.0, 0.5, 1.0,
                          16 if fired else 0, [1], 1.0, 1.0, kl=0.0, top1=1.0)

    monkeypatch.setattr(ev, "run", fake_run)
    model = type("M", (), {"config": type("C", (), {"max_position_embeddings": 200})()})()

    def tokenizer(text, return_tensors):
        return type("T", (), {"input_ids": torch.zeros(1, 1000, dtype=torch.long)})
    fits = parse_policy(IDLE.replace("budget: 4096", "budget: 100"))  # 100 + 32 + 6 tokens fit in 200
    far = parse_policy(IDLE.replace("name: idle", "name: far").replace("budget: 4096", "budget: 190"))
    s = Settings(prefix=32, score=32, generate=6)
    got = evaluate(model, tokenizer, {"t": "x"}, [], s, [fits, far], progress=False, fire_evictors=True)
    idle = got.by_method()
    assert ("none", 100, 32) in runs and ("idle", 100, 32) in runs  # the reference at the same length
    assert idle["idle"].evictor_fired and idle["idle"].status == "PASS" and idle["idle"].prefix == 100
    assert "so that its evictor fires" in idle["idle"].description
    assert idle["far"].status == "evictor not measured" and "beyond the model's 200" in idle["far"].description
    runs.clear()  # without the option, nothing runs longer
    got = evaluate(model, tokenizer, {"t": "x"}, [], s, [fits], progress=False)
    assert {r[1] for r in runs} == {32} and got.by_method()["idle"].status == "evictor not measured"


def test_an_older_report_renders_again(result):
    data = json.loads(json.dumps(report.to_json(result)))
    for s in data["summaries"]:  # the names before the worst layer was bounded
        s["deviation"], s["worst_layer"] = s.pop("mean_layer_deviation"), s.pop("worst_layer_deviation")
        s["passed"] = s.pop("status") == "PASS"
        for k in ("ppl_delta_rel", "worst_ppl_delta_rel", "kl", "worst_kl", "top1", "evictor_fired", "prefix",
                  "score"):
            s.pop(k)
        for t in s["texts"]:
            for k in ("ppl_delta_rel", "kl", "top1", "prefix", "score", "worst_layer_deviation"):
                t.pop(k)
            t["mean_deviation"] = t.pop("mean_layer_deviation")
    for d in data["decisions"]:
        d["deviation"] = d.pop("mean_layer_deviation")
        for k in ("worst_layer_deviation", "ppl_increase_rel", "evictor", "max_layer_deviation",
                  "max_ppl_increase_rel"):
            d.pop(k)
    data["bound"].pop("max_layer_deviation")
    data["bound"].pop("max_ppl_increase_rel")
    again = report.from_json(data)
    assert again.by_method()["int8"].mean_layer_deviation == result.by_method()["int8"].mean_layer_deviation
    assert again.decisions[0].mean_layer_deviation == result.decisions[0].mean_layer_deviation
    md = report.to_markdown(again)
    assert "| int8 | `int8(sink 4)` |" in md and "| — |" in md  # KL unknown in an older report
