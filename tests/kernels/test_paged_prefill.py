"""paged_prefill against dense causal fp32 attention over the reference-dequantized pages."""

import pytest
import torch
from kvguard.kernels._checks import KernelArgError
from kvguard.kernels.paged_prefill import (
    paged_prefill,
    paged_prefill_batch,
    paged_prefill_batch_ref,
    paged_prefill_mass,
    paged_prefill_mass_ref,
    paged_prefill_ref,
    paged_prefill_sets,
)

from .conftest import DEVICE
from .test_paged_decode import TOL, rel_ok
from .util import CODECS, encode, make_pages, outlier_kv


def _case(codec, dtype, group, dim, t, heads=2, max_pages=10, seed=0):
    pages = make_pages(codec, max_pages + 4, heads, 16, dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    table = torch.randperm(max_pages + 4, generator=gen)[:max_pages].to(torch.int32).to(DEVICE)
    q, _ = outlier_kv((t, heads * group, dim), dtype, gen, outlier=1.0)
    return q, pages, table


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("dim", (64, 128))
def test_matches_reference(codec, group, dim):
    # a whole prompt whose last page is partly filled, then a chunk after 130 cached tokens
    for t, length in ((37, 37), (20, 150)):
        q, pages, table = _case(codec, torch.float16, group, dim, t)
        out, lse = paged_prefill(q, pages, table, length)
        r_out, r_lse = paged_prefill_ref(q, pages, table, length)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert rel_ok(out, r_out, TOL[torch.float16, codec != "16bit"])
        assert torch.allclose(lse, r_lse, rtol=2e-3, atol=1e-2 if codec != "16bit" else 1e-4)


@pytest.mark.parametrize("codec", ("16bit", "int4"))
def test_bf16_single_query(codec):
    q, pages, table = _case(codec, torch.bfloat16, 4, 64, 1, seed=2)
    out, _ = paged_prefill(q, pages, table, 70)
    r_out, _ = paged_prefill_ref(q, pages, table, 70)
    assert rel_ok(out, r_out, TOL[torch.bfloat16, codec != "16bit"])


def test_pages_of_four_tokens_take_more_pages_a_step():
    """Pages of 4 tokens: the tile takes enough of them that P @ V reduces over 16 tokens (32 for
    int4), and the output is the reference's; a config that gives fewer is refused (a compiler
    error on a GPU otherwise, where the interpreter would have run it)."""
    from kvguard.kernels.paged_prefill import prefill_config

    for codec in ("16bit", "int4"):
        assert prefill_config(64, None, codec, 4)["pages"] * 4 == (32 if codec == "int4" else 16)
        pages = make_pages(codec, 40, 2, 4, 64, torch.float16, seed=6)
        table = torch.randperm(40, generator=torch.Generator().manual_seed(6))[:36].to(torch.int32).to(DEVICE)
        q, _ = outlier_kv((9, 8, 64), torch.float16, torch.Generator().manual_seed(7), outlier=1.0)
        out, _ = paged_prefill(q, pages, table, 131)
        assert rel_ok(out, paged_prefill_ref(q, pages, table, 131)[0], TOL[torch.float16, codec != "16bit"])
    with pytest.raises(KernelArgError, match="at least 16"):
        paged_prefill(q, pages, table, 131, config={"pages": 2})


def test_errors():
    q, pages, table = _case("int8", torch.float16, 2, 64, 8)
    with pytest.raises(KernelArgError, match="seq_len"):
        paged_prefill(q, pages, table, 4)  # fewer tokens than queries
    with pytest.raises(KernelArgError, match="seq_len"):
        paged_prefill(q, pages, table, 10 * 16 + 1)  # more than the block table holds
    with pytest.raises(KernelArgError, match="block_table must have shape"):
        paged_prefill(q, pages, table[None], 20)
    with pytest.raises(KernelArgError, match="q must have shape"):
        paged_prefill(q[..., :32].contiguous(), pages, table, 20)
    with pytest.raises(KernelArgError, match="sm_scale"):
        paged_prefill(q, pages, table, 20, sm_scale=-0.125)


def test_int4_refuses_one_page_steps():
    # a step of one page is a 16-token P @ V reduction, which Triton 3.6 gets wrong over int4 pages
    q, pages, table = _case("int4", torch.float16, 2, 64, 8)
    with pytest.raises(KernelArgError, match="at least 32 tokens"):
        paged_prefill(q, pages, table, 20, config={"pages": 1})
    out, _ = paged_prefill(q, pages, table, 20, config={"pages": 2})
    r_out, _ = paged_prefill_ref(q, pages, table, 20)
    assert rel_ok(out, r_out, TOL[torch.float16, True])


@pytest.mark.parametrize("codec", CODECS)
def test_limits_per_query(codec):
    # pages that hold part of a sequence: each query sees its own number of their first keys,
    # none for some (zeros and lse -inf), more than the chunk's causal rule would give for others
    q, pages, table = _case(codec, torch.float16, 4, 64, 12, seed=5)
    limits = torch.tensor([0, 0, 1, 5, 16, 17, 40, 40, 90, 100, 130, 150], dtype=torch.int32, device=DEVICE)
    out, lse = paged_prefill(q, pages, table, 150, limits=limits)
    r_out, r_lse = paged_prefill_ref(q, pages, table, 150, limits=limits)
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()
    assert rel_ok(out[2:], r_out[2:], TOL[torch.float16, codec != "16bit"])
    assert torch.allclose(lse[2:], r_lse[2:], rtol=2e-3, atol=1e-2 if codec != "16bit" else 1e-4)
    # more queries than the pages hold tokens is fine with limits
    few = paged_prefill(q, pages, table, 8, limits=limits.clamp(max=8))[0]
    assert rel_ok(few[2:], paged_prefill_ref(q, pages, table, 8, limits=limits.clamp(max=8))[0][2:],
                  TOL[torch.float16, codec != "16bit"])
    with pytest.raises(KernelArgError, match="limits must have shape"):
        paged_prefill(q, pages, table, 150, limits=limits[:5])


@pytest.mark.parametrize("codec", CODECS)
def test_batch_is_its_rows(codec):
    # three sequences of different lengths in one launch, a chunk of 24 queries each: row 0 the
    # causal rule, row 1 three padding queries first (they see nothing), row 2 a pool that holds
    # only part of the sequence (limits below the causal rule)
    heads, group, dim, t = 2, 4, 64, 24
    pages = make_pages(codec, 40, heads, 16, dim, torch.float16, 3)
    gen = torch.Generator().manual_seed(4)
    table = torch.stack([torch.randperm(40, generator=gen)[:10] for _ in range(3)]).to(torch.int32).to(DEVICE)
    q, _ = outlier_kv((3, t, heads * group, dim), torch.float16, gen, outlier=1.0)
    lens = [150, 60, 33]
    limits = torch.stack([torch.arange(n - t, n) + 1 for n in lens]).to(torch.int32)
    limits[1, :3] = 0
    limits[2] = torch.clamp(limits[2] - 10, min=0)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    limits = limits.to(DEVICE)
    out, lse = paged_prefill_batch(q, pages, table, seq_lens, max(lens), limits)
    r_out, r_lse = paged_prefill_batch_ref(q, pages, table, seq_lens, max(lens), limits)
    assert out.shape == q.shape and lse.shape == (3, t, heads * group)
    live = r_lse > float("-inf")
    assert bool((lse[~live] == float("-inf")).all()) and bool((out[~live] == 0).all())
    assert rel_ok(out[live], r_out[live], TOL[torch.float16, codec != "16bit"])
    for i, n in enumerate(lens):  # the same numbers as a launch for the row alone (neither splits its keys)
        one, one_lse = paged_prefill(q[i].contiguous(), pages, table[i], n, limits=limits[i].contiguous())
        assert torch.equal(one, out[i]) and torch.equal(one_lse, lse[i])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("splits", (2, 3))
def test_split_key_range_matches_one_pass(codec, splits):
    # the key range split over programs (a chunk whose blocks of query rows alone would leave the
    # GPU idle), the partials merged by their lse: a causal chunk whose first queries see none of
    # the last split's keys, per-query limits with queries that see no key at all, and a batch
    tol = TOL[torch.float16, codec != "16bit"]
    cfg = {"splits": splits}
    q, pages, table = _case(codec, torch.float16, 4, 64, 40, seed=7)
    out, lse = paged_prefill(q, pages, table, 150, config=cfg)
    r_out, r_lse = paged_prefill_ref(q, pages, table, 150)
    assert rel_ok(out, r_out, tol)
    assert torch.allclose(lse, r_lse, rtol=2e-3, atol=1e-2 if codec != "16bit" else 1e-4)
    limits = torch.tensor([0, 3, 0, 150] + [17 * i % 151 for i in range(36)], dtype=torch.int32, device=DEVICE)
    out, lse = paged_prefill(q, pages, table, 150, config=cfg, limits=limits)
    r_out, r_lse = paged_prefill_ref(q, pages, table, 150, limits=limits)
    live = r_lse > float("-inf")
    assert bool((out[~live] == 0).all()) and bool(torch.isneginf(lse[~live]).all()) and (~live).any()
    assert rel_ok(out[live], r_out[live], tol)
    assert torch.allclose(lse[live], r_lse[live], rtol=2e-3, atol=1e-2 if codec != "16bit" else 1e-4)
    qb = torch.stack([q[:24], q[16:]])
    tb = torch.stack([table, table.flip(0)])
    lens = torch.tensor([150, 90], dtype=torch.int32, device=DEVICE)
    lim = torch.stack([torch.arange(n - 24, n) + 1 for n in (150, 90)]).to(torch.int32).to(DEVICE)
    out, lse = paged_prefill_batch(qb, pages, tb, lens, 150, lim, config=cfg)
    r_out, _ = paged_prefill_batch_ref(qb, pages, tb, lens, 150, lim)
    assert rel_ok(out, r_out, tol)


@pytest.mark.parametrize("codec", CODECS)
def test_max_growing_along_the_keys(codec):
    # logits that rise by ~4.3 (base 2) a page along the keys, ~8.7 a step of two pages, and one
    # late key far above them: the online softmax rescales its sums in the unmasked steps and on
    # the causal diagonal, with and without splits
    gen = torch.Generator().manual_seed(11)
    heads, group, dim, t, length = 2, 4, 64, 40, 300
    u = torch.randn(heads, dim, generator=gen)
    u = (u / u.norm(dim=-1, keepdim=True)).to(DEVICE)  # per KV head, a direction its queries lean to
    q, _ = outlier_kv((t, heads * group, dim), torch.float16, gen, outlier=1.0)
    q = (q.float().reshape(t, heads, group, dim) + 3.0 * u[None, :, None, :]).reshape(q.shape).to(torch.float16)
    k, v = outlier_kv((20, heads, 16, dim), torch.float16, gen, outlier=1.0)
    ramp = torch.arange(20 * 16, device=DEVICE, dtype=torch.float32).reshape(20, 1, 16, 1) * 0.5
    k = (k.float() + ramp * u[None, :, None, :]).to(torch.float16)
    k[12, :, 5] = (u * 400.0).to(torch.float16)  # one late key far above the ramp
    pages = encode(codec, k, v)
    table = torch.randperm(20, generator=gen).to(torch.int32).to(DEVICE)
    tol = TOL[torch.float16, codec != "16bit"]
    for cfg in ({"pages": 2}, {"pages": 2, "splits": 3}):
        out, lse = paged_prefill(q, pages, table, length, config=cfg)
        r_out, r_lse = paged_prefill_ref(q, pages, table, length)
        assert rel_ok(out, r_out, tol), cfg
        assert torch.allclose(lse, r_lse, rtol=2e-3, atol=2e-2 if codec != "16bit" else 1e-4), cfg


def test_splits_follow_the_programs():
    from kvguard.kernels.paged_prefill import DEFAULT_CONFIG, prefill_splits

    cpu = torch.device("cpu")  # 4 SMs as the tile rules count a CPU
    cfg = {**DEFAULT_CONFIG, "programs_per_sm": 2, "min_split": 64}
    assert prefill_splits(8, 4096, 64, cpu, cfg) == (1, 4096)  # 8 programs fill 4 SMs at 2 each
    assert prefill_splits(2, 4096, 64, cpu, cfg) == (4, 1024)
    assert prefill_splits(1, 100, 64, cpu, cfg) == (1, 100)  # no split shorter than min_split keys
    assert prefill_splits(1, 200, 64, cpu, cfg) == (2, 128)  # 3 wanted, of whole loop steps: 2
    assert prefill_splits(1, 4096, 64, cpu, {**cfg, "min_split": 2048}) == (2, 2048)
    assert prefill_splits(1, 4096, 64, cpu, {**cfg, "splits": 3}) == (3, 1408)  # 1366 rounded up to 64s


def _merged_ref(results):
    """Reference results of several sets of pages, (out [..., D], lse [...]) each, as one softmax
    over all of their keys."""
    lses = torch.stack([lse for _, lse in results])
    lse = torch.logsumexp(lses, 0)
    w = torch.exp(lses - lse).nan_to_num(0.0)
    return (torch.stack([o.float() for o, _ in results]) * w.unsqueeze(-1)).sum(0), lse


@pytest.mark.parametrize("codec", ("int8", "int4"))
@pytest.mark.parametrize("splits", (None, 2))
def test_sets_are_one_softmax_over_their_keys(codec, splits):
    # a cache's two pools: quantized pages for the older keys, a 16-bit window for the newer, each
    # query limited to what it may see of each; two rows, one with padding queries in front
    heads, group, dim, t = 2, 4, 64, 24
    cfg = None if splits is None else {"splits": splits}
    gen = torch.Generator().manual_seed(11)
    quant = make_pages(codec, 40, heads, 16, dim, torch.float16, 12)
    hot = make_pages("16bit", 12, heads, 16, dim, torch.float16, 13)
    tq = torch.stack([torch.randperm(40, generator=gen)[:10] for _ in range(2)]).to(torch.int32).to(DEVICE)
    th = torch.stack([torch.randperm(12, generator=gen)[:4] for _ in range(2)]).to(torch.int32).to(DEVICE)
    q, _ = outlier_kv((2, t, heads * group, dim), torch.float16, gen, outlier=1.0)
    lq, lh = [150, 100], [40, 24]
    limq = torch.tensor([[min(n, 60 + 4 * j) for j in range(t)] for n in lq], dtype=torch.int32)
    limh = torch.tensor([[min(n, 1 + j) for j in range(t)] for n in lh], dtype=torch.int32)
    limq[1, :5] = 0
    limh[1, :5] = 0  # padding: sees nothing of either set
    limq, limh = limq.to(DEVICE), limh.to(DEVICE)
    sets = [(quant, tq, torch.tensor(lq, dtype=torch.int32, device=DEVICE), max(lq), limq),
            (hot, th, torch.tensor(lh, dtype=torch.int32, device=DEVICE), max(lh), limh)]
    out, lse = paged_prefill_sets(q, sets, config=cfg)
    r_out, r_lse = _merged_ref([paged_prefill_batch_ref(q, *e) for e in sets])
    live = r_lse > float("-inf")
    assert bool((out[~live] == 0).all()) and bool(torch.isneginf(lse[~live]).all()) and (~live).any()
    assert rel_ok(out[live], r_out[live], TOL[torch.float16, True])
    assert torch.allclose(lse[live], r_lse[live], rtol=2e-3, atol=1e-2)
    # one sequence without seq_lens: the row's tokens are max_seq_len
    one, one_lse = paged_prefill_sets(q[:1], [(quant, tq[:1], None, 150, limq[:1]), (hot, th[:1], None, 40, limh[:1])],
                                      config=cfg)
    assert rel_ok(one[0], r_out[0], TOL[torch.float16, True])
    # one set is paged_prefill_batch
    a = paged_prefill_sets(q, sets[:1], config=cfg)
    b = paged_prefill_batch(q, *sets[0], config=cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_sets_errors():
    pages, q, table, lens, limits = _batch_args()
    with pytest.raises(KernelArgError, match="one or more sets"):
        paged_prefill_sets(q, [])
    with pytest.raises(KernelArgError, match="each set is"):
        paged_prefill_sets(q, [(pages, table, lens, 20)])
    with pytest.raises(KernelArgError, match="left out for one sequence"):
        paged_prefill_sets(q, [(pages, table, None, 20, limits)])
    with pytest.raises(KernelArgError, match="max_seq_len"):
        paged_prefill_sets(q, [(pages, table, lens, 20, limits), (pages, table, lens, 65, limits)])
    small = make_pages("16bit", 12, 2, 16, 32, torch.float16, 0)  # another head_dim than q's
    with pytest.raises(KernelArgError, match="q must have shape"):
        paged_prefill_sets(q, [(pages, table, lens, 20, limits), (small, table, lens, 20, limits)])


def _batch_args():
    """int8 pages, q [2, 8, 8, 64], a block table [2, 4], 20 tokens a row and limits [2, 8]."""
    pages = make_pages("int8", 12, 2, 16, 64, torch.float16, 0)
    q = torch.zeros(2, 8, 8, 64, dtype=torch.float16, device=DEVICE)
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    lens = torch.full((2,), 20, dtype=torch.int32, device=DEVICE)
    limits = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    return pages, q, table, lens, limits


def test_batch_errors():
    pages, q, table, lens, limits = _batch_args()
    with pytest.raises(KernelArgError, match="max_seq_len"):
        paged_prefill_batch(q, pages, table, lens, 65, limits)
    with pytest.raises(KernelArgError, match="block_table must have shape"):
        paged_prefill_batch(q, pages, table[:1], lens, 20, limits)
    with pytest.raises(KernelArgError, match="limits must have shape"):
        paged_prefill_batch(q, pages, table, lens, 20, limits[:, :4])
    with pytest.raises(KernelArgError, match="seq_lens must be"):
        paged_prefill_batch(q, pages, table, lens.long(), 20, limits)
    with pytest.raises(KernelArgError, match="q must have shape"):
        paged_prefill_batch(q[0], pages, table, lens, 20, limits)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("group", (1, 4))
def test_mass_matches_reference(codec, group):
    # under the chunk's own lse, every query's probabilities sum to one over the keys it sees:
    # the mass of all queries sums to T per query head; then the last 5 queries alone (SnapKV),
    # a pool's share under a larger softmax (lse raised), and limits
    t, length = 20, 150
    q, pages, table = _case(codec, torch.float16, group, 64, t, seed=5)
    out, lse = paged_prefill(q, pages, table, length)
    mass = paged_prefill_mass(q, pages, table, length, lse)
    ref = paged_prefill_mass_ref(q, pages, table, length, lse)
    assert mass.shape == (2, length)
    assert rel_ok(mass, ref, 3e-3)
    assert torch.allclose(mass.sum(1), torch.full((2,), float(t * group), device=mass.device), rtol=1e-3)
    assert bool((mass[:, : length - t] > 0).all())
    last = paged_prefill_mass(q, pages, table, length, lse, first=t - 5)
    assert rel_ok(last, paged_prefill_mass_ref(q, pages, table, length, lse, first=t - 5), 3e-3)
    assert torch.allclose(last.sum(1), torch.full((2,), float(5 * group), device=mass.device), rtol=1e-3)
    limits = (torch.arange(t, dtype=torch.int32) * 3).to(DEVICE)  # some queries see no key here
    bigger = lse + 0.5
    got = paged_prefill_mass(q, pages, table, 60, bigger, limits=limits)
    want = paged_prefill_mass_ref(q, pages, table, 60, bigger, limits=limits)
    assert rel_ok(got, want, 3e-3)


def test_mass_errors():
    q, pages, table = _case("int8", torch.float16, 2, 64, 8)
    lse = torch.zeros(8, 4, device=DEVICE)
    with pytest.raises(KernelArgError, match="lse must have shape"):
        paged_prefill_mass(q, pages, table, 20, lse[:4])
    with pytest.raises(KernelArgError, match="first"):
        paged_prefill_mass(q, pages, table, 20, lse, first=9)
    with pytest.raises(KernelArgError, match="seq_len"):
        paged_prefill_mass(q, pages, table, 4, lse)
    assert not paged_prefill_mass(q, pages, table, 20, lse, first=8).any()
