"""Policies: every shipped file loads and sizes a cache; bad files fail with file,
line and field; calibration accepts, downgrades or refuses, as an event."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from kvguard.cache import CacheManager, EventQueue
from kvguard.compress.codecs import CODECS, make_codec
from kvguard.compress.evictors import EVICTORS, make_evictor
from kvguard.errors import ConfigError
from kvguard.policy import (
    SCENARIOS,
    Measurement,
    ModelShape,
    PolicyDecision,
    PolicyError,
    calibrate,
    load_policies,
    load_policy,
    parse_policy,
)
from kvguard.policy.schema import CODEC_OPTIONS
from kvguard.policy.schema import Codec as SchemaCodec
from kvguard.policy.schema import Evictor as SchemaEvictor
from tests.test_import_rules import BLOCKER, ROOT

POLICIES = Path(__file__).resolve().parents[1] / "policies"
SHIPPED = sorted(POLICIES.glob("*.yaml"))
SMOLLM2 = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, num_query_heads=9)
CHAT = (POLICIES / "chat.yaml").read_text()
COVERAGE = next(line + "\n" for line in CHAT.splitlines() if line.startswith("  coverage: "))  # chat's split rule


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_policy_loads_and_makes_a_cache(path):
    policy = load_policy(path)
    assert policy.name == path.stem
    for step in range(len(policy.steps())):
        cfg = policy.at(step).cache_config(SMOLLM2, num_pages=8)
        CacheManager(cfg)  # codec and evictor options are accepted by the core
    assert policy.retention.seconds > 0


def test_one_policy_per_scenario_and_no_h2o_for_rag_or_reasoning():
    policies = load_policies(POLICIES)
    assert sorted(p.scenario for p in policies.values()) == sorted(SCENARIOS)
    for p in policies.values():
        if p.scenario in ("rag", "reasoning"):
            assert all(s.evictor is None or s.evictor.name != "h2o" for s in p.steps())


def test_cache_config_follows_the_policy():
    p = load_policy(POLICIES / "offline-batch.yaml")
    cfg = p.cache_config(SMOLLM2, num_pages=8)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_query_heads) == (30, 3, 64, 9)
    assert (cfg.codec, cfg.fp_sink, cfg.fp_window, cfg.evictor) == ("int4", 4, 128, "h2o")
    assert cfg.evictor_options == {"budget": 1024, "sink": 4, "window": 128, "per_head": True}
    chat = load_policy(POLICIES / "chat.yaml").cache_config(SMOLLM2)
    assert chat.evictor_options == {"budget": 4096, "sink": 4, "window": 4092}


def test_a_cache_made_from_a_policy_keeps_its_tiers_and_prefix_sharing(tmp_path):
    from kvguard.cache.tiers import CpuTier, DiskTier
    from kvguard.types import Subject

    chat = load_policy(POLICIES / "chat.yaml").cache_config(SMOLLM2, num_pages=8)  # device, cpu; tenant
    assert chat.tiers == ("cpu",) and chat.prefix_sharing
    CacheManager(chat, tiers={"cpu": CpuTier()})
    with pytest.raises(ConfigError, match=r"tier\(s\) \['disk'\] given, but pages of this cache may go to \['cpu'\]"):
        CacheManager(chat, tiers={"cpu": CpuTier(), "disk": DiskTier(tmp_path / "pages")})
    long_doc = load_policy(POLICIES / "long-document.yaml").cache_config(SMOLLM2, num_pages=8)  # device; none
    assert long_doc.tiers == () and not long_doc.prefix_sharing
    with pytest.raises(ConfigError, match="no lower tier"):
        CacheManager(long_doc, tiers={"cpu": CpuTier()})
    m = CacheManager(long_doc)
    seq = m.open(Subject("acme", "alice", "s"), tokens=list(range(32)))
    with pytest.raises(ConfigError, match="shares no prompt pages"):
        m.publish_prefix(seq, list(range(32)))


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


BAD = [
    # (what changes, the line it is on, the field named, words of the message)
    (("name: int8\n  fp_sink: 4\n  fp_window: 128\nevictor", "name: int3\n  fp_sink: 4\n  fp_window: 128\nevictor"),
     "name: int3", "codec.name", "'int8'"),
    (("prefix_sharing: tenant", "prefix_share: tenant"), "prefix_share", "prefix_share", "not permitted"),
    (("budget: 4096", "budget: -5"), "budget: -5", "evictor.budget", "greater than 0"),
    (("budget: 4096", "budget: '4096'"), "budget: '4096'", "evictor.budget", "integer"),
    (("max_age: 1d", "max_age: 1 month"), "max_age", "retention.max_age", "duration"),
    (("max_attention_deviation: 0.01", "max_attention_deviation: 2"), "max_attention_deviation",
     "fidelity.max_attention_deviation", "less than 1"),
    (("tiers: [device, cpu]", "tiers: [cpu, device]"), "tiers:", "tiers", "start with device"),
    (("  - codec: {name: fp16}", "  - codec: {name: fp32}"), "name: fp32", "downgrade[1].codec.name", "'fp16'"),
    (("downgrade:\n  - codec: {name: int8, fp_sink: 4, fp_window: 128}\n  - codec: {name: fp16}\n", ""), "on_violation",
     "on_violation", "downgrade list"),
    (("  sink: 4\ntiers", "  sink: 4\n  window: 32\n  observe: 8\ntiers"), "name: streamingllm", "evictor",
     "snapkv's options"),
    (("name: streamingllm\n  budget: 4096\n  sink: 4", "name: snapkv\n  budget: 4096\n  sink: 4\n  pool: 4"),
     "name: snapkv", "evictor", "pool an odd number"),
    (("  fp_window: 128\nevictor", "  fp_window: 128\n  options: {grup: 64}\nevictor"), "name: int8\n", "codec",
     "bad options for codec 'int8'"),
    (("name: int8\n  fp_sink: 4\n  fp_window: 128\nevictor", "name: int4\n  options: {group: 0}\nevictor"),
     "name: int4", "codec", "group must be a positive integer"),
]


BAD_SPLIT = [
    ((COVERAGE, "  fraction: 0.5\n  top_k: 4\n"), "kv_split:", "kv_split", "one of top_k"),
    ((COVERAGE, ""), "kv_split:", "kv_split", "one of top_k, fraction, mass and coverage"),
    ((COVERAGE, "  fraction: 0\n"), "fraction: 0", "kv_split.fraction", "greater than 0"),
    ((COVERAGE, "  mass: 1\n"), "mass: 1", "kv_split.mass", "less than 1"),
    ((COVERAGE, "  coverage: 1\n"), "coverage: 1", "kv_split.coverage", "less than 1"),
    (("  window: 512\n", "  windw: 512\n"), "windw", "kv_split.windw", "not permitted"),
    (("tiers: [device, cpu]", "tiers: [device]"), "kv_split:", "kv_split", "add cpu to tiers"),
    (("  - codec: {name: fp16}", "  - codec: {name: fp16}\n    kv_split: {top_k: 2, fraction: 0.1}"), "kv_split: {",
     "downgrade[1].kv_split", "or mass or coverage with top_k or fraction"),
]


@pytest.mark.parametrize("change, needle, field, words", BAD + BAD_SPLIT,
                         ids=[b[2] for b in BAD] + [b[3] for b in BAD_SPLIT])
def test_bad_policy_names_file_line_and_field(change, needle, field, words):
    text = CHAT.replace(*change)
    assert text != CHAT
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "policies/bad.yaml")
    msg = str(e.value)
    line = {"name: streamingllm": line_of(text, "evictor:"), "name: snapkv": line_of(text, "evictor:"),
            "name: int8\n": line_of(text, "codec:"), "name: int4": line_of(text, "codec:")}.get(needle)
    line = line or line_of(text, needle)
    assert msg.startswith(f"policies/bad.yaml:{line}: {field}: "), msg
    assert words in msg


def test_a_field_given_twice_is_an_error_not_the_last_one_silently():
    text = CHAT.replace("  sink: 4\ntiers", "  sink: 4\n  budget: 64\ntiers")
    with pytest.raises(PolicyError, match=rf"^policies/bad.yaml:{line_of(text, 'budget: 64')}: evictor.budget: "
                                          "given twice"):
        parse_policy(text, "policies/bad.yaml")
    text = CHAT + "on_violation: refuse\n"
    with pytest.raises(PolicyError, match=rf"^x:{len(text.splitlines())}: on_violation: given twice"):
        parse_policy(text, "x")


def test_h2o_in_a_rag_policy_is_refused_at_its_line(tmp_path):
    text = (POLICIES / "rag.yaml").read_text()
    text += "  - codec: {name: int8}\n    evictor: {name: h2o, budget: 512}\n"
    path = tmp_path / "rag.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=rf"^{path}:{line_of(text, 'h2o, budget')}: "
                                          r"downgrade\[2\]\.evictor\.name: the rag scenario never uses h2o"):
        load_policy(path)


def test_invalid_yaml_and_missing_fields(tmp_path):
    with pytest.raises(PolicyError, match=r"^policies/x.yaml:\d+: not valid YAML"):
        parse_policy(CHAT.replace("tiers: [device, cpu]", "tiers: [device, cpu"), "policies/x.yaml")
    with pytest.raises(PolicyError, match=r"^policies/x.yaml:1: a policy is a mapping"):
        parse_policy("- just\n- a list\n", "policies/x.yaml")
    with pytest.raises(PolicyError, match=r"on_violation: Field required"):
        parse_policy(CHAT.replace("on_violation: downgrade\n", "").replace("downgrade:", "downgrade_:"), "x")
    with pytest.raises(PolicyError, match=r"cannot read"):
        load_policy(tmp_path / "absent.yaml")


def test_calibrate_accepts_within_the_bound():
    p = load_policy(POLICIES / "chat.yaml")
    events = EventQueue()
    d = calibrate(p, Measurement(mean_layer_deviation=0.004, ppl_delta=0.01), tenant="acme", events=events)
    assert (d.outcome, d.step, d.config) == ("accept", 0, "int8(sink 4, window 128)+streamingllm@4096/s4"
                                                          "+kvsplit@c0.99/w512")  # chat splits K/V
    assert events.take_events() == [d]


def test_calibrate_downgrades_to_the_first_step_within_the_bound():
    p = load_policy(POLICIES / "long-document.yaml")
    measured = {
        "int4+rot(sink 4, window 128)+h2o@1024/s4/w256": Measurement(0.05, 0.3),
        "int8(sink 4, window 128)+h2o@1024/s4/w256": Measurement(0.03, 0.2),
        "int8(sink 4, window 128)+h2o@1536/s4/w384": Measurement(0.02, 0.1),  # still beyond 1 %
        "int8(sink 4, window 128)": Measurement(0.003, 0.004),
    }
    d = calibrate(p, measured, tenant="acme")
    assert (d.outcome, d.step, d.config) == ("downgrade", 3, "int8(sink 4, window 128)")
    assert p.at(d.step).evictor is None
    assert (d.mean_layer_deviation, d.ppl_delta) == (0.05, 0.3)
    record = d.details()
    assert record["policy"] == "long-document" and "subject" not in record
    assert d.op == "policy" and d.subject.tenant == "acme"


def test_calibrate_refuses():
    reasoning = load_policy(POLICIES / "reasoning.yaml")
    d = calibrate(reasoning, Measurement(0.011, 0.0))
    assert d.refused and d.step == -1 and d.config == ""
    chat = load_policy(POLICIES / "chat.yaml")
    bad = Measurement(0.5, 2.0)
    assert calibrate(chat, lambda step: bad).refused  # no downgrade step passes either
    assert calibrate(chat, Measurement(0.001, 0.7)).outcome == "downgrade"  # perplexity counts too


def test_a_refused_policy_has_no_configuration_in_force():
    reasoning = load_policy(POLICIES / "reasoning.yaml")  # on_violation: refuse, no downgrade steps
    d = calibrate(reasoning, Measurement(0.011, 0.0))
    with pytest.raises(ConfigError, match="refused"):
        reasoning.at(d.step)  # not the refused configuration as written
    chat = load_policy(POLICIES / "chat.yaml")
    with pytest.raises(ConfigError, match="refused"):
        chat.at(calibrate(chat, lambda step: Measurement(0.5, 2.0)).step)  # not its last downgrade step
    with pytest.raises(ConfigError, match="steps 0 to 2"):
        chat.at(3)


def test_per_head_is_an_evictor_option_and_named_in_the_key():
    from kvguard.policy import Evictor, config_key

    e = Evictor(name="h2o", budget=256, sink=4, window=64)
    assert e.options()["per_head"] is True
    shared = Evictor(name="snapkv", budget=256, sink=4, window=32, per_head=False).options()
    assert config_key({"codec": "int8", "evictor": "snapkv", "evictor_options": shared}) == "int8+snapkv@256/s4/w32/shared"
    assert config_key({"evictor": "h2o", "evictor_options": e.options()}) == "fp16+h2o@256/s4/w64"
    with pytest.raises(ValueError, match="per_head"):
        Evictor(name="streamingllm", budget=256, per_head=False)
    with pytest.raises(ValueError):
        Evictor(name="h2o", budget=256, per_head="yes")


def test_scoring_and_allocation_are_evictor_options_checked_as_the_cache_checks_them():
    from kvguard.cache import CacheConfig
    from kvguard.policy import Evictor, config_key

    valued = Evictor(name="h2o", budget=256, sink=4, window=64, scoring="value_aware").options()
    assert valued["scoring"] == "value_aware"
    assert "scoring" not in Evictor(name="h2o", budget=256).options()  # the default leaves keys as they were
    assert config_key({"evictor": "h2o", "evictor_options": valued}) == "fp16+h2o@256/s4/w64/value"
    assert config_key({"evictor": "snapkv", "evictor_options": {"budget": 256, "window": 32,
                                                                "allocation": "pyramid"}}) == \
        "fp16+snapkv@256/s4/w32/pyramid"
    for name, scoring, allocation in itertools.product(sorted(EVICTORS), ("mass", "value_aware"),
                                                        ("uniform", "pyramid", "adaptive", "pyramid-adaptive",
                                                                                     "global")):
        try:
            e = SchemaEvictor(name=name, budget=128, scoring=scoring, allocation=allocation)
            schema_ok = True
        except ValidationError as err:
            schema_ok = False
            assert "not stored by the cache" in str(err) or "scoring is h2o's" in str(err)
        options = {"budget": 128, "sink": 4, "window": 64, "scoring": scoring, "allocation": allocation}
        try:
            CacheManager(CacheConfig(**SMOLLM2.as_config_fields(), num_pages=8, evictor=name,
                                     evictor_options=e.options() if schema_ok else options))
            cache_ok = True
        except ConfigError:
            cache_ok = False
        assert schema_ok == cache_ok, (name, scoring, allocation)
        assert schema_ok == (allocation == "uniform" and (scoring == "mass" or name != "streamingllm"))


def test_granularity_is_an_evictor_option_checked_as_the_cache_checks_it():
    from kvguard.cache import CacheConfig
    from kvguard.policy import Evictor, config_key

    paged = Evictor(name="h2o", budget=256, sink=4, window=64, granularity="page").options()
    assert paged["granularity"] == "page" and "granularity" not in Evictor(name="h2o", budget=256).options()
    assert config_key({"evictor": "h2o", "evictor_options": paged}) == "fp16+h2o@256/s4/w64/pages"
    for name, per_head in itertools.product(sorted(EVICTORS), (True, False)):
        try:
            SchemaEvictor(name=name, budget=128, granularity="page", **({} if per_head else {"per_head": False}))
            schema_ok = True
        except ValidationError as err:
            schema_ok = False
            assert "granularity page" in str(err) or "per_head is h2o's" in str(err)
        try:
            CacheManager(CacheConfig(**SMOLLM2.as_config_fields(), num_pages=8, evictor=name,
                                     evictor_options={"budget": 128, "sink": 4, "window": 64, "per_head": per_head,
                                                      "granularity": "page"} if name != "streamingllm" else
                                     {"budget": 128, "sink": 4, "window": 124, "granularity": "page"}))
            cache_ok = True
        except ConfigError:
            cache_ok = False
        assert schema_ok == (name != "streamingllm" and per_head), (name, per_head)
        assert cache_ok == schema_ok, (name, per_head)


def test_the_schema_loads_every_policy_without_torch_and_the_sidecar_reads_its_retention(tmp_path):
    """The daemon reads one retention number from a policy: the schema imports no torch,
    triton, numpy or cache, and neither does the sidecar's settings through it."""
    blocked = ["torch", "triton", "numpy", "kvguard.cache", "kvguard.compress", "kvguard.kernels"]
    chat = str(POLICIES / "chat.yaml")
    code = (f"BLOCKED = {blocked!r}\n{BLOCKER}\n"
            "import kvguard.policy.schema as schema\n"
            "from kvguard.policy import load_policies, load_policy\n"
            "from kvguard.sidecar.settings import load_settings\n"
            f"policies = load_policies({str(POLICIES)!r})\n"
            "assert len(policies) == 6 and all(p.retention.seconds > 0 for p in policies.values())\n"
            f"s = load_settings(data_dir={str(tmp_path)!r}, policy_file={chat!r})\n"
            f"assert s.retention_max_age_s == load_policy({chat!r}).retention.seconds\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_runtime_names_still_come_from_kvguard_policy():
    import kvguard.policy as policy
    from kvguard.policy import runtime

    assert policy.calibrate is runtime.calibrate and policy.PolicyDecision is runtime.PolicyDecision
    with pytest.raises(AttributeError):
        _ = policy.no_such_name


CODEC_CASES = [{}, {"group": 32}, {"group": 16}, {"group": 1}, {"group": 0}, {"group": -4}, {"group": True},
               {"group": "32"}, {"group": 8.0}, {"grup": 64}, {"code_dtype": "int8"}, {"group": 32, "x": 1},
               {"rotate": True}, {"rotate": False}, {"rotate": 1}, {"rotate": "yes"}, {"rotate": True, "group": 64}]


def test_the_schema_knows_the_kernels_int4_group():
    from kvguard.kernels.quantize import INT4_GROUP

    from kvguard.policy.schema import DEFAULT_INT4_GROUP

    assert DEFAULT_INT4_GROUP == INT4_GROUP


@pytest.mark.parametrize("name", sorted(CODECS))
def test_the_schema_checks_codec_options_as_the_codecs_do(name):
    assert set(get_args(SchemaCodec.model_fields["name"].annotation)) == set(CODECS)
    assert set(CODEC_OPTIONS[name]) == {f.name for f in dataclasses.fields(CODECS[name])}  # a new option: add it
    for options in CODEC_CASES:
        try:
            make_codec(name, **options)
            cache_ok = True
        except ConfigError:
            cache_ok = False
        try:
            SchemaCodec(name=name, options=options)
            schema_ok = True
        except ValidationError as e:
            schema_ok = False
            assert f"bad options for codec {name!r}" in str(e)
        assert schema_ok == cache_ok, (name, options)


def test_an_evictor_the_schema_accepts_is_one_the_cache_accepts():
    assert set(get_args(SchemaEvictor.model_fields["name"].annotation)) == set(EVICTORS)
    refused = 0
    for name, budget, sink, window, observe, pool, per_head in itertools.product(
            sorted(EVICTORS), (1, 8, 64), (0, 4), (0, 4, 60), (None, 1, 16), (None, 1, 2, 7), (True, False)):
        fields = {"name": name, "budget": budget, "sink": sink, "window": window, "per_head": per_head,
                  "observe": observe, "pool": pool}
        try:
            e = SchemaEvictor(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError:
            refused += 1
            continue
        make_evictor(e.name, **e.options())  # raises ConfigError when the schema let a bad one through
    assert refused  # the grid holds evictors the schema refuses


def test_fidelity_bounds_the_worst_layer_and_optionally_the_relative_ppl():
    old = load_policy(POLICIES / "chat.yaml")  # written before the new keys: still loads
    assert old.fidelity.max_layer_deviation == 0.03 and old.fidelity.max_ppl_increase_rel is None
    looser = parse_policy(CHAT.replace("max_attention_deviation: 0.01", "max_attention_deviation: 0.05"), "x")
    assert looser.fidelity.max_layer_deviation == pytest.approx(0.15)  # 3x the mean's bound by default
    own = parse_policy(CHAT.replace("  max_ppl_increase: 0.5", "  max_ppl_increase: 0.5\n  max_layer_deviation: 0.02\n"
                                    "  max_ppl_increase_rel: 0.01"), "x")
    assert (own.fidelity.max_layer_deviation, own.fidelity.max_ppl_increase_rel) == (0.02, 0.01)
    with pytest.raises(PolicyError, match=r"x:\d+: fidelity: .*max_layer_deviation 0.005 is below"):
        parse_policy(CHAT.replace("  max_ppl_increase: 0.5", "  max_ppl_increase: 0.5\n  max_layer_deviation: 0.005"),
                     "x")
    # the worst layer and the relative ΔPPL decide too
    assert calibrate(old, Measurement(0.004, 0.01, worst_layer_deviation=0.02)).outcome == "accept"
    d = calibrate(old, Measurement(0.004, 0.01, worst_layer_deviation=0.04))
    assert d.outcome == "downgrade" and (d.worst_layer_deviation, d.max_layer_deviation) == (0.04, 0.03)
    assert calibrate(own, Measurement(0.004, 0.01, 0.01, ppl_increase_rel=0.02)).outcome == "downgrade"
    assert calibrate(own, Measurement(0.004, 0.01, 0.01, ppl_increase_rel=0.005)).outcome == "accept"


def test_an_evictor_that_never_fired_does_not_pass():
    chat = load_policy(POLICIES / "chat.yaml")  # int8 + streamingllm@4096, downgrade: int8, fp16
    idle = Measurement(0.003, 0.0, 0.01, evictor_fired=False)
    d = calibrate(chat, {chat.steps()[0].key: idle, "int8(sink 4, window 128)": Measurement(0.003, 0.0, 0.01)})
    assert (d.outcome, d.step, d.evictor) == ("downgrade", 1, "not measured")
    reasoning = load_policy(POLICIES / "reasoning.yaml")  # on_violation: refuse
    assert calibrate(reasoning, idle).refused
    fired = calibrate(chat, Measurement(0.003, 0.0, 0.01, evictor_fired=True))
    assert (fired.outcome, fired.evictor) == ("accept", "measured")
    assert calibrate(load_policy(POLICIES / "chat.yaml"), Measurement(0.003, 0.0)).evictor == "unreported"


def test_greedy_agreement_is_no_part_of_the_gate():
    """One flipped token changes every later greedy token: it is reported, never gated on."""
    from kvguard.policy import Fidelity

    assert not any("agree" in f.name for f in dataclasses.fields(Measurement))
    assert not any("agree" in name for name in Fidelity.model_fields)
    assert not any("agree" in f.name for f in dataclasses.fields(PolicyDecision))


def test_a_decision_reads_back_from_an_older_report():
    from kvguard.types import Subject

    old = {"op": "policy", "seq": None, "pages": [], "n_tokens": 0, "bytes": 0, "policy": "chat", "outcome": "accept",
           "step": 0, "config": "int8", "deviation": 0.003, "ppl_delta": 0.0, "max_attention_deviation": 0.01,
           "max_ppl_increase": 0.5}
    d = PolicyDecision.from_details(old, Subject("*", "*", "*"))
    assert d.mean_layer_deviation == 0.003 and d.worst_layer_deviation is None and d.evictor == "unreported"
def test_kv_split_is_a_compression_layer_the_downgrade_steps_may_drop():
    from kvguard.cache.config import KVSplit

    p = parse_policy(CHAT)
    assert p.kv_split is not None and p.kv_split.enabled
    cfg = p.cache_config(SMOLLM2, num_pages=8)
    assert isinstance(cfg.kv_split, KVSplit) and cfg.kv_split.window == p.kv_split.window
    assert "+kvsplit@" in p.steps()[0].key and "+kvsplit@" in p.key
    assert all(s.kv_split is None for s in p.steps()[1:])  # chat's downgrade steps run without it
    assert p.at(1).cache_options()["kv_split"] is None and p.at(0).cache_options()["kv_split"]
    off = parse_policy(CHAT.replace("  enabled: true\n", "  enabled: false\n"))
    assert off.cache_options()["kv_split"] is None and "kvsplit" not in off.key
    step = parse_policy(CHAT.replace("  - codec: {name: fp16}", "  - codec: {name: fp16}\n    kv_split: {top_k: 8}"))
    assert step.at(2).cache_options()["kv_split"] == {"window": 256, "top_k": 8}
    assert step.steps()[2].key == "fp16+kvsplit@8p/w256"
    norm = parse_policy(CHAT.replace("  enabled: true\n", "  enabled: true\n  normalize: all\n"))
    assert norm.cache_config(SMOLLM2, num_pages=8).kv_split.normalize == "all" and norm.key.endswith("/all")
    with pytest.raises(PolicyError, match="normalize"):
        parse_policy(CHAT.replace("  enabled: true\n", "  enabled: true\n  normalize: some\n"))
    slots = parse_policy(CHAT.replace("  enabled: true\n", "  enabled: true\n  slots: 600\n"))
    assert slots.cache_config(SMOLLM2, num_pages=8).kv_split.slots == 600 and slots.key.endswith("/slots600")
    for bad in ("1", "2.5", "many"):
        with pytest.raises(PolicyError, match="kv_split.slots"):
            parse_policy(CHAT.replace("  enabled: true\n", f"  enabled: true\n  slots: {bad}\n"))
    capped = parse_policy(CHAT.replace(COVERAGE, "  mass: 0.001\n  top_k: 64\n  slots: 128\n"))
    rule = capped.cache_config(SMOLLM2, num_pages=8).kv_split
    assert (rule.mass, rule.top_k, rule.pages(1000)) == (0.001, 64, 64) and "+kvsplit@m0.001-64p/w512/slots128" in capped.key
    covered = parse_policy(CHAT.replace(COVERAGE, "  coverage: 0.99\n  top_k: 64\n"))
    rule = covered.cache_config(SMOLLM2, num_pages=8).kv_split
    assert (rule.coverage, rule.mass, rule.pages(1000)) == (0.99, None, 64) and "+kvsplit@c0.99-64p/w512" in covered.key
    for bad in ("  mass: 0.001\n" + COVERAGE, "  coverage: 1\n", "  coverage: 0\n"):  # with mass; out of range
        with pytest.raises(PolicyError, match="coverage"):
            parse_policy(CHAT.replace(COVERAGE, bad))
    host = parse_policy(CHAT.replace("  enabled: true\n", "  enabled: true\n  keys: int4\n  host_keys: true\n"))
    assert host.key.endswith("/k-int4+host")
    manager = CacheManager(host.cache_config(SMOLLM2, num_pages=8))  # the cache a server builds from it
    assert manager.split.exact and manager.pools["split"].codec.exact == manager.pools["main"].codec
    for bad in ("  host_keys: true\n", "  host_keys: yes please\n", "  keys: int4\n  normalize: all\n  host_keys: true\n"):
        with pytest.raises(PolicyError, match="host_keys"):
            parse_policy(CHAT.replace("  enabled: true\n", "  enabled: true\n" + bad))


def test_the_shipped_chat_rag_and_reasoning_policies_split_keys_and_values():
    policies = load_policies(POLICIES)
    for name in ("chat", "rag", "reasoning"):
        assert policies[name].kv_split is not None and policies[name].kv_split.enabled, name


