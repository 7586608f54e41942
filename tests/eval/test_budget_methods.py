"""The budget methods: named, each its own configuration, measured only when asked for."""

from __future__ import annotations

import torch

from kvguard.eval.methods import builtin_methods


def test_budget_methods_are_distinct_configurations_run_only_when_named():
    methods = builtin_methods(512)
    budget = {n: m for n, m in methods.items() if not m.default and m.kind != "split" and not n.endswith("-pages")}
    assert {"h2o-value", "snapkv-value-prefix", "h2o-pyramid-prefix", "snapkv-adaptive-prefix",
            "h2o-global-value-prefix", "snapkv-pyramid-adaptive-prefix"} <= set(budget)
    keys = [m.key for m in methods.values()]
    assert len(keys) == len(set(keys))  # none is taken for another and measured once under its name
    for name, m in budget.items():
        options = m.options["evictor_options"]
        assert options["budget"] == 512
        assert (m.kind == "simulation") == m.per_head == ("allocation" in options or m.merge)
        assert m.merge == name.endswith("-merge-prefix")
        assert m.evict_prefix_only or name.endswith("-value")
        assert name.endswith(("-value-prefix", "-value", "-value-merge-prefix")) or options.get("scoring") == "mass"
    for name in ("h2o", "snapkv"):  # each head's whole pages dropped first: the same evictor otherwise
        paged = methods[f"{name}-pages"]
        assert not paged.default and not paged.evict_prefix_only and paged.kind == "evictor"
        assert paged.options["evictor_options"] == {**methods[name].options["evictor_options"], "granularity": "page"}
        assert paged.key.endswith("/pages")
    split = {n for n, m in methods.items() if not m.default and m.kind == "split"}
    # the other normalization, Quest's bound (alone, and as a first cut before exact scores), and
    # INT8 pages with the split's keys INT8 or INT4, only when named
    assert split == ({f"{name}@{f}" for f in (5, 10, 25, 50) for name in ("kvsplit-all", "kvsplit-bound",
                                                                         "kvsplit-bound-r4", "kvsplit-bound-r8")}
                     | {f"{name}@{f}" for f in (5, 10, 25, 50, 100)
                        for name in ("int8+kvsplit", "int8+kvsplit4", "int8-rot+kvsplit4", "int8+kvsplit4h",
                                     "int8-rot+kvsplit4h")})
    for f in (5, 10, 25, 50):
        assert methods[f"kvsplit-bound@{f}"].options["kv_split"] == {"window": 128, "fraction": f / 100,
                                                                      "score": "bound"}
        assert methods[f"kvsplit-bound-r4@{f}"].options["kv_split"] == {"window": 128, "fraction": f / 100,
                                                                         "score": "bound", "rerank": 4}
        assert methods[f"kvsplit-bound-r4@{f}"].key.endswith("/bound-r4")
    for f in (5, 10, 25, 50, 100):
        assert methods[f"int8+kvsplit4@{f}"].options == {"codec": "int8", "fp_sink": 4, "kv_split": {
            "window": 128, "fraction": f / 100, "keys": "int4"}}
        assert methods[f"int8-rot+kvsplit4@{f}"].options["codec_options"] == {"rotate": True}
        assert "keys" not in methods[f"int8+kvsplit@{f}"].options["kv_split"]
        assert methods[f"int8+kvsplit4h@{f}"].options["kv_split"] == {"window": 128, "fraction": f / 100,
                                                                      "keys": "int4", "host_keys": True}
        assert methods[f"int8-rot+kvsplit4h@{f}"].key.endswith("/k-int4+host")
    assert methods["h2o-adaptive-prefix"].options["evictor_options"]["window"] == 256  # h2o's half and half


def test_merge_values_by_key_similarity_and_mass():
    """Each evicted token's value joins the kept token whose key is most like its own, weighted by
    mass; a kept token nothing joined keeps its value; each head on its own."""
    from kvguard.eval.headwise import merge_values

    k = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, 0.1], [0.1, 3.0], [0.0, -1.0]]])  # one head, 5 tokens
    v = torch.tensor([[[1.0], [10.0], [3.0], [20.0], [7.0]]])
    mass = torch.tensor([[1.0, 2.0, 1.0, 2.0, 5.0]])
    keep = torch.tensor([[True, True, False, False, True]])
    got = merge_values(k, v, mass, keep)
    assert torch.allclose(got[0, :, 0], torch.tensor([(1 + 3) / 2, (20 + 40) / 4, 3.0, 20.0, 7.0]))
    two = merge_values(torch.cat([k, k]), torch.cat([v, 2 * v]), torch.cat([mass, mass]),
                       torch.cat([keep, torch.ones_like(keep)]))
    assert torch.equal(two[0], got[0]) and torch.equal(two[1], 2 * v[0])  # all kept: unchanged
