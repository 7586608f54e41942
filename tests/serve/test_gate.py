"""--fidelity: a policy serves as its fidelity gate decided in a `kvguard eval` report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.errors import ConfigError
from kvguard.policy.schema import load_policy
from kvguard.serve.cli import gate

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "docs/fidelity/fidelity.json"


def test_the_gate_accepts_downgrades_or_refuses(tmp_path):
    data = json.loads(REPORT.read_text())
    outcome = {d["policy"]: d for d in data["decisions"]}
    for name in ("chat", "code", "rag"):  # downgraded, downgraded, accepted
        policy = load_policy(ROOT / f"policies/{name}.yaml")
        served, decision = gate(policy, REPORT)
        want = outcome[name]
        assert decision.outcome == want["outcome"] and decision.op == "policy"
        assert served.steps()[0].key == want["config"]  # the step in force, now the policy's own
    assert (outcome["rag"]["outcome"], outcome["rag"]["evictor"]) == ("accept", "measured")
    assert served.steps()[0].key == load_policy(ROOT / "policies/rag.yaml").steps()[0].key  # as written
    bad = tmp_path / "r.json"
    refused = [d | {"outcome": "refuse", "step": -1, "config": ""} if d["policy"] == "chat" else d
               for d in data["decisions"]]
    bad.write_text(json.dumps({"decisions": refused}))
    with pytest.raises(ConfigError, match="refused"):
        gate(load_policy(ROOT / "policies/chat.yaml"), bad)
    other = [d | {"config": "int4(...)"} if d["policy"] == "chat" else d for d in data["decisions"]]
    bad.write_text(json.dumps({"decisions": other}))
    with pytest.raises(ConfigError, match="measure it again"):
        gate(load_policy(ROOT / "policies/chat.yaml"), bad)
    with pytest.raises(ConfigError, match="no decision"):
        gate(load_policy(ROOT / "tests/serve/chat-small.yaml"), REPORT)
    bad.write_text("not json")
    with pytest.raises(ConfigError, match="no kvguard eval report"):
        gate(load_policy(ROOT / "policies/chat.yaml"), bad)


def test_a_step_added_before_the_measured_one_is_skipped_not_served(tmp_path):
    # code.yaml once read [int8+h2o, int8, fp16] and was calibrated to step 1 (int8); it now starts
    # from rotated INT4: the measured int8 is step 2, and the new, unmeasured steps are not served
    policy = load_policy(ROOT / "policies/code.yaml")
    keys = [s.key for s in policy.steps()]
    measured = "int8(sink 4, window 128)"
    assert keys.index(measured) == 2 and keys[0].startswith("int4+rot")
    data = json.loads(REPORT.read_text())
    old = [d | {"step": 1, "config": measured, "outcome": "downgrade"} if d["policy"] == "code" else d
           for d in data["decisions"]]
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"decisions": old}))
    served, decision = gate(policy, report)
    assert served.steps()[0].key == measured and decision.step == 2


def test_split_pages_size_the_split_pool_of_a_splitting_policy():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvguard.serve.cli import cache_manager

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    chat = ROOT / "policies/chat.yaml"  # splits K/V
    manager, _ = cache_manager(model, policy=chat, num_pages=64)
    assert manager.pools["split"].num_pages == 64  # as many as the codec's pool by default
    manager, _ = cache_manager(model, policy=chat, num_pages=64, split_pages=16)
    assert manager.pools["split"].num_pages == 16 and manager.pools["main"].num_pages == 64
    with pytest.raises(ConfigError, match="does not split"):
        cache_manager(model, policy=ROOT / "policies/code.yaml", num_pages=64, split_pages=16)
