"""The cache on a GPU, end to end: CacheManager on CUDA (quantize-on-write and paged decode
through the Triton kernels) checked against its reference path; the time of a decode step of a
whole model's layers through the cache, rows one by one and as one batch, beside the kernels'
own device time, and as one batch replayed from a CUDA graph (kvguard.cache.step.StaticStep);
then generation of a random-weight model through KVGuardCache beside transformers'
DynamicCache + SDPA, eagerly and with each decode step replayed from a CUDA graph (against
StaticCache + SDPA, graphed the same way).

    PYTHONPATH=. python3 benchmarks/cache/gpu_cache_bench.py [--models smollm2-135m,llama3-8b]
        [--contexts 1024,16384] [--batches 1,8] [--codecs fp16,int8,int4,fp8,int8+h2o] [--steps 10]
        [--generate 64 --prompt 1024] [--profile MODEL:CONTEXT:CODEC[:ROWS]] [--launch]
        [--profile-prefill MODEL:CONTEXT:CHUNK:CODEC[+EVICTOR]]
        [--prefill MODEL:CONTEXT:CHUNK:CODEC[+EVICTOR]] [--out DIR]

A decode step is what a serving process does per new token: for every layer, append each row's
K/V and attend over everything the row holds (CacheManager.append + attend per row, or
append_step + attend_step for the batch). Its wall time (CUDA synchronized after the steps) is
set beside the device time of the decode kernels of the same step (captured in a CUDA graph and
replayed), so the host's share shows. In generation, decode steps are timed directly: a CUDA
event at every step's boundary, the median over many steps with its notch; a ratio between two
variants is printed only where their notches do not overlap. Needs torch, triton and (for
--generate) transformers, and kvguard installed from this tree (`pip install --no-deps -e .`:
kernels/ imports as kvguard.kernels only once installed). Without CUDA, --help and --smoke (the
reference path at tiny shapes) still run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

from benchmarks._lib.report import write_json  # noqa: E402
from benchmarks._lib.timing import StepClock, fmt_ratio, fmt_share, fmt_steps, sync, time_calls  # noqa: E402
from kvguard.cache import CacheConfig, CacheManager  # noqa: E402
from kvguard.cache.attention import dense_attention  # noqa: E402
from kvguard.types import Subject  # noqa: E402

MODELS = {"smollm2-135m": (30, 9, 3, 64), "llama3-8b": (32, 32, 8, 128)}  # layers, Hq, H, D
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def make_cache(model: str, context: int, codec: str, evictor: str | None = None,
               rows: int = 1, room: int = 0) -> tuple[CacheManager, list]:
    """A cache on the GPU holding `rows` sequences of `context` random tokens each (an outlier
    key channel), prefilled in chunks of 4096 as a server would; `room`: tokens a row may add."""
    layers, hq, h, d = MODELS[model]
    pages = rows * ((context + room) // 16 + 64)
    opts = {"budget": context + 4096} if evictor else {}
    cfg = CacheConfig(num_layers=layers, num_kv_heads=h, num_query_heads=hq, head_dim=d, num_pages=pages,
                      dtype=torch.bfloat16, device=DEV, codec=codec, fp_sink=4 if codec != "fp16" else 0,
                      fp_window=128 if codec != "fp16" else 0, evictor=evictor, evictor_options=opts)
    m = CacheManager(cfg)
    seqs = [m.open(Subject("bench", f"user-{i}", f"session-{i}")) for i in range(rows)]
    g = torch.Generator(device=DEV).manual_seed(0)
    for seq in seqs:
        for lo in range(0, context, 4096):
            n = min(4096, context - lo)
            for layer in range(layers):
                k = torch.randn(n, h, d, generator=g, device=DEV, dtype=torch.bfloat16)
                k[..., 3] *= 8
                v = torch.randn(n, h, d, generator=g, device=DEV, dtype=torch.bfloat16)
                assert m.append(seq, layer, k, v)
    return m, seqs


def decode_steps(m: CacheManager, seqs: list, steps: int, batched: bool, repeats: int = 5) -> tuple[float, float]:
    """Wall time of a decode step of every row (for every layer: append one token and attend),
    the rows one at a time (append + attend) or as one batch (append_step + attend_step), and
    the host thread's CPU time in it: the fastest of `repeats` runs of `steps` steps, after two
    warm-up steps (the host's speed drifts by tens of percent between runs; the fastest run is
    the one least disturbed, and CPU time leaves out the time the thread was not running)."""
    c = m.cfg
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(len(seqs), c.num_query_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)
    k = torch.randn(len(seqs), c.num_kv_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)

    def run(n):
        for _ in range(n):
            for layer in range(c.num_layers):
                if batched:
                    assert m.append_step(seqs, layer, k, k)
                    m.attend_step(seqs, layer, q)
                else:
                    for i, seq in enumerate(seqs):
                        assert m.append(seq, layer, k[i : i + 1], k[i : i + 1])
                        m.attend(seq, layer, q[i : i + 1])

    run(2)
    times, cpu = [], []
    for _ in range(repeats):
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        run(steps)
        sync()
        times.append((time.perf_counter() - t0) / steps)
        cpu.append((time.thread_time() - c0) / steps)
    return min(times), min(cpu)


def graph_steps(m: CacheManager, seqs: list, steps: int, repeats: int = 5) -> tuple[float, float]:
    """As decode_steps for the batch, with each step's layers (write the token, attend) replayed
    from a CUDA graph through a StaticStep: the host's work per step is the static step's begin
    and end around one replay. Returns the wall time of a step and the host's time to queue one
    (the steps' time before the closing synchronization, which the host spends spinning)."""
    if DEV.type != "cuda":  # --smoke
        return float("nan"), float("nan")
    try:
        from kvguard.cache.step import StaticStep
    except ImportError:  # an older cache
        return float("nan"), float("nan")
    c = m.cfg
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(len(seqs), c.num_query_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)
    k = torch.randn(len(seqs), c.num_kv_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)
    st = StaticStep(m, seqs, max(m.length(s) for s in seqs) + 4 + repeats * steps)

    def layers():
        for layer in range(c.num_layers):
            st.write(layer, k, k)
            st.attend(layer, q)

    with st:  # eagerly: compiles and fills the kernels' caches
        layers()
    graph = torch.cuda.CUDAGraph()
    with st:
        with torch.cuda.graph(graph):
            layers()
        graph.replay()
    with st:
        graph.replay()
    times, host = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            with st:
                graph.replay()
        t1 = time.perf_counter()  # the host has queued every step; the GPU may still be at work
        sync()
        times.append((time.perf_counter() - t0) / steps)
        host.append((t1 - t0) / steps)
    return min(times), min(host)


def kernel_time(m: CacheManager, seqs: list) -> float:
    """Device time of the decode kernels of one batch step: every layer's paged decode over the
    rows' pages as the cache hands them over, timed by _lib.timing.time_calls (a CUDA graph of the
    step replayed: no host in the way)."""
    tables = getattr(m, "block_tables", None)
    decode_args = tables.decode_args if tables is not None else getattr(m, "_decode_args", None)
    if decode_args is None or DEV.type != "cuda":  # an older CacheManager; no GPU (--smoke)
        return float("nan")
    from kvguard.cache import paged

    c = m.cfg
    q = torch.randn(len(seqs), c.num_query_heads, c.head_dim, device=DEV, dtype=c.dtype)
    rows = [m._seq(seq) for seq in seqs]
    mass = m.evictor is not None and m.evictor.needs_mass
    # the layers' kernel arguments as the cache makes them (with an evictor, the replays add
    # their mass into the rows' totals too)
    calls = [decode_args(rows, layer, mass) for layer in range(c.num_layers)]

    def step():
        for args in calls:
            paged.decode(q, *args)

    return time_calls([step])


def check(m: CacheManager, seqs: list) -> float:
    """The kernel path's output against the reference path (dense attention over the
    dequantized pages) at every layer, for the batch as one decode step and for a chunk of
    queries in the first row; the worst relative error."""
    c = m.cfg
    q = torch.randn(len(seqs), c.num_query_heads, c.head_dim, device=DEV, dtype=c.dtype)
    worst = 0.0
    for layer in range(c.num_layers):
        got = m.attend_step(seqs, layer, q) if hasattr(m, "attend_step") else torch.cat(
            [m.attend(seq, layer, q[i : i + 1]) for i, seq in enumerate(seqs)])
        for i, seq in enumerate(seqs):
            k, v = m.kv(seq, layer, dtype=torch.float32)
            want, _ = dense_attention(q[i : i + 1], k, v)
            worst = max(worst, rel(got[i : i + 1], want))
    # a chunk of 48 queries after the context (the prefill path), in the first row
    g = torch.Generator(device=DEV).manual_seed(2)
    k = torch.randn(48, c.num_kv_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)
    for layer in range(c.num_layers):
        assert m.append(seqs[0], layer, k, k)
    q = torch.randn(48, c.num_query_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)
    for layer in range(c.num_layers):
        got = m.attend(seqs[0], layer, q)
        want, _ = dense_attention(q, *m.kv(seqs[0], layer, dtype=torch.float32))
        worst = max(worst, rel(got, want))
    return worst


def bench_prefill(specs: str, rounds: int = 3) -> list[str]:
    """A prompt chunk through the cache: for every layer, append the chunk's K/V and attend its
    queries (CacheManager.append + attend, one row), after `context` tokens; specs are
    MODEL:CONTEXT:CHUNK:CODEC[+h2o|+snapkv] (comma-separated). With an evictor the chunk's
    attention mass is accumulated too. ms for the chunk over every layer, fastest of `rounds`,
    each on a fresh cache."""
    lines = []
    for spec in specs.split(","):
        model, context, chunk, codec = spec.split(":")
        context, chunk = int(context), int(chunk)
        evictor = None
        if "+" in codec:
            codec, evictor = codec.split("+")
        best = float("inf")
        for _ in range(rounds):
            best = min(best, _chunk_run(model, context, chunk, codec, evictor))
        lines.append(f"prefill {model} after {context} tokens, a chunk of {chunk}, {codec}"
                     f"{' + ' + evictor if evictor else ''}: {best * 1e3:.1f} ms over every layer")
        print(lines[-1], flush=True)
    return lines


def _chunk_run(model: str, context: int, chunk: int, codec: str, evictor: str | None, prof=None) -> float:
    """Seconds for one chunk through every layer of a fresh cache (append + attend, one row); with
    prof (a cProfile.Profile), profiled."""
    m, seqs = make_cache(model, context, codec, evictor, room=chunk)
    c = m.cfg
    g = torch.Generator(device=DEV).manual_seed(3)
    k = torch.randn(chunk, c.num_kv_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)
    q = torch.randn(chunk, c.num_query_heads, c.head_dim, generator=g, device=DEV, dtype=c.dtype)
    sync()
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    for layer in range(c.num_layers):
        assert m.append(seqs[0], layer, k, k)
        m.attend(seqs[0], layer, q)
    sync()
    took = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    del m
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    return took


def profile_prefill(spec: str, top: int = 30) -> list[str]:
    """Where the host's time goes in a prompt chunk through the cache (MODEL:CONTEXT:CHUNK:CODEC[+EVICTOR]):
    one chunk to warm up, then one under cProfile; its top functions by own and cumulative time."""
    import cProfile

    model, context, chunk, codec = spec.split(":")
    evictor = None
    if "+" in codec:
        codec, evictor = codec.split("+")
    _chunk_run(model, int(context), int(chunk), codec, evictor)
    prof = cProfile.Profile()
    took = _chunk_run(model, int(context), int(chunk), codec, evictor, prof)
    return _top(prof, f"host profile of a chunk, {spec}: {took * 1e3:.1f} ms under the profiler", top)


def profile_steps(model: str, context: int, codec: str, steps: int, rows: int = 1, top: int = 30) -> list[str]:
    """Where the host's time goes in batch decode steps: cProfile's top functions by own time
    and by cumulative time."""
    import cProfile

    evictor = None
    if codec.endswith("+h2o"):
        codec, evictor = codec[:-4], "h2o"
    m, seqs = make_cache(model, context, codec, evictor, rows)
    decode_steps(m, seqs, 2, batched=True, repeats=1)
    prof = cProfile.Profile()
    prof.enable()
    decode_steps(m, seqs, steps, batched=True, repeats=1)
    prof.disable()
    return _top(prof, f"host profile, {model} {context} {codec} B={rows}, {steps} steps:", top)


def _top(prof, title: str, top: int) -> list[str]:
    """A cProfile.Profile's top functions by own time, then by cumulative time, printed and returned."""
    import io
    import pstats

    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    lines = [title] + buf.getvalue().splitlines()
    print("\n".join(lines), flush=True)
    return lines


def launch_cost(model: str = "smollm2-135m", context: int = 1024, codec: str = "int8", calls: int = 2000,
                rounds: int = 5) -> list[str]:
    """Host time of one layer's paged_decode_sets call as the cache makes it (both pools, one
    row), with kernels/_launch.py's direct launches and with Triton's own launch path, taking
    turns; the fastest round of each. The device is not the limit: its kernels take ~10 us."""
    from kvguard.kernels import _launch
    from kvguard.kernels.paged_decode import paged_decode_sets

    m, seqs = make_cache(model, context, codec)
    c = m.cfg
    q = torch.randn(1, c.num_query_heads, c.head_dim, device=DEV, dtype=c.dtype)
    sets = [(fields, table, torch.tensor(tokens, dtype=torch.int32, device=DEV), max(tokens))
            for fields, table, tokens in m.block_tables.decode_sets([m._seq(seqs[0])], 0)[0]]
    best = {}
    for _ in range(rounds):
        for direct in (True, False):
            _launch._DIRECT = direct
            for _ in range(50):
                paged_decode_sets(q, sets)
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                paged_decode_sets(q, sets)
            best[direct] = min(best.get(direct, float("inf")), (time.perf_counter() - t0) / calls)
            sync()
    _launch._DIRECT = True
    line = (f"host time of a paged_decode_sets call ({model} {context} {codec}, {len(sets)} sets, B = 1): "
            f"{best[True] * 1e6:.1f} us with direct launches, {best[False] * 1e6:.1f} us through Triton's launch")
    print(line, flush=True)
    return [line]


def bench_cache(models, contexts, codecs, batches, steps) -> list[str]:
    lines = [f"{'model':14} {'context':>7} {'B':>2} {'codec':10} | {'rows ms':>8} {'batch ms':>8} "
             f"{'us/layer':>8} {'cpu us':>7} {'kernels':>8} {'host':>5} | {'graph ms':>8} {'us/layer':>8} "
             f"{'host us':>7} | check"]
    print(lines[0], flush=True)
    for model in models:
        for context in contexts:
            for rows in batches:
                for codec in codecs:
                    evictor = None
                    name = codec
                    if codec.endswith("+h2o"):
                        codec, evictor = codec[:-4], "h2o"
                    m, seqs = make_cache(model, context, codec, evictor, rows)
                    err = check(m, seqs)
                    one, _ = decode_steps(m, seqs, steps, batched=False)
                    step, cpu = (decode_steps(m, seqs, steps, batched=True) if hasattr(m, "append_step")
                                 else decode_steps(m, seqs, steps, batched=False))
                    kt = kernel_time(m, seqs)
                    gstep, ghost = graph_steps(m, seqs, steps)
                    layers = m.cfg.num_layers
                    lines.append(f"{model:14} {context:7d} {rows:2d} {name:10} | {one * 1e3:8.2f} {step * 1e3:8.2f} "
                                 f"{step / layers * 1e6:8.1f} {cpu / layers * 1e6:7.1f} {kt / layers * 1e6:8.1f} "
                                 f"{fmt_share(step - kt, step)} | "
                                 f"{gstep * 1e3:8.2f} {gstep / layers * 1e6:8.1f} "
                                 f"{ghost / layers * 1e6:7.1f} | "
                                 f"rel {err:.1e}" + ("" if err < 2e-2 else "  FAILED"))
                    print(lines[-1], flush=True)
                    del m
                    torch.cuda.empty_cache()
    return lines


def static_graph_generate(model, cfg, ids: torch.Tensor, new_tokens: int,
                          clock: StepClock | None = None) -> torch.Tensor:
    """Greedy decoding through transformers' StaticCache + SDPA with each decode step replayed
    from a CUDA graph (one eager warm-up step, then capture): the graphed baseline."""
    import inspect

    from transformers import StaticCache

    from kvguard.hf import cache_kwarg

    b, t = ids.shape
    cache = StaticCache(config=cfg, max_cache_len=t + new_tokens)
    kw = cache_kwarg(model)
    takes_position = "cache_position" in inspect.signature(model.model.forward).parameters

    def forward(x, pos):
        extra = {"cache_position": pos[0]} if takes_position else {}
        return model(input_ids=x, position_ids=pos, use_cache=True, **{kw: cache}, **extra).logits[:, -1]

    with torch.no_grad():
        pos = torch.arange(t, device=DEV).expand(b, t)
        nxt = forward(ids, pos).argmax(-1)
        x = torch.zeros(b, 1, dtype=torch.long, device=DEV)
        p = torch.zeros(b, 1, dtype=torch.long, device=DEV)
        out, graph, static_out = [nxt], None, None
        for i in range(new_tokens - 1):
            if clock is not None:
                clock.tick()
            x.copy_(nxt.view(b, 1))
            p.fill_(t + i)
            if i == 0:  # warm-up, eagerly on a side stream
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    logits = forward(x, p)
                torch.cuda.current_stream().wait_stream(side)
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        static_out = forward(x, p)
                graph.replay()
                logits = static_out
            nxt = logits.argmax(-1)
            out.append(nxt)
        if clock is not None:
            clock.tick()
    return torch.cat([ids, torch.stack(out, 1)], 1)


def _ticking_criteria(clock: StepClock):
    """A transformers stopping criterion that never stops and ticks `clock` once per new token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Tick(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            clock.tick()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Tick()])


# Steps left out of a variant's decode-step times: the first replays of a graph warm up and capture it.
SKIP_STEPS = 3


def bench_generate(new_tokens: int, prompt: int, codecs, batches, rounds: int = 3, graphs: bool = True) -> list[str]:
    """SmolLM2-135M's architecture with random weights (bf16, on the GPU): greedy generation
    through KVGuardCache per codec beside DynamicCache + SDPA, ms per new token of the batch;
    with graphs, also each decode step replayed from a CUDA graph: KVGuardCache through
    kvguard.hf.greedy (DecodeGraph) beside StaticCache + SDPA captured the same way.

    Two figures per variant: the whole call (prompt included) over its new tokens, the fastest of
    `rounds`; and the decode steps timed directly, a CUDA event at each step's boundary
    (transformers' stopping criteria for generate, each DecodeGraph.step or graph replay for the
    graphed variants), the median over every round's steps but the first SKIP_STEPS of each, with
    its notch. Variants take turns: the host's speed drifts over a run."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from kvguard.hf import KVGuardCache, cache_kwarg, greedy
    from kvguard.hf.graph import DecodeGraph

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
    lines = [f"generate: prompt {prompt}, {new_tokens} new tokens, SmolLM2-135M shape, random bf16 weights; "
             f"ms per step (one new token for every row): the whole call over its new tokens "
             f"(fastest of {rounds} rounds), and decode steps timed by CUDA events (median over the rounds' "
             f"steps but the first {SKIP_STEPS} of each, ± its notch)"]
    print(lines[0], flush=True)
    for batch in batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=DEV)
        who = [Subject("bench", f"user-{i}", f"session-{i}") for i in range(batch)]
        variants = {"DynamicCache + sdpa": (lambda: DynamicCache(config=cfg), "sdpa", False)}
        if graphs:
            variants["StaticCache + sdpa, graph"] = (None, "sdpa", True)
        for codec in codecs:
            def make(codec=codec):
                return KVGuardCache(cfg, who, codec=codec, num_pages=batch * ((prompt + new_tokens) // 16 + 8),
                                    fp_sink=4 if codec != "fp16" else 0)
            variants[f"KVGuardCache {codec}"] = (make, "kvguard", False)
            if graphs:
                variants[f"KVGuardCache {codec}, graph"] = (make, "kvguard", True)
        # the prompt's forward pass alone (time to the first token's logits), eager variants
        for name, (make, impl, graph) in variants.items():
            if graph:
                continue
            model.set_attn_implementation(impl)
            times = []
            for _ in range(rounds):
                cache = make()
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                          **{cache_kwarg(model): cache})
                sync()
                times.append(time.perf_counter() - t0)
                if hasattr(cache, "free"):
                    cache.free()
            lines.append(f"  B = {batch:2d} {name:29} prompt's forward pass {min(times) * 1e3:8.2f} ms")
            print(lines[-1], flush=True)
        whole, steps, tokens = {}, {}, {}
        for _ in range(rounds):
            for name, (make, impl, graph) in list(variants.items()):
                model.set_attn_implementation(impl)
                cache = make() if make else None
                clock = StepClock()
                sync()
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        if graph and cache is None:
                            out = static_graph_generate(model, cfg, ids, new_tokens, clock)
                        elif graph:
                            out = _ticking(DecodeGraph, clock, lambda: greedy(model, cache, ids,
                                                                               max_new_tokens=new_tokens))
                        else:
                            out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                 do_sample=False, stopping_criteria=_ticking_criteria(clock),
                                                 **{cache_kwarg(model): cache})
                except Exception as e:  # noqa: BLE001 - a baseline this transformers cannot run is reported
                    what = "not run here" if cache is None else "FAILED"  # the baseline's, or ours
                    lines.append(f"  B = {batch:2d} {name}: {what}: {type(e).__name__}: {str(e)[:300]}")
                    print(lines[-1], flush=True)
                    del variants[name]
                    continue
                sync()
                whole[name] = min(whole.get(name, float("inf")), time.perf_counter() - t0)
                steps.setdefault(name, []).extend(clock.steps_ms(SKIP_STEPS))
                tokens[name] = out[:, prompt:]
                if hasattr(cache, "free"):
                    cache.free()
        ref = "DynamicCache + sdpa"
        for name in variants:
            if name not in whole:
                continue
            agree = (tokens[name] == tokens[ref]).float().mean().item()
            against = "" if name == ref else f", {fmt_ratio(steps[name], steps[ref], 'DynamicCache')}"
            per_token = whole[name] / new_tokens
            lines.append(f"  B = {batch:2d} {name:29} {per_token * 1e3:8.2f} ms/step over the whole "
                         f"call; decode steps {fmt_steps(steps[name])}{against}; greedy tokens equal to "
                         f"DynamicCache's: {agree:.0%}")
            print(lines[-1], flush=True)
    return lines


def _ticking(cls, clock: StepClock, run):
    """run() with clock ticking at the start of every cls.step call (kvguard.hf.DecodeGraph, which
    kvguard.hf.greedy calls once per new token) and once after the last."""
    step = cls.step

    def ticked(self, *args, **kwargs):
        clock.tick()
        return step(self, *args, **kwargs)

    cls.step = ticked
    try:
        out = run()
    finally:
        cls.step = step
    clock.tick()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--codecs", default="fp16,int8,int4,fp8,int8+h2o")
    ap.add_argument("--batches", default="1,8", help="rows decoded together")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per run")
    ap.add_argument("--generate", type=int, default=64,
                    help="new tokens of the generation run (0: skip it); its decode steps are timed by "
                         "a CUDA event at each step's boundary: the median of all but each round's first few")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--profile", default=None, metavar="MODEL:CONTEXT:CODEC[:ROWS][,...]",
                    help="profile the host side of batch decode steps of these caches (cProfile, top functions)")
    ap.add_argument("--launch", action="store_true",
                    help="time the host's side of a decode call with direct launches and with Triton's launch path")
    ap.add_argument("--prefill", default=None, metavar="MODEL:CONTEXT:CHUNK:CODEC[+EVICTOR][,...]",
                    help="time a prompt chunk through the cache's layers after CONTEXT tokens "
                         "(EVICTOR: h2o or snapkv, whose mass the chunk accumulates)")
    ap.add_argument("--profile-prefill", default=None, metavar="MODEL:CONTEXT:CHUNK:CODEC[+EVICTOR][,...]",
                    help="profile the host side of a prompt chunk through the cache (cProfile, top functions)")
    ap.add_argument("--out", default=None, help="folder for cache_results.json")
    ap.add_argument("--smoke", action="store_true",
                    help="without a GPU: the reference path, tiny shapes, to check that the script runs")
    a = ap.parse_args()
    if a.smoke:
        a.models, a.contexts, a.batches, a.codecs = "smollm2-135m", "40", "1,2", "int8,int8+h2o"
        a.steps, a.generate, a.prompt = 1, 2, 8
    elif DEV.type != "cuda":
        sys.exit("needs a CUDA GPU (or --smoke)")
    print(f"{torch.cuda.get_device_name() if DEV.type == 'cuda' else 'CPU'}, torch {torch.__version__}", flush=True)
    lines = []
    for spec in a.profile.split(",") if a.profile else []:
        model, context, codec, *rows = spec.split(":")
        lines += profile_steps(model, int(context), codec, a.steps, int(rows[0]) if rows else 1)
    if a.launch and DEV.type == "cuda":
        lines += launch_cost()
    if a.prefill:
        lines += bench_prefill(a.prefill)
    for spec in a.profile_prefill.split(",") if a.profile_prefill else []:
        lines += profile_prefill(spec)
    batches = [int(x) for x in a.batches.split(",")]
    if a.models:
        lines += bench_cache(a.models.split(","), [int(x) for x in a.contexts.split(",")], a.codecs.split(","),
                             batches, a.steps)
    if a.generate:
        lines += bench_generate(a.generate, a.prompt, [c for c in a.codecs.split(",") if "+" not in c], batches,
                                rounds=1 if a.smoke else 3, graphs=DEV.type == "cuda")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        write_json(a.out, "cache_results.json", {"lines": lines})
    if any("FAILED" in x for x in lines):
        sys.exit(1)


if __name__ == "__main__":
    main()
