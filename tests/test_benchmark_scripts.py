"""The GPU benchmark scripts still run: their CPU smoke modes (tiny shapes, no GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cache_benchmark_smoke():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "benchmarks/cache/gpu_cache_bench.py", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("smollm2-135m")]
    assert len(rows) == 4 and not any("FAILED" in line for line in rows)
    gen = [line for line in r.stdout.splitlines() if "KVGuardCache int8" in line]
    assert sum("ms/step" in line for line in gen) == 2  # generation at B = 1 and 2
    assert sum("prompt's forward pass" in line for line in gen) == 2


def test_kernels_ab_refuses_a_copy_named_kernels(tmp_path):
    (tmp_path / "kernels").mkdir()
    r = subprocess.run([sys.executable, "benchmarks/kernels/kernels_ab.py", str(tmp_path / "kernels")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "under another name" in r.stderr


def test_cpu_linear_benchmark_times_each_dtype_and_thread_count(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    try:
        import cpu_linear_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "serving"))
    before = torch.get_num_threads()
    try:
        assert cpu_linear_bench.main(["--small", "--threads", "1", "--dtypes", "float32"]) == 0
        rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
        assert len(rows) == 1 and rows[0][0].strip() == "float32" and rows[0][2].strip().endswith("of 14")
        assert float(rows[0][3]) > 0 and float(rows[0][4]) > 0
        with pytest.raises(SystemExit):
            cpu_linear_bench.main(["--threads", "0"])
        with pytest.raises(SystemExit):
            cpu_linear_bench.main(["--dtypes", "float99"])
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_cache_host_benchmark_runs():
    r = subprocess.run([sys.executable, "benchmarks/cache/cache_host_bench.py", "--shapes", "smollm2-int8+h2o-2",
                        "--steps", "1", "--context", "40"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = r.stdout.splitlines()[-1].split()
    assert row[0] == "smollm2-int8+h2o-2" and float(row[1]) > 0 and float(row[2]) >= 2  # pass 1 and mass at least
    for rows in ("1", "2"):  # a prompt chunk: append + attend for one row, append_chunk + attend_chunk for two
        r = subprocess.run([sys.executable, "benchmarks/cache/cache_host_bench.py", "--shapes", f"smollm2-int8-{rows}",
                            "--steps", "1", "--context", "40", "--chunk", "24"], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        row = r.stdout.splitlines()[-1].split()
        assert row[0] == f"smollm2-int8-{rows}" and float(row[1]) > 0 and float(row[2]) >= 1  # the prefill kernel
    bad = subprocess.run([sys.executable, "benchmarks/cache/cache_host_bench.py", "--shapes", "gpt9-int8-1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "bad shape" in bad.stderr


@pytest.mark.slow
def test_sass_count_compiles_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "benchmarks/kernels/sass_count.py", "--codec", "int4", "--head-dim", "64"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    loops = [line for line in r.stdout.splitlines() if line.strip().startswith("loop ")]
    # the decode loop: tensor-core products and the int4 loader's LOP3s in one backward branch's span
    assert any("HMMA" in line and "LOP3" in line for line in loops), r.stdout
    pre = subprocess.run([sys.executable, "benchmarks/kernels/sass_count.py", "--codec", "int8", "--head-dim", "64", "--kernel",
                          "prefill"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert pre.returncode == 0, pre.stderr[-3000:]
    # the prefill loop: a step of its 4 pages (64 tokens), with the softmax's exponentials (MUFU)
    assert "_prefill_kernel" in pre.stdout
    assert any("per step of 64 tokens" in line and "MUFU" in line for line in pre.stdout.splitlines()), pre.stdout
    bad = subprocess.run([sys.executable, "benchmarks/kernels/sass_count.py", "--config", "[1]"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "JSON object" in bad.stderr
    interp = subprocess.run([sys.executable, "benchmarks/kernels/sass_count.py"], cwd=ROOT,
                            env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=120)
    assert interp.returncode != 0 and "unset TRITON_INTERPRET" in interp.stderr


def test_cache_benchmark_helps_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "benchmarks/cache/gpu_cache_bench.py", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--generate" in r.stdout and "CUDA event" in r.stdout


def test_decode_step_figures_are_medians_with_their_noise():
    from benchmarks._lib import timing as b

    assert b.notch(list(range(1, 101))) == pytest.approx(1.58 * 50.5 / 10)  # quartiles 25.25 and 75.75
    assert b.notch([1.0, 2.0, 3.0]) == float("inf")
    steps = [3.0, 3.1, 2.9, 3.0, 3.05, 2.95, 3.0, 40.0]  # one step held up by the host: not in the median
    assert b.fmt_steps(steps).startswith("3.000 ms/step ±") and "median of 8 steps" in b.fmt_steps(steps)
    assert "too few" in b.fmt_steps([3.0, 3.0])
    assert b.fmt_steps([-1.0, -2.0, 0.0, -0.5]).startswith("no measurement")


def test_a_ratio_within_the_noise_is_not_printed_as_a_figure():
    from benchmarks._lib import timing as b

    a = [2.0, 2.4, 1.6, 2.2, 1.8, 2.1, 1.9, 2.0]
    c = [x + 0.05 for x in a]  # a shift far inside the spread of either
    assert b.fmt_ratio(a, c, "DynamicCache") == "equal to DynamicCache's within the noise"
    fast = [x / 4 for x in a]
    assert b.fmt_ratio(fast, a, "DynamicCache") == "0.25x DynamicCache's"
    assert "too few" in b.fmt_ratio(a[:2], a, "DynamicCache")
    assert "no measurement" in b.fmt_ratio([-x for x in a], a, "DynamicCache")


def test_a_share_of_two_noisy_times_is_printed_only_where_it_can_be_one():
    from benchmarks._lib import timing as b

    assert b.fmt_share(90.0, 100.0) == "  90%"
    assert b.fmt_share(-5.0, 100.0) == "  -  "  # kernels timed longer than the whole step: noise
    assert b.fmt_share(1.0, 0.0) == "  -  "


def test_step_clock_times_each_step_between_ticks():
    from benchmarks._lib import timing as b

    clock = b.StepClock()
    for _ in range(6):
        clock.tick()
    steps = clock.steps_ms(skip=2)
    assert len(steps) == 3 and all(ms >= 0 for ms in steps)


@pytest.mark.slow
def test_serve_bench_small_runs_both_servers():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # each format in this process and over HTTP, beside the machine's roofline for the load
    r = subprocess.run([sys.executable, "benchmarks/serving/serve_bench.py", "--small", "--both", "--roofline"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("| server |"):].splitlines()[2:]
    assert [line.split("|")[1].split("(")[0].strip() for line in table] == [
        "transformers generate_batch", "roofline fp16", "kvguard engine fp16", "kvguard serve-llm fp16",
        "roofline int8", "kvguard engine int8", "kvguard serve-llm int8"]
    roof = None
    for line in table:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert float(cells[2]) > 0  # output tokens/s
        if cells[0].startswith("roofline"):
            roof = float(cells[2])
        if cells[0].startswith("kvguard"):  # requests/s; the fraction of the roofline above it reached
            # (on a shared CPU the roofline's own measurement is as noisy as the run: a run may pass it)
            assert float(cells[3]) > 0 and float(cells[8]) == pytest.approx(float(cells[2]) / roof, abs=0.006)
    roofs = [float(line.split("|")[3]) for line in table if line.startswith("| roofline")]
    assert roofs[1] > roofs[0]  # int8 pages read fewer bytes a step than 16-bit ones
    assert re.search(r"# roofline at \d+: [\d.]+ us a prompt token \(SDPA, no cache\), \d+ GB/s read", r.stdout)
    assert table[3].split("|")[7].strip() == "4"  # peak concurrent sequences: every client at once
    assert r.stderr.count("kvguard serve-llm: warmed up in ") == 2  # serve-llm's start-up warm-up, each codec
    # the engine alone (no HTTP, no sidecar), for a GPU machine without the server's extras
    # with where its steps go: prompt chunks, decode, and one prompt step under torch.profiler
    r = subprocess.run([sys.executable, "benchmarks/serving/serve_bench.py", "--small", "--in-process", "--no-stock",
                        "--phases", "--profile"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("| server |"):].splitlines()[2:]
    assert [line.split("|")[1].split("(")[0].strip() for line in table] == ["kvguard engine fp16",
                                                                            "kvguard engine int8"]
    for codec in ("fp16", "int8"):
        phases = r.stdout[r.stdout.index(f"# phases of kvguard engine {codec}"):]
        calls, tokens = map(int, re.search(r"#   prefill: (\d+) calls, .*?, (\d+) prompt tokens", phases).groups())
        assert calls >= 1 and tokens >= 8 * 48  # 8 prompts of 48 tokens (more if one was preempted)
        assert "#   decode: " in phases and "# one prompt step (" in phases and "aten::" in phases
        assert re.search(r"#   Triton kernel variants built during the run: \d+ in ", phases)
        assert f"# {codec}: warmed up in " in r.stdout


@pytest.mark.slow
def test_compaction_error_benchmark_runs():
    r = subprocess.run([sys.executable, "benchmarks/fidelity/compaction_error.py", "--source", "synthetic", "--compactions", "2",
                        "--budget", "64", "--window", "16", "--fp-window", "16", "--layers", "0", "--codecs", "int8,int4"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(x[1]) for x in rows] == [0, 1, 2]
    assert all(float(x) == 1.0 for x in rows[0][2:6])  # before any compaction: the single encode itself
    assert all(float(x[3]) == 1.0 and float(x[5]) == 1.0 for x in rows)  # values: codes and scales unchanged


@pytest.mark.slow
def test_kvsplit_benchmark_smoke():
    r = subprocess.run([sys.executable, "benchmarks/cache/kvsplit_bench.py", "--smoke"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # (no CUDA graph on the CPU: those columns are nan)
    rows = {x[1].strip(): x for x in (line.split("|") for line in r.stdout.splitlines()) if len(x) == 13
            and x[1].strip() and x[1].strip()[0] in "fi" and x[1].strip() != "configuration"}
    assert {"fp16", "int8", "int8+split f=0.01", "int8+split f=0.05", "int8+split f=0.25"} <= set(rows)
    assert float(rows["int8"][8]) == 1.0 and float(rows["int8"][11]) == 0.0  # the baseline reads nothing from the host
    split = [x for x in (line.split("|") for line in r.stdout.splitlines()) if len(x) == 13 and "split" in x[1]]
    assert len(split) == 18 and all(float(x[11]) > 0 for x in split)  # every split step read cold values
    # the split's keys INT8, INT4, and INT4 with INT8 in host memory: the same device budget holds
    # a longer context with INT4 keys, and the same with INT8 keys in host memory, which a read moves too
    def keys_of(row):  # "int8+split f=0.01", "int8+split k-int4 f=0.01", "int8+split k-int4h f=0.01"
        word = row[1].split()[1]
        return word[2:] if word.startswith("k-") else "int8"

    int8_keys, int4_keys, host_keys = ([x for x in split if keys_of(x) == k] for k in ("int8", "int4", "int4h"))
    assert len(int8_keys) == len(int4_keys) == len(host_keys) == 6
    most = [max(int(x[2].replace(",", "")) for x in rows_) for rows_ in (int8_keys, int4_keys, host_keys)]
    assert most[1] > most[0] and most[2] == most[1]
    for four, host in zip(int4_keys, host_keys, strict=True):
        assert four[1].split()[2:] == host[1].split()[2:] and four[2] == host[2]
        assert float(host[11]) > 1.8 * float(four[11])  # the pages read: their values and their INT8 keys


@pytest.mark.slow
def test_kvsplit_benchmark_times_the_coverage_rule_with_heavy_hitters():
    """`--fractions c0.99` times the shipped policies' coverage rule; random keys spread attention
    so that it reads nearly every cold page, and `--hot` makes a share of the pages hold the
    attention, so that it reads fewer. A rule the split refuses is refused before any work."""
    def mib(hot):
        r = subprocess.run([sys.executable, "benchmarks/cache/kvsplit_bench.py", "--smoke", "--fractions", "c0.99",
                            "--split-keys", "int8", "--hot", hot], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [x for x in (line.split("|") for line in r.stdout.splitlines()) if len(x) == 13
                and x[1].strip() == "int8+split c=0.99"]
        assert len(rows) == 2  # at the split's longest context and at INT8's
        return float(rows[1][11])

    spread, peaked = mib("0"), mib("0.2")
    assert spread > 0 and peaked < 0.5 * spread
    r = subprocess.run([sys.executable, "benchmarks/cache/kvsplit_bench.py", "--smoke", "--fractions", "c1.5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "'c1.5' is not a rule" in r.stderr


@pytest.mark.slow
def test_kvsplit_check_runs_on_the_cpu_under_the_interpreter():
    """The check a GPU run passes before it is timed (benchmarks/cache/kvsplit_check.py), on a tiny
    shape with the kernels interpreted: every comparison but the CUDA graph's, the split's keys
    INT8, INT4, and INT4 with INT8 in host memory, slots, and the picks alone with heavy pages
    in rows long enough for the many-program path (a GPU run compares them at the page counts
    it times, 15,031 and 28,053)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "benchmarks/cache/kvsplit_bench.py", "--smoke", "--check-only"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("check:")]
    assert ": PASSED; with slots vs without, eager 0.00e+00" in line and line.endswith("PASSED")
    assert "picks of 4,513 and 7,019 pages, 1 % heavy, by coverage 0.99 and a top 1 % vs torch's: 0 rows of 8 " \
           "picked others" in line
    assert "row-steps of 6 that read others: [" in line and "not run (no CUDA here)" in line
    without = subprocess.run([sys.executable, "benchmarks/cache/kvsplit_bench.py", "--smoke", "--check-only"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert without.returncode != 0 and "TRITON_INTERPRET=1" in without.stderr


@pytest.mark.slow
def test_kvsplit_benchmark_prefill_smoke():
    """--prefill on the CPU: the reference path only (the kernels need CUDA there), one row per
    configuration, the split's rows reading cold values and INT8's none."""
    r = subprocess.run([sys.executable, "benchmarks/cache/kvsplit_bench.py", "--smoke", "--prefill", "1024", "--layers", "2",
                        "--fractions", "0.25"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x[2].strip(): x for x in (line.split("|") for line in r.stdout.splitlines())
            if len(x) == 8 and x[1].strip().replace(",", "").isdigit()}
    assert set(rows) == {"int8, no split", "split f=0.25", "split mass 0.001"}
    assert float(rows["int8, no split"][5]) == 1.0 and float(rows["int8, no split"][6]) == 0.0
    assert float(rows["split f=0.25"][6]) > 0 and rows["split f=0.25"][3].strip() == "-"  # no kernel path on the CPU


def test_kvsplit_benchmark_slots_rows_serve_host_keys():
    """The --slots rows' set-up (with_slots) on the kernel path, interpreted on the CPU, with the
    INT8 keys in host memory: the slots hold what a read attends over (the INT8 keys and the
    values), a step reads through them, and the slots go away after."""
    import argparse

    from kvguard.kernels._checks import interpreting

    if not interpreting():
        pytest.skip("the kernel path runs on the CPU only under TRITON_INTERPRET=1")
    from benchmarks.cache import kvsplit_bench as kb

    args = argparse.Namespace(shape="tiny", device="cpu", budget_gb=0.002, batch=2, window=64, chunk=256, steps=2,
                              warmup=0, hot=0.0)
    m, _, tokens = kb.make(args, "split", "0.25", "int4h", kernels=True)
    assert m.cfg.use_kernels and m.split.exact and tokens > 300
    seqs = kb.fill(m, 300, args)
    seen = []

    def run(hot, label):
        assert {n: t.dtype for n, t in hot.fields[0].items()} == {"k": torch.int8, "k_scale": torch.float16,
                                                                   "v": torch.int8, "v_scale": torch.float16}
        ms, fetched = kb.decode(m, seqs, args)
        seen.append((label, fetched, int((hot.slot_page >= 0).sum())))

    kb.with_slots(m, seqs, "0.25", "int4h", 2, run)
    (label, fetched, held), = seen
    assert label == "slots 2xk" and fetched > 0 and held > 0
    assert m.split.hot is None and not m.split.pool.on_wipe


@pytest.mark.slow
@pytest.mark.parametrize("script, args, last", [
    ("audit_bench.py", ["--records", "40", "--no-postgres"], "| verify_store, SQLite ("),
    ("audit_bundle_bench.py", ["--records", "40", "--no-postgres"], "| verify bundle offline"),
    ("kek_rotation_bench.py", ["--secrets", "20", "--no-postgres"], "sqlite      wrap 20 secrets"),
    ("witness_bench.py", ["--checkpoints", "5", "--records", "4"], "5 checkpoints of 4 records each"),
], ids=["audit", "audit-bundle", "kek-rotation", "witness"])
def test_audit_benchmarks_small(script, args, last):
    """The audit store's benchmarks on SQLite at a few records: each runs to its table."""
    r = subprocess.run([sys.executable, f"benchmarks/audit/{script}", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[-1].startswith(last), r.stdout[-2000:]
    assert script in ("kek_rotation_bench.py", "witness_bench.py") or lines[0].startswith("# ") and \
        " CPUs, Python " in lines[0]


def test_markdown_tables_and_json_results(tmp_path):
    from benchmarks._lib.report import md_head, md_row, write_json

    assert md_head("a", "b c") == "| a | b c |\n|---|---|"
    assert md_row(1, "x") == "| 1 | x |"
    path = write_json(str(tmp_path), "r.json", {"rows": [1.5]})
    assert path == str(tmp_path / "r.json") and (tmp_path / "r.json").read_text() == '{\n "rows": [\n  1.5\n ]\n}'


def test_triton_small_k_runs_its_code_path_under_the_interpreter():
    """The check of Triton's 16-deep products over joined nibbles (a GPU gives the answer; the
    interpreter's NumPy dot is right everywhere, so every row reads ok), and its refusal to run
    on a CPU without the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "benchmarks/kernels/triton_small_k.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("dot fp16")]
    assert len(rows) == 12 and all(line.endswith(" ok") for line in rows), r.stdout
    assert sum("joined nibbles" in line for line in rows) == 6
    env.pop("TRITON_INTERPRET")
    r = subprocess.run([sys.executable, "benchmarks/kernels/triton_small_k.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr


@pytest.mark.slow
def test_int4_screen_small():
    """The 4-bit screen on SmolLM2's own Q/K/V, one text of 512 tokens, two formats: each a
    row with a deviation per text, the rotated one below KIVI's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "benchmarks/fidelity/int4_screen.py", "--texts", "stdlib-code", "--tokens", "512",
                        "--variants", "kivi,rot"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ") and "%" in line}
    assert set(rows) == {"kivi", "rot"}, r.stdout
    mean = {n: float(re.search(r"\| ([0-9.]+)%, ", line).group(1)) for n, line in rows.items()}
    assert 0 < mean["rot"] < mean["kivi"] < 10, mean


@pytest.mark.slow
def test_kvsplit_tune_smoke_under_the_interpreter():
    """--tune's per-layer parts (key pass configurations, picks, INT8's decode) on the CPU, each
    run once under the interpreter: the code path, not a time."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "benchmarks/cache/kvsplit_bench.py", "--smoke", "--tune", "256"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "256 tokens a row (16 pages)" in r.stdout and "WRONG" not in r.stdout and "failed" not in r.stdout, r.stdout
    assert "fastest: " in r.stdout and "picks by coverage 0.99" in r.stdout and " decode of the layer" in r.stdout
