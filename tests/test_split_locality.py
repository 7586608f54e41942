"""benchmarks/fidelity/split_locality.py: the K/V split's picks as a decode step makes them, and what repeats."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.fidelity import split_locality as loc
from kvguard.cache.config import KVSplit

ROOT = Path(__file__).resolve().parents[1]


def test_picks_are_each_steps_top_pages_by_their_largest_head_share():
    g = torch.Generator().manual_seed(3)
    t, h, grp, d, window = 200, 2, 3, 8, 32
    q, k = torch.randn(t, h * grp, d, generator=g), torch.randn(t, h, d, generator=g)
    rule = KVSplit(window=window, fraction=0.3)
    got = loc.layer_picks(q, k, 0.5, [rule], queries=5, window=window)[0]
    for j, pos in enumerate(range(t - 5, t)):
        n = pos + 1
        cold = (n - window) // loc.PAGE
        want = math.ceil(0.3 * cold)
        best = []
        for p in range(cold):  # a page's mass, the largest over every query head (each of its own KV head)
            heads = []
            for hq in range(h * grp):
                probs = torch.softmax(k[:n, hq // grp] @ q[pos, hq] * 0.5, dim=0)
                heads.append(float(probs[p * loc.PAGE:(p + 1) * loc.PAGE].sum()))
            best.append(max(heads))
        assert got[j] == set(sorted(range(cold), key=lambda p: -best[p])[:want])


def test_an_lru_device_cache_serves_what_it_still_holds():
    steps = [{1, 2}, {2, 3}, {1}, {3}]
    # 2 slots: {1,2} -> 2 hits, holds {2,3} -> 1 misses, holds {3,1} -> 3 hits
    assert loc.lru_hits(steps, 2) == (2, 6)
    assert loc.lru_hits(steps, 3) == (3, 6)  # {1,2,3} held from the second step on
    # a ring of 2: {1,2} -> 2 hits, 3 replaces 1 -> 1 misses, replaces 2 -> 3 hits
    assert loc.ring_hits(steps, 2) == (2, 6)
    assert loc.ring_hits([{1, 2}, {1, 3}, {1}], 2) == (1, 5)  # 1 was read again, yet went first
    assert loc.lru_hits([{1, 2}, {1, 3}, {1}], 2) == (2, 5)


def test_the_cache_s_own_slots_give_a_page_read_again_a_second_chance():
    assert loc.built_hits([{1, 2}, {1, 2}, {3}], 4) == (2, 5)
    # 1 is read again at the third step, so the fourth step's copies pass over its slot, where
    # a plain ring takes it
    steps = [{1, 2}, {3, 4}, {1, 5}, {6, 7}, {1}]
    assert loc.built_hits(steps, 4) == (2, 9)
    assert loc.ring_hits(steps, 4) == (1, 9)
    assert loc.built_hits([{1, 2}, {1, 2}], 3) == (0, 4)  # fewer than twice a step's picks: nothing served


def test_shares_of_picks_that_repeat():
    same = [[{1, 2, 3}] * 4 for _ in range(3)]  # [layer][step]
    r = loc.measure(same, [1])
    assert r["step"] == r["layer"] == 1.0 and r["slots"]["lru", 1] == r["slots"]["ring", 1] == 0.75
    moving = [[{s, s + 1} for s in range(4)] for _ in range(2)]
    r = loc.measure(moving, [1, 2])
    assert r["step"] == 0.5 and r["layer"] == 1.0
    assert r["slots"]["lru", 1] == r["slots"]["lru", 2] == r["slots"]["ring", 2] == 3 / 8


@pytest.mark.slow
def test_split_locality_runs_on_smollm2():
    r = subprocess.run([sys.executable, "benchmarks/fidelity/split_locality.py", "--texts", "stdlib-code", "--tokens", "328",
                        "--queries", "8", "--window", "64", "--fractions", "0.1,1", "--slots", "2", "--threads", "1"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x[1].strip(): x for x in (line.split("|") for line in r.stdout.splitlines()) if len(x) == 9}
    assert rows["1"][2].strip() == "16"  # every cold page, (328 - 64) // 16, at each of the 8 steps
    every = [float(c.split()[0]) for c in rows["1"][3:8]]
    assert every == [1.0, 1.0, 0.88, 0.88, 0.88]  # reading every page every read repeats; the cache misses the first step
    assert 0 < float(rows["0.1"][3].split()[0]) < 1


@pytest.mark.slow
def test_split_slots_bytes_runs_through_the_cache():
    """benchmarks/fidelity/split_slots_bytes.py on a short context and the model's first four layers (the
    kernels interpreted: all 30 take minutes): the slots read fewer bytes over the bus after the
    first step, and the outputs are those without slots, bit for bit."""
    r = subprocess.run([sys.executable, "benchmarks/fidelity/split_slots_bytes.py", "--text", "stdlib-code", "--tokens", "192",
                        "--steps", "3", "--window", "32", "--fraction", "0.25", "--slots", "4", "--layers", "4"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [x for x in (line.split("|") for line in r.stdout.splitlines()) if len(x) == 8 and x[1].strip()[0] in "n4"]
    assert [x[1].strip().split()[0] for x in rows] == ["none", "4"]
    none, slots = ([float(c) for c in x[2:6]] for x in rows)
    assert slots[2] == none[2] > 0  # the first step: nothing held yet
    assert slots[3] < none[3]  # later steps: what the slots held did not cross the bus
    assert all(float(x[6]) == 0 for x in rows)
    assert "SmolLM2-135M (4 layers), stdlib-code, 192 tokens then 3 decode steps" in r.stdout
