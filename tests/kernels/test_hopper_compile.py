"""The K/V split's normalizer and picks compile for an H200 (sm_90) here, without one: both
ways each runs (one program a row, many), as a decode step at 240K tokens and a short one
launch them (tests/kernels/hopper_compile.py). The interpreter runs their arithmetic
(test_page_scores.py); this catches what only the compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_picks_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    r = subprocess.run([sys.executable, str(HERE / "hopper_compile.py")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    done = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("ok ")}
    assert {"_total_kernel", "_total_part_kernel", "_total_join_kernel", "_page_mass_kernel", "_page_pick_kernel",
            "_many_digit_kernel", "_many_count_kernel", "_many_write_kernel"} <= done
    assert any(p.suffix == ".cubin" for p in tmp_path.rglob("*")), "no cubin was written"
