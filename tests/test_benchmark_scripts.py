"""The GPU benchmark scripts still run: their CPU smoke modes (tiny shapes, no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cache_benchmark_smoke():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "benchmarks/gpu_cache_bench.py", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("smollm2-135m")]
    assert len(rows) == 4 and not any("FAILED" in line for line in rows)
    gen = [line for line in r.stdout.splitlines() if "KVGuardCache int8" in line]
    assert sum("ms/step" in line for line in gen) == 2  # generation at B = 1 and 2
    assert sum("prompt's forward pass" in line for line in gen) == 2


def test_kernels_ab_refuses_a_copy_named_kernels(tmp_path):
    (tmp_path / "kernels").mkdir()
    r = subprocess.run([sys.executable, "benchmarks/kernels_ab.py", str(tmp_path / "kernels")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "under another name" in r.stderr


def test_cache_host_benchmark_runs():
    r = subprocess.run([sys.executable, "benchmarks/cache_host_bench.py", "--shapes", "smollm2-int8+h2o-2",
                        "--steps", "1", "--context", "40"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = r.stdout.splitlines()[-1].split()
    assert row[0] == "smollm2-int8+h2o-2" and float(row[1]) > 0 and float(row[2]) >= 2  # pass 1 and mass at least
    for rows in ("1", "2"):  # a prompt chunk: append + attend for one row, append_chunk + attend_chunk for two
        r = subprocess.run([sys.executable, "benchmarks/cache_host_bench.py", "--shapes", f"smollm2-int8-{rows}",
                            "--steps", "1", "--context", "40", "--chunk", "24"], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        row = r.stdout.splitlines()[-1].split()
        assert row[0] == f"smollm2-int8-{rows}" and float(row[1]) > 0 and float(row[2]) >= 1  # the prefill kernel
    bad = subprocess.run([sys.executable, "benchmarks/cache_host_bench.py", "--shapes", "gpt9-int8-1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "bad shape" in bad.stderr


def test_sass_count_compiles_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "benchmarks/sass_count.py", "--codec", "int4", "--head-dim", "64"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    loops = [line for line in r.stdout.splitlines() if line.strip().startswith("loop ")]
    # the decode loop: tensor-core products and the int4 loader's LOP3s in one backward branch's span
    assert any("HMMA" in line and "LOP3" in line for line in loops), r.stdout
    pre = subprocess.run([sys.executable, "benchmarks/sass_count.py", "--codec", "int8", "--head-dim", "64", "--kernel",
                          "prefill"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert pre.returncode == 0, pre.stderr[-3000:]
    # the prefill loop: a step of its 4 pages (64 tokens), with the softmax's exponentials (MUFU)
    assert "_prefill_kernel" in pre.stdout
    assert any("per step of 64 tokens" in line and "MUFU" in line for line in pre.stdout.splitlines()), pre.stdout
    bad = subprocess.run([sys.executable, "benchmarks/sass_count.py", "--config", "[1]"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "JSON object" in bad.stderr
    interp = subprocess.run([sys.executable, "benchmarks/sass_count.py"], cwd=ROOT,
                            env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=120)
    assert interp.returncode != 0 and "unset TRITON_INTERPRET" in interp.stderr
