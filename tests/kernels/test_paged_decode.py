"""paged_decode against dense fp32 attention over the reference-dequantized pages."""

import math

import pytest
import torch
from kvguard.kernels._checks import KernelArgError
from kvguard.kernels.paged_decode import (
    paged_decode,
    paged_decode_ref,
    paged_decode_sets,
    paged_decode_sets_ref,
)

from .conftest import DEVICE, ON_GPU
from .util import CODECS, make_pages, outlier_kv

# ‖out − ref‖/‖ref‖. fp16 out: dequantized keys round to fp16 for the tensor cores, which the
# ×20 outlier channels turn into ~1e-3; bf16 out adds its own rounding (~2e-3).
TOL = {(torch.float16, False): 1e-3, (torch.float16, True): 2e-3,
       (torch.bfloat16, False): 4e-3, (torch.bfloat16, True): 5e-3}


def _case(codec, dtype, group, dim, seq_lens, heads=2, max_pages=10, seed=0):
    b = len(seq_lens)
    pages = make_pages(codec, b * max_pages + 3, heads, 16, dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    table = torch.randperm(b * max_pages + 3, generator=gen)[: b * max_pages].reshape(b, max_pages)
    q, _ = outlier_kv((b, heads * group, dim), dtype, gen, outlier=1.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, pages, table.to(torch.int32).to(DEVICE), lens


def _check(codec, dtype, q, pages, table, lens, **kw):
    out, lse, mass = paged_decode(q, pages, table, lens, return_mass=True, **kw)
    r_out, r_lse, r_mass = paged_decode_ref(q, pages, table, lens, return_mass=True,
                                            sm_scale=kw.get("sm_scale"))
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_ok(out, r_out, TOL[dtype, codec != "16bit"])
    live = lens > 0
    assert torch.allclose(lse[live], r_lse[live], rtol=2e-3, atol=1e-2 if codec != "16bit" else 1e-4)
    assert torch.isneginf(lse[~live]).all() and (out[~live] == 0).all()
    assert torch.allclose(mass, r_mass, atol=5e-3)


def rel_ok(out, ref, tol):
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e} over {tol:.0e}"
    return True


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("dim", (64, 128))
def test_matches_reference(codec, group, dim):
    # lengths: a partly filled last page, exactly one page, one token, an empty sequence
    q, pages, table, lens = _case(codec, torch.float16, group, dim, [37, 16, 1, 0, 150])
    _check(codec, torch.float16, q, pages, table, lens)


@pytest.mark.parametrize("codec", CODECS)
def test_bf16_and_forced_splits(codec):
    # splits of 64 tokens: several per sequence, some past a sequence's end
    q, pages, table, lens = _case(codec, torch.bfloat16, 4, 64, [150, 5, 97], seed=3)
    _check(codec, torch.bfloat16, q, pages, table, lens, config={"splits": 3})


@pytest.mark.parametrize("codec", ("16bit", "int4"))
def test_pages_of_eight_tokens_take_more_pages_a_step(codec):
    """The tables' tiles hold one or two pages of 16 tokens; with pages of 8 a step takes more of
    them, so that P @ V reduces over 16 tokens (tl.dot's least, which the interpreter does not
    enforce and the compiler does) or 32 for int4; a config that gives fewer is refused."""
    from kvguard.kernels.paged_decode import _choose_tile

    gen = torch.Generator().manual_seed(4)
    pages = make_pages(codec, 24, 2, 8, 64, torch.float16, seed=4)
    table = torch.randperm(24, generator=gen)[:20].reshape(2, 10).to(torch.int32).to(DEVICE)
    q, _ = outlier_kv((2, 8, 64), torch.float16, gen, outlier=1.0)
    lens = torch.tensor([77, 9], dtype=torch.int32, device=DEVICE)
    tile = _choose_tile(q, pages, table, lens, None)
    assert tile.bn // tile.cfg["num_warps"] ** bool(tile.cfg.get("transposed")) >= (32 if codec == "int4" else 16)
    _check(codec, torch.float16, q, pages, table, lens)
    with pytest.raises(KernelArgError, match="at least 16"):
        paged_decode(q, pages, table, lens, config={"pages": 1, "transposed": False})


@pytest.mark.parametrize("codec", ("int8", "int4"))
def test_splits_merged_in_chunks(codec):
    # more splits than the merge takes at once: the running max across chunks
    q, pages, table, lens = _case(codec, torch.float16, 4, 64, [150, 97, 0], seed=9)
    _check(codec, torch.float16, q, pages, table, lens, config={"splits": 5, "combine_chunk": 2})


@pytest.mark.parametrize("block", (16, 32))
def test_splits_merged_by_channel_blocks(block):
    # the merge spreads a row's channels over programs (each its own copy of the running max);
    # head_dim 64: two or four programs a row, one of which writes the lse
    q, pages, table, lens = _case("int8", torch.float16, 4, 64, [150, 97, 0], seed=10)
    _check("int8", torch.float16, q, pages, table, lens, config={"splits": 5, "combine_block": block})


@pytest.mark.parametrize("rows", (4, 16))
def test_splits_merged_rows_at_a_time(rows):
    # a merge program takes several query-head rows; 3 sequences x 8 heads = 24 rows, so with 16
    # the last program's rows are partly past the end
    q, pages, table, lens = _case("int8", torch.float16, 4, 64, [150, 97, 0], seed=11)
    _check("int8", torch.float16, q, pages, table, lens, config={"splits": 3, "combine_rows": rows})


# int4 tile shapes the kernel accepts. Compiled on a GPU these catch what the interpreter cannot
# show: Triton 3.6 computed the int4 P @ V product wrongly whenever a warp's step held one page
# (16 tokens), the same wrong numbers on every run (see kernels/_checks.py).
INT4_TILES = {
    "2d_p4w2": {"pages": 4, "num_warps": 2, "warp_split": False, "transposed": False},
    "2d_p2w1": {"pages": 2, "num_warps": 1, "warp_split": False, "transposed": False},
    "split_p4w2": {"pages": 4, "num_warps": 2, "warp_split": True, "transposed": False},
    "split_p8w4": {"pages": 8, "num_warps": 4, "warp_split": True, "transposed": False},
    "t_p4w2": {"pages": 4, "num_warps": 2, "transposed": True},
    "t_p2w1": {"pages": 2, "num_warps": 1, "transposed": True},
    "t_p8w4_bytes": {"pages": 8, "num_warps": 4, "transposed": True, "pairs": False},
    "t_p4w2_peel": {"pages": 4, "num_warps": 2, "transposed": True, "peel": True},
    "t_p2w1_peel": {"pages": 2, "num_warps": 1, "transposed": True, "peel": True},
    "t_p4w2_nopeel": {"pages": 4, "num_warps": 2, "transposed": True, "peel": False},
}
INT4_16_TOKEN_TILES = {
    "2d_p1w1": {"pages": 1, "num_warps": 1, "warp_split": False, "transposed": False},
    "split_p2w2": {"pages": 2, "num_warps": 2, "warp_split": True, "transposed": False},
    "split_p4w4": {"pages": 4, "num_warps": 4, "warp_split": True, "transposed": False},
    "t_p2w2": {"pages": 2, "num_warps": 2, "transposed": True},
}


@pytest.mark.parametrize("tile", INT4_TILES)
@pytest.mark.parametrize("dim", (64, 128))
def test_int4_tiles(tile, dim):
    q, pages, table, lens = _case("int4", torch.float16, 4, dim, [150, 37, 1], seed=11)
    _check("int4", torch.float16, q, pages, table, lens, config={**INT4_TILES[tile], "splits": 2})


@pytest.mark.parametrize("tile", INT4_16_TOKEN_TILES)
def test_int4_refuses_one_page_per_warp(tile):
    q, pages, table, lens = _case("int4", torch.float16, 4, 64, [40, 3], seed=12)
    with pytest.raises(KernelArgError, match="at least 32 tokens"):
        paged_decode(q, pages, table, lens, config=INT4_16_TOKEN_TILES[tile])
    q8, pages8, _, _ = _case("int8", torch.float16, 4, 64, [40, 3], seed=12)  # other codecs are not affected
    paged_decode(q8, pages8, table, lens, config=INT4_16_TOKEN_TILES[tile])


# int8/fp8 tiles: warp_split (P @ V with the group padded into the MMA rows) and transposed
# (K q^T, V^T p^T: a warp's tokens in the rows), one or two pages per warp, codes as int32 words
# on a GPU (bytes under the interpreter) or as bytes
QUANT_TILES = {
    "split_p2w2": {"pages": 2, "num_warps": 2, "warp_split": True, "transposed": False},
    "t_p2w2": {"pages": 2, "num_warps": 2, "warp_split": False, "transposed": True},
    "t_p2w2_bytes": {"pages": 2, "num_warps": 2, "warp_split": False, "transposed": True, "words": False},
    "t_p4w2": {"pages": 4, "num_warps": 2, "warp_split": False, "transposed": True},
    "t_p4w4": {"pages": 4, "num_warps": 4, "warp_split": False, "transposed": True},
    # full steps without token masks and one masked step for the rest; one warp per program
    "t_p4w2_peel": {"pages": 4, "num_warps": 2, "warp_split": False, "transposed": True, "peel": True},
    "t_p2w2_bytes_peel": {"pages": 2, "num_warps": 2, "warp_split": False, "transposed": True, "words": False,
                          "peel": True},
    "t_p2w1_peel": {"pages": 2, "num_warps": 1, "warp_split": False, "transposed": True, "peel": True},
    "t_p2w2_nopeel": {"pages": 2, "num_warps": 2, "warp_split": False, "transposed": True, "peel": False},
}


@pytest.mark.parametrize("codec", ("int8", "fp8"))
@pytest.mark.parametrize("tile", QUANT_TILES)
@pytest.mark.parametrize("dim", (64, 128))
def test_int8_fp8_tiles(codec, tile, dim):
    q, pages, table, lens = _case(codec, torch.float16, 4, dim, [150, 37, 1], seed=14)
    _check(codec, torch.float16, q, pages, table, lens, config={**QUANT_TILES[tile], "splits": 2})


@pytest.mark.parametrize("codec", CODECS)
def test_fused_merge(codec):
    # the last program of each (sequence, KV head) merges the splits: more splits than one chunk
    # of the merge, a split past a sequence's end, an empty sequence; a second call checks that
    # the first left its counters at 0, a larger batch that they grow
    cfg = {"splits": 5, "fused_merge": True, "fused_chunk": 2}
    for seed, lens in ((15, [150, 97, 0]), (16, [150, 97, 0]), (17, [40, 1, 160, 77, 9])):
        q, pages, table, lens = _case(codec, torch.float16, 4, 64, lens, seed=seed)
        _check(codec, torch.float16, q, pages, table, lens, config=cfg)


def test_scale_and_max_seq_len():
    q, pages, table, lens = _case("int8", torch.float16, 2, 64, [40, 33], seed=5)
    _check("int8", torch.float16, q, pages, table, lens, sm_scale=0.3 / math.sqrt(64), max_seq_len=48)


def test_errors():
    q, pages, table, lens = _case("int4", torch.float16, 4, 64, [20, 3], seed=7)
    with pytest.raises(KernelArgError, match="q must be"):
        paged_decode(q.float(), pages, table, lens)
    for bad in (0.0, -0.125, float("nan"), float("inf")):
        with pytest.raises(KernelArgError, match="sm_scale"):
            paged_decode(q, pages, table, lens, sm_scale=bad)
    with pytest.raises(KernelArgError, match="multiple"):
        paged_decode(q[:, :3].contiguous(), pages, table, lens)
    with pytest.raises(KernelArgError, match="contiguous"):
        paged_decode(q.transpose(0, 1).contiguous().transpose(0, 1), pages, table, lens)
    with pytest.raises(KernelArgError, match="block_table must be"):
        paged_decode(q, pages, table.to(torch.int16), lens)
    with pytest.raises(KernelArgError, match="block_table must have shape"):
        paged_decode(q, pages, table[:1], lens)
    with pytest.raises(KernelArgError, match="seq_lens"):
        paged_decode(q, pages, table, lens[:1])
    with pytest.raises(KernelArgError, match="k_zero"):
        paged_decode(q, {n: t for n, t in pages.items() if n != "k_zero"}, table, lens)
    with pytest.raises(KernelArgError, match="v_scale"):
        paged_decode(q, {**pages, "v_scale": pages["v_scale"].float()}, table, lens)


def test_checks_hold_after_a_call_of_the_same_kind():
    # the tile is chosen once per kind of call (what the checks read: dtypes, shapes, strides,
    # devices); a later call that differs in any of them is checked again, not waved through
    from kvguard.kernels import paged_decode as pd

    q, pages, table, lens = _case("int8", torch.float16, 4, 64, [20, 3], seed=9)
    _check("int8", torch.float16, q, pages, table, lens)
    known = len(pd._TILES)
    paged_decode(q, pages, table.clone(), lens.clone())  # same kind, other tensors
    assert len(pd._TILES) == known
    with pytest.raises(KernelArgError, match="block_table must be"):
        paged_decode(q, pages, table.to(torch.int16), lens)
    with pytest.raises(KernelArgError, match="contiguous"):
        paged_decode(q, {**pages, "k": pages["k"].transpose(2, 3).contiguous().transpose(2, 3)}, table, lens)
    with pytest.raises(KernelArgError, match="v_scale"):
        paged_decode(q, {**pages, "v_scale": pages["v_scale"][:, :, :8]}, table, lens)
    q2, pages2, table2, lens2 = _case("int8", torch.float16, 4, 64, [40, 17, 2], seed=10)  # more pages and rows
    _check("int8", torch.float16, q2, pages2, table2, lens2)
    assert len(pd._TILES) == known + 1


@pytest.mark.parametrize("codec", ("int8", "fp8", "int4"))
def test_values_are_channel_major(codec):
    # value codes [P, H, D, S] (int4: [P, H, D, S/2], two tokens a byte): a channel's tokens
    # contiguous; pages in the token-major layout of the keys are refused, not read as garbage
    q, pages, table, lens = _case(codec, torch.float16, 4, 64, [40, 3], seed=8)
    per_channel = 8 if codec == "int4" else 16
    assert pages["v"].shape[2:] == (64, per_channel)
    token_major = pages["v"].reshape(*pages["v"].shape[:2], 16, -1)
    with pytest.raises(KernelArgError, match=rf"pages\['v'\] must have shape \[\d+, 2, 64, {per_channel}\]"):
        paged_decode(q, {**pages, "v": token_major}, table, lens)


@pytest.mark.parametrize("codec", CODECS)
def test_one_sequence(codec):
    # a batch of one takes its codec's 'one_sequence' keys (int8: fewer programs, no register cap);
    # keys the caller gives win over them
    q, pages, table, lens = _case(codec, torch.float16, 4, 128, [150], seed=9)
    _check(codec, torch.float16, q, pages, table, lens)
    _check(codec, torch.float16, q, pages, table, lens, config={"splits": 2})
    _check(codec, torch.float16, q, pages, table, lens, config={"pages": 4, "num_warps": 2, "splits": 3})


def test_one_sequence_config_precedence(monkeypatch):
    import kvguard.kernels.paged_decode as pd
    seen = []
    real = pd.num_splits
    monkeypatch.setattr(pd, "num_splits", lambda *a, **kw: seen.append(a[5]) or real(*a, **kw))
    q, pages, table, lens = _case("int8", torch.float16, 4, 128, [40], seed=10)
    paged_decode(q, pages, table, lens)  # one_sequence: 12 programs per SM
    paged_decode(q, pages, table, lens, config={"programs_per_sm": 5})  # the caller's key wins
    q2, pages2, table2, lens2 = _case("int8", torch.float16, 4, 128, [40, 7], seed=10)
    paged_decode(q2, pages2, table2, lens2)  # B = 2: the default, 16
    assert seen == [12, 5, 16]


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("codec", CODECS)
def test_replayed_in_a_cuda_graph(codec):
    # a serving loop captures decode in a CUDA graph; with the merge launched as a programmatic
    # dependent of pass 1 (int8 and fp8 by default, B > 1) the graph must give what eager calls give
    q, pages, table, lens = _case(codec, torch.float16, 4, 128, [700, 333, 1, 640, 0, 512, 129, 64], max_pages=48,
                                  seed=12)
    q_in = q.clone()
    paged_decode(q_in, pages, table, lens)  # compiled before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_decode(q_in, pages, table, lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = paged_decode(q_in, pages, table, lens)
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    for _ in range(3):
        q_in.copy_(torch.randn(q.shape, generator=gen, device=DEVICE, dtype=q.dtype))
        graph.replay()
        out, lse = paged_decode(q_in.clone(), pages, table, lens)
        torch.cuda.synchronize()
        assert torch.equal(out_g, out) and torch.equal(lse_g, lse)


def _sets_case(codecs, dim, lens_per_set, group=4, heads=2, dtype=torch.float16, seed=20):
    b = len(lens_per_set[0])
    gen = torch.Generator().manual_seed(seed)
    q, _ = outlier_kv((b, heads * group, dim), dtype, gen, outlier=1.0)
    sets = []
    for i, (codec, lens) in enumerate(zip(codecs, lens_per_set)):
        max_pages = max(1, -(-max(lens) // 16))
        pages = make_pages(codec, b * max_pages + 2, heads, 16, dim, dtype, seed + 1 + i)
        table = torch.randperm(b * max_pages + 2, generator=gen)[: b * max_pages].reshape(b, max_pages)
        sets.append((pages, table.to(torch.int32).to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)))
    return q, sets


@pytest.mark.parametrize("codecs, dim", [(("16bit", "int8"), 64), (("16bit", "int4"), 128), (("fp8", "16bit"), 64),
                                         (("int8", "int8", "16bit"), 128)])
def test_sets_attend_over_the_union_of_their_keys(codecs, dim):
    # a cache's pools: the same sequences' keys split over sets of different codecs; a sequence
    # with no key in one set, one with none at all
    lens = [[150, 0, 33, 0], [40, 97, 0, 0], [16, 5, 1, 0]][: len(codecs)]
    q, sets = _sets_case(codecs, dim, lens)
    out, lse, masses = paged_decode_sets(q, sets, return_mass=True)
    r_out, r_lse, r_masses = paged_decode_sets_ref(q, sets, return_mass=True)
    live = lse.new_tensor([sum(x[i] for x in lens) > 0 for i in range(q.shape[0])]).bool()
    assert rel_ok(out[live], r_out[live], TOL[torch.float16, True])
    assert torch.allclose(lse[live], r_lse[live], rtol=2e-3, atol=1e-2)
    assert torch.isneginf(lse[~live]).all() and (out[~live] == 0).all()
    assert len(masses) == len(sets)
    for m, r in zip(masses, r_masses):
        assert m.shape == r.shape and torch.allclose(m, r, atol=5e-3)
    # every live row's probabilities, over all the sets, sum to its group's size
    total = sum(m.sum(-1) for m in masses)
    assert torch.allclose(total[live], torch.full_like(total[live], 4.0), atol=1e-3)
    # one set alone is paged_decode
    one, one_lse = paged_decode_sets(q, sets[:1])
    alone, alone_lse = paged_decode(q, *sets[0])
    assert torch.equal(one, alone) and torch.equal(one_lse, alone_lse)


@pytest.mark.parametrize("codec", ("int8", "16bit"))
def test_a_spread_set_splits_each_rows_own_tokens(codec):
    """A K/V split's picks by coverage: rows filling 3, 40, 1 and 0 of a 64-page table beside a
    window's set. Spread, the quantized tile's splits divide each row's tokens (the others'
    split the width); the same attention either way, and the reference's."""
    q, pages, table, lens = _case(codec, torch.float16, 4, 64, [3 * 16, 40 * 16 - 5, 9, 0], max_pages=64)
    wq, wpages, wtable, wlens = _case("16bit", torch.float16, 4, 64, [20, 16, 0, 0], max_pages=2, seed=3)
    sets = [(pages, table, lens, 64 * 16), (wpages, wtable, wlens)]
    spread, spread_lse = paged_decode_sets(q, sets, spread=(0,))
    plain, plain_lse = paged_decode_sets(q, sets)
    r_out, r_lse = paged_decode_sets_ref(q, sets)
    live = torch.tensor([True, True, True, False], device=DEVICE)
    assert rel_ok(spread[live], plain[live], 1e-3) and rel_ok(spread[live], r_out[live], TOL[torch.float16, True])
    assert torch.allclose(spread_lse[live], r_lse[live], rtol=2e-3, atol=1e-2)
    assert torch.isneginf(spread_lse[~live]).all() and torch.isneginf(plain_lse[~live]).all()


def test_sets_errors():
    q, sets = _sets_case(("16bit", "int8"), 64, [[20, 3], [40, 0]])
    with pytest.raises(KernelArgError, match="at least one"):
        paged_decode_sets(q, [])
    with pytest.raises(KernelArgError, match="each set is"):
        paged_decode_sets(q, [sets[0][:2]])
    other = make_pages("int8", 8, 1, 16, 64, torch.float16)
    with pytest.raises(KernelArgError, match="same KV heads"):
        paged_decode_sets(q[:, :4].contiguous(), [(other, sets[1][1], sets[1][2]), sets[0]])


def _mass_buffers(q, sets, heads, seed):
    """Per set, a buffer per row (fp32 [heads, columns], random totals already in it, columns
    differing by row) and positions: a row's keys scattered over its columns, some out of range."""
    gen = torch.Generator().manual_seed(seed)
    into = []
    for _, table, _lens in sets:
        width = table.shape[1] * 16
        buffers, rows = [], []
        for i in range(q.shape[0]):
            cols = width + 3 * i
            buffers.append(torch.rand(heads, cols, generator=gen).to(DEVICE))
            pos = torch.randperm(cols, generator=gen)[:width]
            pos[::7] = -1  # skipped
            pos[1::11] = cols + 5  # past the buffer: skipped
            rows.append(pos)
        into.append((buffers, torch.stack(rows).to(torch.int32).to(DEVICE)))
    return into


@pytest.mark.parametrize("codecs", [("16bit", "int8"), ("int4",)])
def test_mass_into_adds_into_the_callers_buffers(codecs):
    # what an H2O cache keeps: each row's running totals by position, added to in place
    lens = [[150, 0, 33, 9], [40, 97, 0, 16]][: len(codecs)]
    q, sets = _sets_case(codecs, 64, lens)
    into = _mass_buffers(q, sets, 2, seed=4)
    want = [([b.clone() for b in buffers], pos) for buffers, pos in into]
    out, lse = paged_decode_sets(q, sets, mass_into=into)
    r_out, _ = paged_decode_sets_ref(q, sets, mass_into=want)
    assert rel_ok(out[lse > float("-inf")], r_out[lse > float("-inf")], TOL[torch.float16, True])
    for (got, _), (ref_bufs, _) in zip(into, want):
        for x, y in zip(got, ref_bufs):
            assert torch.allclose(x, y, atol=5e-3)
    # the same as returning the mass and adding it by hand
    _, _, masses = paged_decode_sets(q, sets, return_mass=True)
    for (buffers, pos), (before, _), m, (_, _, seq_lens) in zip(into, _mass_buffers(q, sets, 2, seed=4), masses, sets):
        for i, (x, x0) in enumerate(zip(buffers, before)):
            n = int(seq_lens[i])
            p = pos[i, :n].long()
            keep = (p >= 0) & (p < x0.shape[1])
            x0.index_add_(1, p[keep], m[i, :, :n][:, keep])
            assert torch.allclose(x, x0, atol=1e-5)


def test_mass_into_errors():
    q, sets = _sets_case(("16bit", "int8"), 64, [[20, 3], [40, 0]])
    into = _mass_buffers(q, sets, 2, seed=5)
    with pytest.raises(KernelArgError, match="not with return_mass"):
        paged_decode_sets(q, sets, return_mass=True, mass_into=into)
    with pytest.raises(KernelArgError, match="for every set"):
        paged_decode_sets(q, sets, mass_into=into[:1])
    with pytest.raises(KernelArgError, match="one buffer per row"):
        paged_decode_sets(q, sets, mass_into=[(into[0][0][:1], into[0][1]), into[1]])
    with pytest.raises(KernelArgError, match="mass_into buffer must be"):
        paged_decode_sets(q, sets, mass_into=[([b.double() for b in into[0][0]], into[0][1]), into[1]])
    with pytest.raises(KernelArgError, match="contiguous rows"):
        paged_decode_sets(q, sets, mass_into=[([b.t().contiguous().t() for b in into[0][0]], into[0][1]), into[1]])
    with pytest.raises(KernelArgError, match="positions must be"):
        paged_decode_sets(q, sets, mass_into=[(into[0][0], into[0][1][:, :8]), into[1]])
    table = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(KernelArgError, match="row table must have shape"):
        paged_decode_sets(q, sets, mass_into=[(table[:1], into[0][1]), into[1]])
    with pytest.raises(KernelArgError, match="row table must be"):
        paged_decode_sets(q, sets, mass_into=[(table.int(), into[0][1]), into[1]])


def test_mass_into_takes_the_callers_row_table():
    # a CUDA graph's caller keeps the (address, head stride, columns) table itself and rewrites
    # it when a buffer moves: the same sums as with the buffers handed over
    q, sets = _sets_case(("16bit", "int8"), 64, [[150, 0, 33, 9], [40, 97, 0, 16]])
    into = _mass_buffers(q, sets, 2, seed=6)
    want = [([b.clone() for b in buffers], pos) for buffers, pos in into]
    tables = [torch.tensor([(b.data_ptr(), b.stride(0), b.shape[1]) for b in buffers], dtype=torch.int64,
                           device=DEVICE) for buffers, _ in into]
    out, _ = paged_decode_sets(q, sets, mass_into=[(t, pos) for t, (_, pos) in zip(tables, into)])
    r_out, _ = paged_decode_sets(q, sets, mass_into=want)
    assert torch.equal(out, r_out)
    for (got, _), (ref_bufs, _) in zip(into, want):
        for x, y in zip(got, ref_bufs):
            assert torch.equal(x, y)


def _mixed(keys: str, values: str, pages: int, heads: int, dim: int, seed: int = 0):
    """Pages whose keys are in one codec and values in another (a K/V split's, kv_split.keys)."""
    a, b = make_pages(keys, pages, heads, 16, dim, torch.float16, seed), \
        make_pages(values, pages, heads, 16, dim, torch.float16, seed)
    return {**{n: t for n, t in a.items() if n.startswith("k")}, **{n: t for n, t in b.items() if n.startswith("v")}}


@pytest.mark.parametrize("keys,values", [("int4", "int8"), ("int4", "16bit"), ("int8", "int4"), ("fp8", "int8")])
@pytest.mark.parametrize("dim", (64, 128))
def test_keys_and_values_in_different_codecs(keys, values, dim):
    """A K/V split's pages keep their keys in a smaller codec than their values: the decode
    kernels dequantize each half by its own codec (told apart by the dtypes of k and v)."""
    q, _, table, lens = _case("int8", torch.float16, 3, dim, [37, 16, 1, 0, 150])
    pages = _mixed(keys, values, 5 * 10 + 3, 2, dim)
    _check(keys, torch.float16, q, pages, table, lens)


def test_mixed_pages_only_where_pages_are_read():
    """The kernels that write pages take keys and values in one codec."""
    from kvguard.kernels._checks import check_pages

    pages = _mixed("int4", "int8", 4, 2, 64)
    assert check_pages(pages, mixed=True)[0] == "int4"
    with pytest.raises(KernelArgError, match="one codec"):
        check_pages(pages)
    with pytest.raises(KernelArgError, match="missing"):
        check_pages({n: t for n, t in pages.items() if n != "k_zero"}, mixed=True)
