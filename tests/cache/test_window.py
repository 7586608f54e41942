"""Sliding-window layers: pages out of the window freed and recorded, reads masked to the window,
and a model of window and global layers cached apart (kvguard/cache/window.py, layered.py)."""

import pytest
import torch

from kvguard.cache import CacheConfig, CacheManager, LayeredManager, open_manager
from kvguard.cache.attention import dense_attention
from kvguard.errors import ConfigError
from kvguard.types import Subject

H, HQ, D, S, W = 1, 4, 8, 4, 10
WINDOWS = (W, None, W)


def _cfg(codec="fp16", **kw):
    return CacheConfig(num_layers=3, num_kv_heads=H, head_dim=D, num_query_heads=HQ, page_size=S, num_pages=64,
                       dtype=torch.float32, codec=codec, layer_windows=WINDOWS, **kw)


@pytest.mark.parametrize("codec,tol", [("fp16", 1e-5), ("int8", 0.2)])
def test_window_layers_read_their_window_and_hold_at_most_window_plus_a_page(codec, tol):
    torch.manual_seed(0)
    m = open_manager(_cfg(codec))
    assert isinstance(m, LayeredManager)
    seq = m.open(Subject("t", "u", "s"))
    n, t0 = 48, 7
    k, v, q = torch.randn(n, H, D), torch.randn(n, H, D), torch.randn(n, HQ, D)

    def ref(lo, hi, layer):
        return dense_attention(q[lo:hi], k[:hi].transpose(0, 1), v[:hi].transpose(0, 1), window=WINDOWS[layer])[0]

    for layer in range(3):
        m.append(seq, layer, k[:t0], v[:t0])
        assert (m.attend(seq, layer, q[:t0]) - ref(0, t0, layer)).abs().max() < tol
    for i in range(t0, n):
        for layer in range(3):
            m.append_step([seq], layer, k[i:i + 1], v[i:i + 1])
            assert (m.attend_step([seq], layer, q[i:i + 1]) - ref(i, i + 1, layer)).abs().max() < tol
        assert m.length(seq, 0) <= W + S and m.length(seq, 1) == i + 1
    window_pages, global_pages = (sum(m.parts[w].stats().pages_used.values()) for w in (W, None))
    assert window_pages <= (W + S) // S + 1 and global_pages == n // S
    assert sum(m.stats().pages_used.values()) == window_pages + global_pages  # summed pool by pool
    evicts = [e for e in m.events.take_events() if e.op == "evict"]
    assert evicts and all(e.reason == "window" and e.details()["reason"] == "window" for e in evicts)
    assert all(p.startswith("window10-") for e in evicts for p in e.pages)
    assert sum(e.n_tokens for e in evicts) == n - m.length(seq, 0)


def test_free_and_erase_are_one_event_over_both_parts():
    m = open_manager(_cfg())
    a, b = m.open(Subject("t", "u", "s")), m.open(Subject("t", "u", "s2"))
    for seq in (a, b):
        for layer in range(3):
            m.append(seq, layer, torch.randn(9, H, D), torch.randn(9, H, D))
    m.events.take_events()
    m.free(a)
    (freed,) = m.events.take_events()
    assert freed.op == "free" and len(freed.pages) == 6  # 3 pages in each part
    erased = m.erase_user("t", "u")
    assert [e.op for e in m.events.take_events()] == ["erase"]
    assert erased.sequences == 1 and len(erased.pages) == 6 and m.sequences() == []


def test_a_window_cache_alone_and_what_it_refuses():
    same = open_manager(CacheConfig(num_layers=2, num_kv_heads=H, head_dim=D, layer_windows=(W, W)))
    assert isinstance(same, CacheManager) and same.cfg.window == W and not same.cfg.use_kernels
    with pytest.raises(ConfigError, match="open_manager"):
        CacheManager(_cfg())
    with pytest.raises(ConfigError, match="no evictor"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, window=W, evictor="h2o")
    with pytest.raises(ConfigError, match="layer_windows"):
        CacheConfig(num_layers=2, num_kv_heads=1, head_dim=8, layer_windows=(W,))
    # the global part keeps the evictor; the window part has none
    m = open_manager(_cfg(evictor="streamingllm", evictor_options={"budget": 32, "sink": 4, "window": 16}))
    assert m.parts[None].evictor is not None and m.parts[W].evictor is None


def test_the_bytes_per_token_table_of_docs_models_is_the_script_s():
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = runpy.run_path(str(root / "benchmarks" / "cache" / "window_bytes.py"))
    doc = (root / "docs" / "models.md").read_text()
    for model in script["MODELS"]:
        for tokens in (8192, 32768):
            for codec in ("fp16", "int8"):
                r = script["count"](model, tokens, codec)
                row = (f"| {model} | {tokens} | {codec} | {r['bytes_per_token_whole']:,.0f} | "
                       f"{r['bytes_per_token_windowed']:,.0f} | {r['saving']:.1%} |")
                assert row in doc, row
