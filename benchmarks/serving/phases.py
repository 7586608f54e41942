"""Where serve-llm's engine spends its steps: serve_bench.py --phases (and --profile).

The engine's prompt chunks, its decode steps and a decode step's parts, each timed on the
engine's thread with the device synchronized around it; optionally one prompt step and one
decode step under torch.profiler; and the Triton kernel variants built while timing.
"""

from __future__ import annotations

import time

_PHASES = None  # the Phases of the engine being timed


def _phase(fn, label: str):
    """fn timed into the current Phases under `label`, the device synchronized around it."""
    def run(*a, **kw):
        ph = _PHASES
        if ph is None:
            return fn(*a, **kw)
        ph._sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            ph._sync()
            ph._add(label, time.perf_counter() - t0, 0)
    return run


class Phases:
    """Where the engine's steps go (--phases): each step's prompt chunks, decode and the rest
    (reap, schedule, open, free), timed on the engine's thread with the device synchronized
    around each, so device time lands in the phase that queued it, and a decode step's parts
    apart; with --profile, one prompt step and one decode step of at least 3/4 of the rows after
    the warm-up run under torch.profiler, their top kernels and host ops printed. Also
    counted: the Triton kernel variants the timed run had to build (Triton's JIT hooks), and
    the seconds they took, which a warm-up is there to leave at zero."""

    def __init__(self, engine, profile: bool = False):
        self.engine, self.profile, self.t = engine, profile, {}
        self.table = self.decode_table = None
        self.armed, self.decode_steps = False, 0  # after the warm-up (reset): the prompt step profiled is one of the run's
        self.built: dict[str, int] = {}
        self.build_s, self._t_build = 0.0, 0.0
        try:
            from triton import knobs
        except ImportError:
            knobs = None
        if knobs is not None:
            def before(**kw):
                self._t_build = time.perf_counter()
                return None  # compile it

            def after(**kw):
                if self.armed:
                    name = kw["fn"].name
                    self.built[name] = self.built.get(name, 0) + 1
                    self.build_s += time.perf_counter() - self._t_build

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
        for name in ("_prefill", "_decode"):
            setattr(engine, name, self._timed(name, getattr(engine, name)))
        self._split_decode()
        step = engine.step

        def timed_step():
            self._sync()
            t0 = time.perf_counter()
            step()
            self._sync()
            self._add("step", time.perf_counter() - t0, 0)

        engine.step = timed_step

    def _split_decode(self) -> None:
        """The parts of a decode step, timed apart (the device synchronized around each): the
        host's bookkeeping before the graph (StaticStep.begin), the graph's replay, what follows
        it (StaticStep.end: lengths, pages quantized as they leave the 16-bit window), and
        sampling, and making text of the tokens sampled before (which runs while the device
        works, but for these syncs)."""
        import torch

        from kvguard.cache.step import StaticStep

        global _PHASES
        _PHASES = self
        if getattr(StaticStep, "_phased", False):
            return
        for cls, name, label in ((StaticStep, "begin", "decode: graph's bookkeeping before"),
                                 (StaticStep, "end", "decode: after the graph (lengths, quantize)"),
                                 (torch.cuda.CUDAGraph, "replay", "decode: graph replay (device)")):
            setattr(cls, name, _phase(getattr(cls, name), label))
        StaticStep._phased = True
        for name, label in (("_sample", "sample (prompt steps too)"),
                            ("_catch_up", "decode: text of the tokens before, while the device runs")):
            setattr(self.engine, name, _phase(getattr(self.engine, name), label))

    def _sync(self) -> None:
        import torch

        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def _add(self, name: str, seconds: float, tokens: int) -> None:
        n, s, k = self.t.get(name, (0, 0.0, 0))
        self.t[name] = (n + 1, s + seconds, k + tokens)

    def _timed(self, name: str, fn):
        def run(rows, *rest):
            tokens = sum(n for _, n in rows) if name == "_prefill" else len(rows)
            self._sync()
            t0 = time.perf_counter()
            if name == "_prefill" and self.profile and self.table is None and self.armed:
                self.table = self._profiled(fn, rows, *rest)
            elif (name == "_decode" and self.profile and self.decode_table is None and self.armed
                  and len(rows) >= self.engine.scheduler.max_seqs * 3 // 4 and self.t.get("decode", (0,))[0] >= 20):
                self.decode_table = self._profiled(fn, rows, *rest, what="decode")
            else:
                fn(rows, *rest)
            self._sync()
            self._add(name.strip("_"), time.perf_counter() - t0, tokens)
        return run

    def _profiled(self, fn, rows, *rest, what: str = "prompt") -> str:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.engine.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            fn(rows, *rest)
            self._sync()
        key = "cuda_time_total" if ProfilerActivity.CUDA in acts else "cpu_time_total"
        tokens = sum(n for _, n in rows) if what == "prompt" else len(rows)
        return (f"# one {what} step ({len(rows)} rows, {tokens} tokens), by device time:\n"
                + prof.key_averages().table(sort_by=key, row_limit=25)
                + "\n# by host time of the op itself:\n"
                + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

    def reset(self) -> None:
        self.t, self.armed, self.decode_steps = {}, True, self.engine.decode_steps
        self.built, self.build_s = {}, 0.0

    def report(self, codec: str) -> None:
        step = self.t.get("step", (0, 0.0, 0))
        print(f"# phases of kvguard engine {codec}: {step[0]} steps, {step[1]:.2f} s", flush=True)
        for name in ("prefill", "decode"):
            n, s, k = self.t.get(name, (0, 0.0, 0))
            unit = "prompt tokens" if name == "prefill" else "rows"
            print(f"#   {name}: {n} calls, {s:.2f} s ({100 * s / max(step[1], 1e-9):.0f} %), {k} {unit}, "
                  f"{1e3 * s / max(n, 1):.1f} ms a call, {1e6 * s / max(k, 1):.0f} us per {unit[:-1]}", flush=True)
        steps = self.engine.decode_steps - self.decode_steps
        print(f"#     decode steps {steps}, {steps - self.t.get('decode', (0,))[0]} of them queued ahead of the "
              "tokens before (the syncs here keep them from overlapping)", flush=True)
        for name in sorted(n for n in self.t if n.startswith(("decode:", "sample"))):
            n, s, _ = self.t[name]
            print(f"#     {name}: {n} calls, {1e3 * s / max(n, 1):.2f} ms a call", flush=True)
        rest = step[1] - sum(self.t.get(n, (0, 0.0, 0))[1] for n in ("prefill", "decode"))
        print(f"#   the rest of the steps (reap, schedule, open, free): {rest:.2f} s", flush=True)
        built = ", ".join(f"{n} x{k}" for n, k in sorted(self.built.items(), key=lambda x: -x[1]))
        print(f"#   Triton kernel variants built during the run: {sum(self.built.values())} in {self.build_s:.2f} s"
              + (f" ({built})" if built else ""), flush=True)
        for table in (self.table, self.decode_table):
            if table:
                print(table, flush=True)
