"""Torch work off the model's thread leaves no OpenMP team behind (kvguard/threads.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvguard.threads import on_a_thread

ROOT = Path(__file__).resolve().parents[1]


def test_on_a_thread_returns_raises_and_ends():
    seen = []
    assert on_a_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="gone"):
        on_a_thread(lambda: {}["gone"])


SCRIPT = """
import os, threading, time, torch
from kvguard.threads import on_a_thread
torch.set_num_threads(2)
x = torch.randn(1 << 22)
def work():
    return float((x * 2).sum())  # parallel: the thread's team of 2
def threads():
    time.sleep(0.5)  # a team's threads end shortly after the thread that led them
    return len(os.listdir("/proc/self/task"))
work()  # the model's thread (here the main one) and its team
base = threads()
on_a_thread(work)
after = threads()
stop = threading.Event()
t = threading.Thread(target=lambda: (work(), stop.wait()))
t.start()
living = threads()
stop.set()
t.join()
print(base, after, living)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_work_on_a_thread_leaves_no_openmp_team_beside_the_models():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    base, after, living = map(int, out.stdout.split())
    assert after == base  # the work's thread and its team are gone
    assert living == base + 2  # a thread that lives on keeps its team (itself and a worker): what is avoided
