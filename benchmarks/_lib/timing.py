"""Device time as the benchmarks take it: a CUDA graph of calls replayed between CUDA events,
a decode step's boundaries marked on the GPU's timeline, and the median of noisy steps with its
notch (a ratio of two medians is printed only where their notches do not overlap). Without CUDA
(--smoke), the host's clock: the code path, not a time."""

from __future__ import annotations

import math
import statistics
import time

import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEV.type == "cuda"


def sync(dev: torch.device = DEV) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_calls(calls, min_total_s=0.04, max_reps=200) -> float:
    """Seconds per call: calls[i] touch disjoint data; a CUDA graph of all of them is replayed."""
    if not GPU:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) / len(calls)
    for c in calls:
        c()  # compile, autotune-free warm up
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls[0]()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    reps = max(5, min(max_reps, int(min_total_s / max(time.perf_counter() - t, 1e-6))))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in ev)
    del g
    return ms / 1e3 / len(calls)


class StepClock:
    """Marks the boundaries of decode steps on the GPU's timeline (a CUDA event recorded on the
    current stream at each tick; without CUDA, the host's clock) and gives the time between
    consecutive ticks: one decode step each, whatever the host or the GPU spent on it."""

    def __init__(self):
        self.marks: list = []

    def tick(self) -> None:
        if DEV.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def steps_ms(self, skip: int = 0) -> list[float]:
        """ms between consecutive ticks, leaving out the first `skip` steps (warm-up, capture)."""
        sync()
        if DEV.type == "cuda":
            ms = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            ms = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return ms[skip:]


def median(xs) -> float:
    return statistics.median(xs)


def notch(xs) -> float:
    """Half-width of the median's notch (McGill, Tukey and Larsen: 1.58 IQR / sqrt(n)): two medians
    whose notches do not overlap differ at roughly 95 % confidence. Infinite below 4 samples."""
    if len(xs) < 4:
        return float("inf")
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 1.58 * (q3 - q1) / math.sqrt(len(xs))


def fmt_steps(xs) -> str:
    """A variant's decode steps: their median and its notch, or why there is no figure."""
    if len(xs) < 4:
        return f"too few decode steps to time ({len(xs)})"
    m = median(xs)
    if not math.isfinite(m) or m <= 0:  # a step cannot take no time: a broken clock, not a measurement
        return f"no measurement (median {m} ms)"
    return f"{m:.3f} ms/step ±{notch(xs):.3f} (median of {len(xs)} steps)"


def fmt_ratio(xs, ys, name: str) -> str:
    """xs's median over ys's, when the two differ by more than their notches; else says so."""
    if len(xs) < 4 or len(ys) < 4:
        return f"not compared with {name}'s (too few steps)"
    mx, my = median(xs), median(ys)
    if not (mx > 0 and my > 0):
        return f"not compared with {name}'s (no measurement)"
    if abs(mx - my) <= notch(xs) + notch(ys):
        return f"equal to {name}'s within the noise"
    return f"{mx / my:.2f}x {name}'s"


def fmt_share(part: float, whole: float) -> str:
    """part / whole as a percentage, where it can be one (5 characters); '  -  ' where the two
    noisy times give a share below 0 or above 1."""
    if not (whole > 0) or not (0 <= part <= whole):
        return "  -  "
    return f"{part / whole:5.0%}"
