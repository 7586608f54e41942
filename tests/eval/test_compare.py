"""`kvguard eval --compare`: two models' reports side by side, a policy whose gates disagree named."""

import json

import pytest

from kvguard.errors import ConfigError
from kvguard.eval.cli import main


def _report(model, status, outcome, config, texts=()):
    summary = {"method": "int4", "held_ratio": 0.25, "mean_layer_deviation": 0.02, "worst_layer_deviation": 0.05,
               "ppl_delta": 0.04, "status": status, "texts": [
                   {"text": t, "mean_layer_deviation": d, "ppl_delta": p} for t, d, p in texts]}
    decision = {"policy": "code", "outcome": outcome, "config": config}
    return {"model": model, "texts": ["stdlib-code"], "settings": {"prefix": 1024, "score": 256, "budget": 256},
            "summaries": [summary], "decisions": [decision]}


def test_side_by_side_names_each_model_and_where_their_gates_differ(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report("smollm2", "PASS", "accept", "int4",
                                    texts=[("austen", 0.015, 0.03), ("code", 0.025, 0.05)])))
    b.write_text(json.dumps(_report("gemma3", "FAIL", "refuse", None)))
    assert main(["--compare", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "side-by-side.md").read_text()
    assert text == capsys.readouterr().out
    # each model's min–max over its texts where it has several
    assert ("| int4 | 0.250 / 2.00 % (1.50 % – 2.50 %) / 5.00 % / +0.0400 (+0.0300 – +0.0500) / PASS "
            "| 0.250 / 2.00 % / 5.00 % / +0.0400 / FAIL |") in text
    assert "| code | accept (`int4`) | refuse (—) | no: smollm2 accept, gemma3 refuse |" in text


def test_compare_needs_two_reports(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_report("smollm2", "PASS", "accept", "int4")))
    with pytest.raises(ConfigError, match="two or more"):
        from kvguard.eval.compare import load_reports

        load_reports([str(a)])
