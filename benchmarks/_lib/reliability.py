"""What the reliability benchmarks (audit/sidecar_reliability.py, serving/serve_reliability.py) share:
their one table of checks, each a figure and whether it is as it must be, and the raw plumbing
of the checks (a request sent byte for byte, a process's resident memory). Standard library only."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Row:
    check: str
    figure: str
    ok: bool


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, check: str, figure: str, ok: bool) -> None:
        self.rows.append(Row(check, figure, ok))
        print(f"  {'ok ' if ok else 'BAD'} {check}: {figure}", file=sys.stderr, flush=True)

    def table(self) -> str:
        lines = ["| check | figure | as it must be |", "| --- | --- | --- |"]
        lines += [f"| {r.check} | {r.figure} | {'yes' if r.ok else '**no**'} |" for r in self.rows]
        return "\n".join(lines)


def status_of(answer: bytes) -> int:
    try:
        return int(answer.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0  # closed without an answer


def send_raw(where: tuple, data: bytes, wait_s: float = 5.0) -> int:
    """Send `data` on a fresh connection (TCP port or Unix socket); the status answered."""
    family = socket.AF_UNIX if where[0] == "unix" else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(wait_s)
        s.connect(where[1])
        out = b""
        try:
            s.sendall(data)
            while b"\r\n" not in out and (chunk := s.recv(4096)):
                out += chunk
        except OSError:  # reset after an early answer, or a timeout
            pass
        return status_of(out)


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set of a process, MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
