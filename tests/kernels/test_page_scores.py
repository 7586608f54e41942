"""The K/V split's score pass: each page's log-sum-exp of a decode query's logits, every codec."""

from __future__ import annotations

import pytest
import torch
from kvguard.kernels import quantize as ref
from kvguard.kernels._checks import KernelArgError
from kvguard.kernels.page_scores import page_lse, page_lse_ref

from .conftest import DEVICE


def pages_of(codec: str, p: int, h: int, s: int, d: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(p, h, s, d, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    v = torch.randn(p, h, s, d, generator=g)
    if codec == "16bit":
        f = {"k": k.half(), "v": v.half()}
    elif codec == "int4":
        f = ref.encode_int4(k, v)
    else:
        f = ref.encode_int8(k, v, dtype=torch.float8_e4m3fn if codec == "fp8" else torch.int8)
    return {n: t.contiguous().to(DEVICE) for n, t in f.items()}


@pytest.mark.parametrize("codec", ["16bit", "int8", "fp8", "int4"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_page_lse_matches_the_dense_reference(codec, group):
    h, s, d = 2, 16, 64
    pages = pages_of(codec, 24, h, s, d)
    q = torch.randn(3, h * group, d, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    # rows of 11 pages, a partial last page, and none at all
    table = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))[:11] for i in range(3)])
    table = table.int().to(DEVICE)
    lens = torch.tensor([11 * s, 5 * s + 3, 0], dtype=torch.int32, device=DEVICE)
    got, want = page_lse(q, pages, table, lens), page_lse_ref(q, pages, table, lens)
    assert got.shape == (3, h * group, 11)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)  # -inf exactly past each row's tokens
    assert finite[:2, :, :6].all() and not finite[1, :, 6:].any() and not finite[2].any()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-3, atol=2e-3)
    # the pages' lse combine to the whole softmax's normalizer
    total = torch.logsumexp(got[0], dim=-1)
    torch.testing.assert_close(total, torch.logsumexp(want[0], dim=-1), rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("codec", ["16bit", "int8"])
@pytest.mark.parametrize("group, rows", [(4, 37), (3, 5), (1, 70)])
def test_page_lse_of_rows_sharing_their_pages_reads_them_once_for_many(codec, group, rows):
    """A chunk's queries over one sequence's pages (an expanded table and length), several rows
    a program: the same scores as one row a program, a last program with fewer rows included."""
    h, s, d = 2, 16, 64
    pages = pages_of(codec, 24, h, s, d)
    q = torch.randn(rows, h * group, d, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    table = torch.randperm(24, generator=torch.Generator().manual_seed(5))[:13].int().to(DEVICE)[None].expand(rows, -1)
    lens = torch.full((rows,), 12 * s + 7, dtype=torch.int32, device=DEVICE)
    got = page_lse(q, pages, table, lens, shared=True)
    want = page_lse(q, pages, table.contiguous(), lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, page_lse_ref(q, pages, table, lens), rtol=1e-3, atol=2e-3)


def test_page_lse_refuses_bad_input():
    pages = pages_of("int8", 4, 2, 16, 64)
    q = torch.randn(1, 4, 64).half().to(DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelArgError):
        page_lse(q.float(), pages, table, lens)  # queries must be 16-bit
    with pytest.raises(KernelArgError):
        page_lse(torch.randn(1, 3, 64).half().to(DEVICE), pages, table, lens)  # 3 heads over 2 KV heads
    with pytest.raises(KernelArgError):
        page_lse(q, pages, table.float(), lens)


def test_joined_totals_refuse_a_buffer_of_another_shape():
    from kvguard.kernels.page_pick import join_totals

    for bad in (torch.zeros(8), torch.zeros(6, 3, 2), torch.zeros(8, 3, 3), torch.zeros(8, 3, 2, dtype=torch.float64),
                torch.zeros(8, 2, 3).transpose(1, 2)):
        with pytest.raises(KernelArgError, match="part must be"):
            join_totals(bad.to(DEVICE), 2, 4)


def test_a_tuning_configuration_gives_the_same_scores():
    pages = pages_of("int8", 40, 2, 16, 64)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    table = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(i))[:37] for i in range(2)])
    lens = torch.tensor([37 * 16, 20 * 16 + 1], dtype=torch.int32, device=DEVICE)
    table = table.int().to(DEVICE)
    want = page_lse(q, pages, table, lens)
    # the decode step's pass: other tiles, unpeeled loops, one split and many short ones (a
    # split's slots past the row's tokens written -inf without a read); the block layout
    for config in ({"pages": 16, "num_warps": 2, "num_stages": 2}, {"pages": 4, "peel": False},
                   {"programs_per_sm": 1, "min_steps": 64}, {"pages": 1, "min_steps": 1, "programs_per_sm": 64},
                   {"transposed": False, "pages": 8, "num_warps": 4}, {"transposed": False, "pages": 4, "iters": 3}):
        got = page_lse(q, pages, table, lens, config=config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.isinf(got[1, :, 21:]).all() and torch.isfinite(got[1, :, :21]).all()


@pytest.mark.parametrize("config", [None, {"programs_per_sm": 64, "min_steps": 1}, {"transposed": False}])
def test_page_lse_sets_scores_every_set_and_joins_the_normalizer(config):
    """Two pools of different codecs (a split's and a window's) side by side in the order given,
    and the softmax's normalizer over both: from the slices' partial sums (the decode step's
    pass, few splits and many) or summed over the scores (the block layout); a row of no tokens
    at all has -inf."""
    from kvguard.kernels.page_scores import page_lse_sets

    h, s, d = 2, 16, 64
    split, window = pages_of("int8", 40, h, s, d, seed=3), pages_of("16bit", 8, h, s, d, seed=4)
    q = torch.randn(3, h * 4, d, generator=torch.Generator().manual_seed(6)).half().to(DEVICE)
    t1 = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(i))[:29] for i in range(3)])
    t2 = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(9 + i))[:3] for i in range(3)])
    t1, t2 = t1.int().to(DEVICE), t2.int().to(DEVICE)
    l1 = torch.tensor([29 * s, 17 * s + 5, 0], dtype=torch.int32, device=DEVICE)
    l2 = torch.tensor([2 * s + 9, 3 * s, 0], dtype=torch.int32, device=DEVICE)
    scores, total = page_lse_sets(q, [(split, t1, l1), (window, t2, l2)], config=config)
    want = torch.cat([page_lse_ref(q, split, t1, l1), page_lse_ref(q, window, t2, l2)], dim=-1)
    assert scores.shape == (3, 8, 32)
    assert torch.equal(torch.isfinite(scores), torch.isfinite(want))
    torch.testing.assert_close(scores[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(total[:2], torch.logsumexp(want[:2], dim=-1), rtol=1e-4, atol=2e-3)
    assert torch.isneginf(total[2]).all()
    # a pool the rows hold no page of yet: no slices, so the normalizer is summed over the scores
    empty = torch.zeros(3, 0, dtype=torch.int32, device=DEVICE)
    scores, again = page_lse_sets(q, [(split, t1, l1), (window, empty, l2 * 0)], config=config)
    assert scores.shape == (3, 8, 29)
    torch.testing.assert_close(again[:2], torch.logsumexp(want[:2, :, :29], dim=-1), rtol=1e-4, atol=2e-3)


def scores_of(b: int, hq: int, n: int, lens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """page_lse-like scores [B, Hq, n] (-inf past each row's pages) and their normalizer."""
    s = torch.randn(b, hq, n, generator=torch.Generator().manual_seed(seed)) * 3
    for i, m in enumerate(lens):
        s[i, :, m:] = float("-inf")
    return s.to(DEVICE), torch.logsumexp(s, dim=-1).to(DEVICE)


def test_page_pick_takes_the_pages_of_largest_mass():
    from kvguard.kernels.page_pick import page_pick

    from kvguard.cache.picks import covering

    b, hq, n = 4, 6, 700
    lens = [700, 450, 3, 0]
    scores, total = scores_of(b, hq, n, lens)
    table = torch.stack([torch.randperm(5000, generator=torch.Generator().manual_seed(i))[:n] for i in range(b)])
    table = table.int().to(DEVICE)
    mass = torch.exp(scores - total[..., None]).amax(dim=1).cpu().nan_to_num(0.0)  # [B, n] (a row of none: 0)
    want = torch.tensor([37, 450, 2, 0], dtype=torch.int32, device=DEVICE)
    t = float(mass[0].median())
    # one program a row in several steps of its loops and in one, its k-th largest by digits and
    # by bisection; many programs a row, three blocks of a row and one
    for config in (None, {"block": 256, "num_warps": 4}, {"select": "bisect"},
                   {"select": "bisect", "block": 256, "num_warps": 4}, {"many_from": 1, "many_block": 256},
                   {"many_from": 1}):
        chosen, count = page_pick(scores, total, table, 450, want, config=config)
        assert count.tolist() == want.tolist()
        for i in range(b):
            k = int(want[i])
            expect = set(table[i, mass[i].topk(k).indices.to(DEVICE)].tolist()) if k else set()
            assert set(chosen[i, :k].tolist()) == expect
            slots = (table[i, :, None] == chosen[i, None, :k]).any(dim=1).nonzero().flatten()
            assert torch.equal(chosen[i, :k], table[i, slots])  # in slot order
        # the mass rule: every page whose mass reaches the threshold, in slot order
        chosen, count = page_pick(scores, total, table, n, threshold=t, config=config)
        for i in range(b):
            slots = (mass[i] >= t).nonzero().flatten().to(DEVICE)
            assert int(count[i]) == len(slots) and torch.equal(chosen[i, :len(slots)], table[i, slots])
        assert int(count[3]) == 0 and int(count[0]) >= n // 2
        # the mass rule capped: of the want[b] pages of largest mass, those reaching the threshold
        chosen, count = page_pick(scores, total, table, 450, want, threshold=t, config=config)
        for i in range(b):
            k = int(want[i])
            top = mass[i].topk(k).indices if k else torch.zeros(0, dtype=torch.long)
            slots = top[mass[i][top] >= t].sort().values.to(DEVICE)
            assert int(count[i]) == len(slots) and torch.equal(chosen[i, :len(slots)], table[i, slots])
        assert 0 < int(count[1]) < int(want[1])  # the threshold cut into row 1's 450
        # coverage: every page but those of least mass whose masses sum to at most 1 - coverage
        # (picks.covering, the reference path's), alone and capped at want[b]
        for cov in (0.5, 0.99):
            keep = covering(mass, 1 - cov)
            chosen, count = page_pick(scores, total, table, n, coverage=cov, config=config)
            capped, ccount = page_pick(scores, total, table, 450, want, coverage=cov, config=config)
            for i in range(b):
                slots = keep[i].nonzero().flatten().to(DEVICE)
                assert int(count[i]) == len(slots) and torch.equal(chosen[i, :len(slots)], table[i, slots])
                k = int(want[i])
                top = mass[i].topk(k).indices if k else torch.zeros(0, dtype=torch.long)
                slots = top[keep[i][top]].sort().values.to(DEVICE)
                assert int(ccount[i]) == len(slots) and torch.equal(capped[i, :len(slots)], table[i, slots])
            assert 0 < int(count[0]) < lens[0] and int(ccount[0]) == int(want[0]) < int(count[0])  # it cuts; the cap too


def test_page_pick_breaks_ties_by_slot():
    from kvguard.kernels.page_pick import page_pick

    scores = torch.zeros(1, 2, 300, device=DEVICE)  # every page the same mass
    scores[0, :, 7] = 5.0  # but one
    total = torch.logsumexp(scores, dim=-1)
    table = torch.arange(300, dtype=torch.int32, device=DEVICE)[None].contiguous()
    for config in (None, {"many_from": 1, "many_block": 64}, {"select": "bisect"},
                   {"select": "bisect", "block": 64, "num_warps": 1}):  # the ties span blocks
        chosen, count = page_pick(scores, total, table, 10, torch.tensor([10], dtype=torch.int32, device=DEVICE),
                                  config=config)
        assert int(count[0]) == 10 and chosen[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    scores[0, :, :5] = -1.0  # the lowest slots below the rest: ties at the k-th go to the slots after them
    total = torch.logsumexp(scores, dim=-1)
    for config in (None, {"many_from": 1, "many_block": 64}, {"select": "bisect"},
                   {"select": "bisect", "block": 64, "num_warps": 1}):
        chosen, count = page_pick(scores, total, table, 70, torch.tensor([70], dtype=torch.int32, device=DEVICE),
                                  config=config)
        assert int(count[0]) == 70 and chosen[0].tolist() == list(range(5, 75))
    with pytest.raises(KernelArgError):
        page_pick(scores, total, table.long(), 10, torch.tensor([10], dtype=torch.int32, device=DEVICE))
    with pytest.raises(KernelArgError):
        page_pick(scores.half(), total, table, 10)
    with pytest.raises(KernelArgError):
        page_pick(scores, total, table, 301)  # wider than the pages
    with pytest.raises(KernelArgError):
        page_pick(scores, total, table, 10, torch.tensor([10], dtype=torch.int32, device=DEVICE),
                  config={"select": "sort"})


def test_coverage_threshold_keeps_what_the_reference_keeps():
    from kvguard.kernels.page_pick import coverage_threshold

    from kvguard.cache.picks import covering

    g = torch.Generator().manual_seed(3)
    rows = [torch.softmax(torch.randn(3000, generator=g) * 3, 0),  # a softmax's masses
            torch.softmax(torch.randn(3000, generator=g), 0) * 0.5,  # a row of pages holding half
            torch.zeros(3000),  # a row of no pages
            torch.full((3000,), 1 / 3000)]  # every page one mass: all kept or none
    ties = torch.softmax(torch.randn(3000, generator=g), 0)
    ties[::7] = ties[0]  # many pages at one mass
    mass = torch.stack([*rows, ties])
    for miss in (0.01, 0.3, 0.6):
        want = covering(mass, miss)
        # in registers, and looped over a row longer than the block
        for block in (16384, 1024):
            t = coverage_threshold(mass.to(DEVICE), miss, block=block).cpu()
            assert torch.equal(mass >= t[:, None], want), (miss, block)
    t = coverage_threshold(mass.to(DEVICE), 0.6).cpu()
    assert t[1] == t[2] == float("inf")  # the row's whole sum is within what may be left out
    assert t[3] == 1 / torch.tensor(3000.0)  # every page kept: their sum is past 0.6
    with pytest.raises(KernelArgError):
        coverage_threshold(mass.double().to(DEVICE), 0.01)


def test_page_total_and_rescale_match_torch():
    from kvguard.kernels.page_pick import page_total, rescale

    scores, _ = scores_of(3, 5, 2500, [2500, 17, 0], seed=4)  # several blocks a row, and a row of none
    want = torch.logsumexp(scores, dim=-1)
    for config in (None, {"many_from": 1}):  # one program a row; many (two blocks of 2,048 pages)
        total = page_total(scores, config=config)
        torch.testing.assert_close(total[:2], want[:2], rtol=1e-5, atol=1e-5)
        assert torch.isinf(total[2]).all() and (total[2] < 0).all()
    out = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(5)).half().to(DEVICE)
    part = total[:2] - torch.rand(2, 5, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    expect = (out.float() * torch.exp(part - total[:2])[..., None]).half()
    torch.testing.assert_close(rescale(out.clone(), part.contiguous(), total[:2].contiguous()), expect, rtol=0, atol=1e-3)
    with pytest.raises(KernelArgError):
        rescale(out[:, :, :48].contiguous(), part, total[:2])  # D not a power of 2


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16, torch.uint8])
def test_gather_pages_copies_the_pages_asked_for(dtype):
    from kvguard.kernels.gather import gather_pages

    src = (torch.randn(9, 3, 5, 7) * 50).to(dtype).to(DEVICE)
    idx = torch.tensor([7, 0, 3, 3], dtype=torch.int32, device=DEVICE)
    assert torch.equal(gather_pages(src, idx, src.device), src[idx.long()])
    assert gather_pages(src, idx[:0], src.device).shape == (0, 3, 5, 7)
    with pytest.raises(KernelArgError):
        gather_pages(src.transpose(1, 2), idx, src.device)
    with pytest.raises(KernelArgError):
        gather_pages(src, idx.float(), src.device)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
def test_scatter_pages_copies_only_the_pages_asked_for(dtype):
    """dst[didx[i]] = src[idx[i]] where idx[i] >= 0; the other slots keep what they held."""
    from kvguard.kernels.gather import scatter_pages

    src = (torch.randn(9, 3, 5) * 50).to(dtype).to(DEVICE)
    dst = (torch.randn(6, 3, 5) * 50).to(dtype).to(DEVICE)
    want = dst.clone()
    idx = torch.tensor([7, -1, 2, -1], dtype=torch.int32, device=DEVICE)
    didx = torch.tensor([4, 0, 1, 5], dtype=torch.int64, device=DEVICE)
    scatter_pages(src, idx, dst, didx)
    want[4], want[1] = src[7], src[2]
    assert torch.equal(dst, want)
    with pytest.raises(KernelArgError):
        scatter_pages(src, idx, dst.float() if dtype != torch.float32 else dst.half(), didx)
    with pytest.raises(KernelArgError):
        scatter_pages(src, idx, dst[:, :2].contiguous(), didx)
    with pytest.raises(KernelArgError):
        scatter_pages(src, idx, dst, didx[:3])
