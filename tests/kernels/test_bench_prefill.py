"""benchmarks/kernels/gpu_bench.py's prompt-chunk benchmark: its rows and table, on tiny shapes (the
interpreter without a GPU: no SDPA baseline there, every codec's paged_prefill run once)."""

import pytest

import benchmarks.kernels.gpu_bench as gb


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


def test_decode_table_reads_the_fastest_sdpa_and_read_floors():
    row = {"model": "llama3-8b", "L": 1024, "B": 8, "kv16_GB": 0.03, "sdpa_flash": 30e-6, "sdpa_cudnn_gqa": 20e-6,
           "sdpa": 20e-6, "sdpa_best": "cudnn_gqa", "16bit": 22e-6, "int8": 10e-6, "fp8": 10e-6, "int4": 8e-6,
           "int4+rot": 9e-6}
    for c, fl in (("16bit", 11e-6), ("int8", 5e-6), ("fp8", 5e-6), ("int4", 2e-6)):
        row["floor_" + c], row["read_floor_" + c] = 2 * fl, fl
    head, _, line = gb.table([row])
    assert "best sdpa" in head and "i4/rfl" in head
    assert "cudnn_gqa" in line.split("|")[0]
    us, ratios, speedups = (part.split() for part in line.split("|")[1:4])
    assert us[:2] == ["20.0", "20.0"] and us[2] == "-"  # sdpa, cudnn_gqa, no deq_sdpa
    assert ratios == ["2.00", "2.00", "2.00", "4.00"]  # time over the read floor
    assert speedups == ["0.91", "2.00", "2.00", "2.50"]  # fastest SDPA over the variant
