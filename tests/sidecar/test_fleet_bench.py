"""The fleet benchmark's small run (benchmarks/audit/fleet_bench.py): two sidecars on one
PostgreSQL database under load, every erasure completed and the table printed."""

from __future__ import annotations

from benchmarks.audit.fleet_bench import main


def test_the_small_fleet_run_completes_every_erasure(capsys):
    status = main(["--small"])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err[-3000:]
    row = out.out.strip().splitlines()[-1].split("|")
    assert row[1].strip() == "2" and float(row[3].strip().replace(",", "")) > 0  # sidecars, records/s
    assert int(row[4]) == int(row[5]) >= 3  # every erasure posted completed
