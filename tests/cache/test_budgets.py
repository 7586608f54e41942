"""Evictor budgets split over layers and heads (pyramid, adaptive) and value-aware scores."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager
from kvguard.compress.evictors import make_evictor
from kvguard.compress.evictors.allocation import SAFEGUARD, adaptive, pyramid
from kvguard.errors import ConfigError


@pytest.mark.parametrize(("middle", "layers", "cap"), [(124, 30, 892), (252, 30, 764), (10, 7, 12), (0, 4, 9),
                                                       (5, 1, 5), (30, 5, 30), (7, 3, 100)])
def test_pyramid_sums_to_the_total_and_falls_with_depth(middle, layers, cap):
    counts = pyramid(middle, layers, cap)
    assert len(counts) == layers and sum(counts) == middle * layers
    assert all(0 <= c <= cap for c in counts)
    assert all(a >= b for a, b in itertools.pairwise(counts))  # monotone: lower layers keep more
    if middle and layers > 1 and middle < cap:
        assert counts[0] > middle > counts[-1]


def test_pyramid_follows_pyramidkv_endpoints():
    counts = pyramid(200, 11, 10_000)
    assert counts[0] == 390 and counts[-1] == 10  # 2m - m/20 and m/20


def test_pyramid_refuses_a_middle_over_its_cap():
    with pytest.raises(ValueError, match="middle budget"):
        pyramid(10, 3, 9)


def test_adaptive_sums_to_the_total_and_gives_more_to_diffuse_heads():
    n = 100
    concentrated = torch.full((n,), 0.001)
    concentrated[[3, 50]] = 10.0  # nearly all mass on two keys
    diffuse = torch.full((n,), 0.2)  # spread over every key
    scores = torch.stack([concentrated, diffuse, 0.1 * torch.rand(n, generator=torch.Generator().manual_seed(1))])
    counts = adaptive(scores, 3 * 20)
    assert counts.sum() == 60
    assert counts[1] > 20 > counts[0]
    assert counts[0] >= int(SAFEGUARD * 20)  # the safeguard share
    assert adaptive(torch.ones(2, 5), 10).tolist() == [5, 5]
    with pytest.raises(ValueError, match="does not fit"):
        adaptive(torch.ones(2, 5), 11)


def _mass(layers, heads, length, seed):
    g = torch.Generator().manual_seed(seed)
    # heads differ in how concentrated their mass is
    temps = torch.linspace(0.2, 3.0, layers * heads).reshape(layers, heads, 1)
    return torch.softmax(torch.randn(layers, heads, length, generator=g) / temps, -1) * length


@pytest.mark.parametrize("name", ["h2o", "snapkv"])
@pytest.mark.parametrize("allocation", ["uniform", "pyramid", "adaptive", "pyramid-adaptive", "global"])
@pytest.mark.parametrize("scoring", ["mass", "value_aware"])
def test_every_allocation_keeps_the_same_total_with_sinks_and_window(name, allocation, scoring):
    layers, heads, length, budget, sink, window = 6, 3, 200, 48, 4, 16
    e = make_evictor(name, budget=budget, sink=sink, window=window, allocation=allocation, scoring=scoring)
    mass = _mass(layers, heads, length, seed=2)
    values = torch.rand(layers, heads, length, generator=torch.Generator().manual_seed(3)) + 0.5
    keeps = e.keep_masks(length, mass, values)
    if allocation != "global":  # layer by layer, as keep_masks does
        assert torch.equal(keeps, torch.stack([e.keep_mask(length, mass[i], i, layers, values[i])
                                               for i in range(layers)]))
    assert keeps.shape == (layers, heads, length)
    assert keeps.sum() == layers * heads * budget
    assert keeps[..., :sink].all() and keeps[..., length - window :].all()
    per_layer = keeps.sum((1, 2)).tolist()
    if allocation.startswith("pyramid"):
        assert all(a >= b for a, b in itertools.pairwise(per_layer)) and per_layer[0] > per_layer[-1]
    elif allocation == "global":  # layers whose mass leaves the sinks and window more keep more
        assert len(set(per_layer)) > 1
    else:
        assert per_layer == [heads * budget] * layers
    per_head = keeps.sum(-1)
    assert (per_head.amax(1) > per_head.amin(1)).any() == (allocation in ("adaptive", "pyramid-adaptive", "global"))
    assert per_head.min() >= sink + window + int(0.2 * (budget - sink - window)) or allocation.startswith("pyramid")
    if allocation == "uniform":  # the simulation keeps what the cache's select keeps
        chosen = e.select(length, mass, values)
        assert torch.equal(keeps, torch.zeros_like(keeps).scatter_(-1, chosen, True))


def test_a_sequence_within_budget_keeps_everything():
    e = make_evictor("h2o", budget=48, sink=4, window=16, allocation="pyramid")
    assert e.keep_mask(40, torch.rand(2, 40), 0, 4).all()


def test_value_aware_scoring_prefers_keys_whose_values_matter():
    length = 64
    mass = torch.ones(2, length)
    mass[:, 10:20] = 2.0  # the most attended keys...
    values = torch.ones(2, length)
    values[:, 10:20] = 0.01  # ...have values near zero
    values[:, 30:40] = 1.5
    by_mass = make_evictor("h2o", budget=30, sink=4, window=16).select(length, mass)
    by_value = make_evictor("h2o", budget=30, sink=4, window=16, scoring="value_aware").select(length, mass, values)
    middle = set(range(4, 48))
    assert set(by_mass[0].tolist()) & middle == set(range(10, 20))
    assert set(by_value[0].tolist()) & middle == set(range(30, 40))
    with pytest.raises(ValueError, match="norms"):
        make_evictor("h2o", budget=30, sink=4, window=16, scoring="value_aware").select(length, mass)


@pytest.mark.parametrize(("name", "options", "match"), [
    ("h2o", {"allocation": "triangle"}, "allocation must be one of"),
    ("h2o", {"scoring": "norm"}, "scoring must be one of"),
    ("streamingllm", {"scoring": "value_aware"}, "score by attention mass"),
    ("streamingllm", {"allocation": "pyramid"}, "score by attention mass"),
    ("snapkv", {"allocation": "adaptive", "per_head": False}, "needs per_head"),
])
def test_bad_budget_options_are_refused(name, options, match):
    with pytest.raises(ConfigError, match=match):
        make_evictor(name, budget=48, sink=4, window=16, **options)


def test_uniform_select_refuses_an_unequal_allocation():
    with pytest.raises(ValueError, match="keep_mask"):
        make_evictor("h2o", budget=48, sink=4, window=16, allocation="pyramid").select(100, torch.rand(2, 100))


def _manager(**evictor_options):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_query_heads=4, num_pages=64, codec="fp16",
                      evictor="h2o", auto_compact=False,
                      evictor_options={"budget": 48, "sink": 4, "window": 16} | evictor_options)
    return CacheManager(cfg)


def test_the_cache_refuses_an_allocation_it_cannot_store():
    with pytest.raises(ConfigError, match="not stored by the cache"):
        _manager(allocation="adaptive")


@pytest.mark.parametrize("scoring", ["mass", "value_aware"])
def test_value_aware_compaction_keeps_the_large_values(scoring, alice):
    """Keys all alike (every query attends evenly): H2O's accumulated mass favours the
    earliest positions; scored by mass × ‖v‖ the positions with large values survive."""
    m = _manager(scoring=scoring)
    seq = m.open(alice)
    n = 120
    k = torch.zeros(n, 2, 64, dtype=torch.float16)
    v = torch.randn(n, 2, 64, generator=torch.Generator().manual_seed(4)).half() * 0.1
    big = list(range(60, 88))  # 28 = the middle of the budget (48 - 4 - 16)
    v[big] *= 50
    q = torch.randn(n, 4, 64, generator=torch.Generator().manual_seed(5)).half()
    for layer in range(2):
        m.append(seq, layer, k, v)
        m.attend(seq, layer, q)
    assert m.compact(seq).kept == 48
    _, vv = m.kv(seq, 0)
    kept = [j for j in range(n) if any(torch.equal(vv[0, i], v[j, 0]) for i in range(48))]
    want = big if scoring == "value_aware" else list(range(4, 32))
    assert kept == list(range(4)) + want + list(range(n - 16, n))


def test_global_allocation_gives_more_to_the_layer_whose_attention_is_spread():
    length = 120
    mass = torch.zeros(2, 1, length)
    mass[0, 0, :4] = 100.0  # layer 0 attends to its sinks
    mass[0, 0, 4:] = 0.01
    mass[1, 0] = 1.0  # layer 1 everywhere
    e = make_evictor("h2o", budget=40, sink=4, window=16, allocation="global")
    kept = e.keep_masks(length, mass).sum(-1).flatten().tolist()
    assert sum(kept) == 80 and kept[1] > 40 > kept[0]
    with pytest.raises(ValueError, match="keep_masks"):
        e.keep_mask(length, mass[0], 0, 2)
