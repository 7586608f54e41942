"""benchmarks/gpu_bench.py's prompt-chunk benchmark: its rows and table, on tiny shapes (the
interpreter without a GPU: no SDPA baseline there, every codec's paged_prefill run once)."""

import pytest

import benchmarks.gpu_bench as gb


def test_causal_pairs_counts_what_each_query_sees():
    # queries 6..9 of 10 tokens see 7, 8, 9 and 10 keys
    assert gb.causal_pairs(10, 4) == 7 + 8 + 9 + 10
    assert gb.causal_pairs(5, 5) == 15


def test_prefill_rows_and_table():
    rows = [gb.bench_prefill("smollm2-135m", 64, 16, codecs=("16bit", "int4"))]
    r = rows[0]
    assert (r["model"], r["L"], r["T"]) == ("smollm2-135m", 64, 16)
    assert r["tflop"] == pytest.approx(4 * 9 * 64 * gb.causal_pairs(64, 16) / 1e12)
    assert r["16bit"] > 0 and r["int4"] > 0 and "int8" not in r
    head, rule, line = gb.prefill_table(rows)
    assert head.split()[:4] == ["model", "L", "T", "TFLOP"] and set(rule) == {"-"}
    assert line.split()[:3] == ["smollm2-135m", "64", "16"]
    cells = line.split("|")[1].split()  # sdpa deq_sdpa 16bit int8 fp8 int4, in µs
    assert len(cells) == 6 and float(cells[2]) > 0 and cells[3] == "-" and float(cells[5]) > 0


def test_prefill_variant_configs_reach_the_kernel():
    # a config the kernel refuses (int4 with one 16-token page per step) shows as refused, not timed
    grid = gb.variant_configs({"one": {"int4": {"pages": 1}}}, 64)
    r = gb.bench_prefill("smollm2-135m", 64, 16, configs=grid, codecs=("int4",))
    assert r["int4 one"] == float("inf")
