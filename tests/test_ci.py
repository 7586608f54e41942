"""The test run's own machinery: `make test`'s `--dist loadgroup` keeps an `xdist_group` on one
worker, in file order (vLLM's tests start one engine per store and stop it in their last test).
A pytest that xdist cannot tag (9.2 with xdist 3.8) silently spreads a group over the workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_loadgroup_keeps_a_group_on_one_worker_in_order(tmp_path):
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent("""
        import os, time, pytest
        pytestmark = pytest.mark.xdist_group("g")

        @pytest.mark.parametrize("i", range(6))
        def test_g(i):
            time.sleep(0.05)
            with open("order.txt", "a") as f:
                f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {i}\\n")
        """))
    (tmp_path / "test_free.py").write_text(textwrap.dedent("""
        import time, pytest

        @pytest.mark.parametrize("i", range(6))
        def test_f(i):
            time.sleep(0.05)
        """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadgroup", "-c", "/dev/null", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in (tmp_path / "order.txt").read_text().splitlines()]
    assert len({w for w, _ in rows}) == 1, rows
    assert [int(i) for _, i in rows] == list(range(6))
