"""The serve-llm reliability benchmark's small run (benchmarks/serving/serve_reliability.py): every
figure of its table as it must be, against a real `kvguard serve-llm` process beside a
production-mode sidecar. Each fix the table measures has its own test in test_serve_llm.py."""

from __future__ import annotations

from benchmarks.serving.serve_reliability import main


def test_the_small_serve_llm_reliability_run_has_every_figure_right(capsys):
    status = main(["--small"])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err[-3000:]
    assert "| route x credential | " in out.out and "| idle and slow connections | " in out.out
