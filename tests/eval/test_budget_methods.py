"""The budget methods: named, each its own configuration, measured only when asked for."""

from __future__ import annotations

from kvguard.eval.methods import builtin_methods


def test_budget_methods_are_distinct_configurations_run_only_when_named():
    methods = builtin_methods(512)
    budget = {n: m for n, m in methods.items() if not m.default and m.kind != "split"}
    assert {"h2o-value", "snapkv-value-prefix", "h2o-pyramid-prefix", "snapkv-adaptive-prefix",
            "h2o-global-value-prefix", "snapkv-pyramid-adaptive-prefix"} <= set(budget)
    keys = [m.key for m in methods.values()]
    assert len(keys) == len(set(keys))  # none is taken for another and measured once under its name
    for name, m in budget.items():
        options = m.options["evictor_options"]
        assert options["budget"] == 512
        assert (m.kind == "simulation") == m.per_head == ("allocation" in options)
        assert m.evict_prefix_only or name.endswith("-value")
        assert name.endswith("-value-prefix") or name.endswith("-value") or options.get("scoring") == "mass"
    split = {n for n, m in methods.items() if not m.default and m.kind == "split"}
    # the other normalization, and INT8 pages with the split's keys INT8 or INT4, only when named
    assert split == {f"{name}@{f}" for f in (5, 10, 25, 50) for name in ("kvsplit-all", "int8+kvsplit", "int8+kvsplit4")}
    for f in (5, 10, 25, 50):
        assert methods[f"int8+kvsplit4@{f}"].options == {"codec": "int8", "kv_split": {
            "window": 128, "fraction": f / 100, "keys": "int4"}}
        assert "keys" not in methods[f"int8+kvsplit@{f}"].options["kv_split"]
    assert methods["h2o-adaptive-prefix"].options["evictor_options"]["window"] == 256  # h2o's half and half
