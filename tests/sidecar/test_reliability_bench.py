"""The reliability benchmark's small run (benchmarks/audit/sidecar_reliability.py): every figure of
its table as it must be. On PostgreSQL only: it is the store with the outage check, and each
fix the table measures has its own test (test_reliability.py), on both stores where both apply."""

from __future__ import annotations

import pytest

from benchmarks.audit.sidecar_reliability import main


@pytest.mark.slow
def test_the_small_reliability_run_has_every_figure_right(capsys):
    status = main(["--small", "--db", "postgresql"])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err[-3000:]
    assert "| bad-input corpus, both APIs" in out.out and "wrong" in out.out
