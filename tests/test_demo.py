"""`kvguard demo`: what each scenario policy saves (checked against the cache itself), what it
costs on the real model, with every alarming number explained."""

from __future__ import annotations

import math

import pytest
import torch

from kvguard.cache import CacheManager
from kvguard.cli import main
from kvguard.demo import savings
from kvguard.policy import load_policies
from kvguard.types import Subject
from tests.hf.conftest import one_thread, smollm2  # noqa: F401


@pytest.fixture(scope="module")
def policies():
    return load_policies("policies")


def filled(policy, n: int):
    """The stats of one real sequence of n tokens, one layer of SmolLM2's shape (bytes scale by layer)."""
    shape = savings.ModelShape(1, 3, 64, 9)
    m = CacheManager(policy.cache_config(shape, num_pages=2 * n // 16 + 8, num_hot_pages=2 * n // 16 + 8))
    seq = m.open(Subject("t", "u", "s"))
    g = torch.Generator().manual_seed(0)
    for lo in range(0, n, 16):  # page by page, attending as decode does, so evictors score and fire
        m.append(seq, 0, *(torch.randn(min(16, n - lo), 3, 64, generator=g).half() for _ in "kv"))
        m.attend(seq, 0, torch.randn(1, 9, 64, generator=g).half())
    return m.stats()


@pytest.mark.parametrize("name, n", [("chat", 600), ("code", 1200), ("offline-batch", 1200)])
def test_savings_agree_with_the_cache(policies, name, n):
    p = policies[name]
    kept, nbytes, pages = savings.held(p, n)
    st = filled(p, n)
    assert abs(st.tokens_held - kept) <= p.page_size  # an evictor compacts once past its budget by a page
    assert abs(sum(st.pages_used.values()) - pages) <= 1
    full = n * savings.full_bytes_per_token()
    assert math.isclose(1 - nbytes / full, st.saving, abs_tol=0.02), (1 - nbytes / full, st.saving)


def test_savings_only_demo(capsys, policies):
    assert main(["demo", "--no-model", "--no-sidecar"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split(" ")[0] in policies]
    assert len(rows) == len(policies)
    for row in rows:
        saved = [int(x.rstrip("%")) for x in row.split() if x.endswith("%") and x[0].isdigit()]
        assert saved and all(0 <= s < 100 for s in saved), row
    assert "23,040 B per token" in out and "tokens kept: an evictor drops tokens only once" in out


def test_demo_refuses_a_missing_policy_folder(tmp_path, capsys):
    assert main(["demo", "--policies", str(tmp_path / "none"), "--no-model", "--no-sidecar"]) == 1
    assert "no folder" in capsys.readouterr().err


def test_the_split_policies_hold_old_tokens_keys_only_on_the_gpu(policies):
    table = {r[0]: r for r in savings.rows(policies)}
    def gpu(name):
        return float(table[name][3].split()[0].replace(",", ""))

    def codec(name):
        return float(table[name][2].split()[0].replace(",", ""))

    assert gpu("code") == codec("code")  # no split: the whole page on the GPU
    # chat: INT8 keys and their scales, not the values (about half of INT8's page); reasoning: INT4 keys
    assert 0.45 < gpu("chat") / codec("chat") < 0.55 and gpu("rag") == gpu("chat")
    assert 0.3 < gpu("reasoning") / codec("reasoning") < 0.4


def test_the_shipped_report_is_told_with_the_length_each_policy_was_measured_at(policies, capsys):
    from kvguard.demo.fidelity import _explain_eviction

    _explain_eviction([policies[k] for k in ("chat", "rag", "reasoning")], 80)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if "deviation (worst text)" in line}
    # chat and rag were measured with their evictors firing (as long as their budgets), reasoning was not
    assert "at 4,096+256 -> downgraded to" in lines["chat"] and "at 6,144+256 -> accepted" in lines["rag"]
    assert lines["reasoning"].endswith("-> refused (its evictor never fired)") and " at " not in lines["reasoning"]


@pytest.mark.slow
def test_fidelity_part_explains_what_looks_alarming(smollm2, one_thread, policies, capsys):  # noqa: F811
    from kvguard.demo.fidelity import show_fidelity

    show_fidelity({k: policies[k] for k in ("code", "offline-batch")}, prefix=48, score=32)
    out = capsys.readouterr().out
    assert "code " in out and "offline-batch " in out and "(evictor idle)" in out
    assert "Eviction at this length: 80 tokens are below the smallest budget (1,024)" in " ".join(out.split())
    # the shipped report's numbers for the evictors, and why they are large, and what the gate does
    assert "code           deviation (worst text)" in out and "downgraded to" in out
    assert "Why an evictor's deviation is large" in out and "fidelity gate" in out
