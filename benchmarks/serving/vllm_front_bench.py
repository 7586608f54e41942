"""What kvguard costs a vLLM deployment: the same load sent to a plain vLLM, to a vLLM with
kvguard's connector directly, and through kvguard's front to that vLLM, alternating rounds in
one run.

N streaming clients send M chat requests each (a ~250-token system prompt shared by all, a
short question, --output tokens, greedy) to each URL. Printed: output tokens/s and TTFT
p50/p99 per target, every round, and the ratios of the medians: front ÷ plain vLLM (all that
kvguard costs) and front ÷ direct (the front's own cost). With --start MODEL_DIR the script
starts it all itself (a sidecar on SQLite in a scratch folder, vLLM from .venv-vllm with
kvguard's connector, the front in a process of its own, a plain vLLM beside them, idle but in its
own rounds):

    python benchmarks/serving/vllm_front_bench.py --start ~/.cache/kvguard/smollm2-hf-0.1.2 --rounds 3

or measures a running one (docs/vllm.md; --plain URL adds a plain vLLM of the same model):

    python benchmarks/serving/vllm_front_bench.py --direct http://127.0.0.1:8001 \\
        --front http://127.0.0.1:8000 --key "$INFER_KEY" --model smollm2 --rounds 3

Direct requests carry no subject: the connector records their blocks under "vllm-direct".
`--small` runs one short round (what the test of this script runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]

SYSTEM = ("You are the assistant of a public library. You answer questions about opening hours, loans, "
          "renewals, fines, rooms, events, the catalogue and accessibility. Answer briefly, in plain words, "
          "and say when a question needs a librarian. ") * 4
QUESTIONS = ["Tell me a short story about a lost library book.", "Write a poem about reading at night.",
             "Describe the reading room on a rainy day.", "Invent a tale about a librarian and a cat."]


async def one(http: httpx.AsyncClient, url: str, key: str | None, model: str, i: int, output: int):
    body = {"model": model, "stream": True, "max_tokens": output, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if key:  # kvguard's front: who the end user is
        body["user"] = f"user-{i % 8}"
    t0, first, chunks = time.perf_counter(), None, 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])
                if c.get("choices") and c["choices"][0].get("delta", {}).get("content"):
                    first = first or time.perf_counter()
                    chunks += 1
    return (first or time.perf_counter()) - t0, chunks


async def load(url: str, key: str | None, model: str, clients: int, requests: int, output: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as http:
        queue = list(range(clients * requests))
        ttfts, tokens = [], 0

        async def worker():
            nonlocal tokens
            while queue:
                ttft, n = await one(http, url, key, model, queue.pop(), output)
                ttfts.append(ttft)
                tokens += n

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    ttfts.sort()
    return {"tok_s": tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "tokens": tokens}


@contextlib.contextmanager
def stack(model_dir: Path, vllm_python: Path, model: str, with_plain: bool = True):
    """A sidecar, vLLM with kvguard's connector, the front, and a plain vLLM: yields (the plain
    vLLM's URL or None, the connector's vLLM's, the front's, an infer key)."""
    from kvguard.audit.store import make_engine
    from sqlalchemy.orm import Session

    from kvguard.sidecar.auth import create_token
    from kvguard.sidecar.service import load_or_create_secret

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_bench import free_port, start_sidecar

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sidecar, sock, ingest = start_sidecar(tmp)
        engine = make_engine(f"sqlite:///{tmp / 'data' / 'audit.db'}")
        with Session(engine) as db:
            key = create_token(db, "bench-key", ["infer"], tenants=["bench"],
                               index_key=load_or_create_secret(tmp / "data" / "index.key"))
        engine.dispose()
        port = free_port()
        vllm_url = f"http://127.0.0.1:{port}"
        cfg = {"kv_connector": "KVGuardConnector", "kv_connector_module_path": "kvguard.vllm.connector",
               "kv_role": "kv_both", "kv_connector_extra_config": {"socket": str(sock), "api_url": vllm_url}}
        env = {**os.environ, "KVGUARD_INGEST_TOKEN": ingest, "VLLM_CPU_KVCACHE_SPACE": "2"}

        def start(port: int, name: str, extra: list[str]) -> subprocess.Popen:
            return subprocess.Popen([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     str(model_dir), "--served-model-name", model, "--host", "127.0.0.1", "--port",
                                     str(port), "--enforce-eager", "--max-model-len", "2048", "--block-size", "32",
                                     *extra], env=env, cwd=tmp, stdout=open(tmp / f"{name}.log", "wb"),
                                    stderr=subprocess.STDOUT)

        def wait(proc: subprocess.Popen, url: str, name: str, path: str = "/health") -> None:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not start: {(tmp / f'{name}.log').read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + path, timeout=1).status_code == 200:
                        return
                time.sleep(0.5)

        vllm = start(port, "vllm", ["--kv-transfer-config", json.dumps(cfg)])
        server = plain = None
        try:
            wait(vllm, vllm_url, "vllm")
            plain_url = None
            if with_plain:  # started after the other: two engines starting at once share the CPUs badly
                plain_port = free_port()
                plain_url = f"http://127.0.0.1:{plain_port}"
                plain = start(plain_port, "plain", [])
                wait(plain, plain_url, "plain")
            # the front in a process of its own, as deployed: not sharing this one's interpreter
            # with the clients that measure it
            front_port = free_port()
            front_url = f"http://127.0.0.1:{front_port}"
            server = subprocess.Popen([sys.executable, "-m", "kvguard", "serve-llm", "--upstream", vllm_url,
                                       "--served-model-name", model, "--socket", str(sock), "--host", "127.0.0.1",
                                       "--port", str(front_port)], env={**os.environ, "KVGUARD_INGEST_TOKEN": ingest},
                                      cwd=tmp, stdout=open(tmp / "front.log", "wb"), stderr=subprocess.STDOUT)
            wait(server, front_url, "front", "/readyz")
            yield plain_url, vllm_url, front_url, key
        finally:
            if server is not None:
                server.terminate()
                server.wait(30)
            for proc in (plain, vllm):
                if proc is not None:
                    proc.terminate()
                    proc.wait(60)
            sidecar.terminate()
            sidecar.wait(30)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", type=Path, metavar="MODEL_DIR", help="start the stack with this model folder")
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                   help="vLLM's interpreter, with --start (default .venv-vllm)")
    p.add_argument("--plain", help="a vLLM without kvguard, serving the same model")
    p.add_argument("--no-plain", action="store_true", help="with --start: no plain vLLM")
    p.add_argument("--direct", help="vLLM's own OpenAI server")
    p.add_argument("--front", help="kvguard serve-llm --upstream before that vLLM")
    p.add_argument("--key", help="an infer key of the front")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per client")
    p.add_argument("--output", type=int, default=64, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (direct, front), alternating")
    p.add_argument("--small", action="store_true", help="one round of 2 clients x 2 requests x 8 tokens")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.small:
        a.clients, a.requests, a.output, a.rounds = 2, 2, 8, 1
    if a.start is not None:
        with stack(a.start, a.vllm_python, a.model, not a.no_plain) as (a.plain, a.direct, a.front, a.key):
            return measure(a)
    if not (a.direct and a.front and a.key):
        p.error("give --start MODEL_DIR, or --direct, --front and --key of a running stack")
    return measure(a)


def measure(a) -> dict:
    targets = ([("vllm", a.plain, None)] if a.plain else []) + [("direct", a.direct, None), ("front", a.front, a.key)]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in targets}
    for url in filter(None, (a.plain, a.direct)):  # warm: the shared system prompt's blocks exist
        asyncio.run(load(url, None, a.model, 2, 1, 4))
    for r in range(a.rounds):
        for name, url, key in targets:
            res = asyncio.run(load(url, key, a.model, a.clients, a.requests, a.output))
            rows[name].append(res)
            print(f"round {r + 1} {name:6s} {res['tok_s']:8.1f} tok/s  TTFT p50 {res['ttft_p50']:.3f} s  "
                  f"p99 {res['ttft_p99']:.3f} s  ({res['tokens']} tokens)", flush=True)
    med = {n: {k: statistics.median(x[k] for x in v) for k in ("tok_s", "ttft_p50", "ttft_p99")}
           for n, v in rows.items()}
    ratio = {"tok_s": med["front"]["tok_s"] / med["direct"]["tok_s"],
             "ttft_p50": med["front"]["ttft_p50"] / med["direct"]["ttft_p50"]}
    print("\n| target | output tok/s | TTFT p50 (s) | TTFT p99 (s) |\n|---|---|---|---|")
    for n in rows:
        print(f"| {n} | {med[n]['tok_s']:.1f} | {med[n]['ttft_p50']:.3f} | {med[n]['ttft_p99']:.3f} |")
    print(f"\nfront / direct: {ratio['tok_s']:.3f}x the tokens/s, {ratio['ttft_p50']:.3f}x the TTFT p50 "
          f"(medians of {a.rounds} rounds)")
    if "vllm" in med:
        ratio["vs_vllm"] = {"tok_s": med["front"]["tok_s"] / med["vllm"]["tok_s"],
                            "ttft_p50": med["front"]["ttft_p50"] / med["vllm"]["ttft_p50"]}
        print(f"front / plain vLLM: {ratio['vs_vllm']['tok_s']:.3f}x the tokens/s, "
              f"{ratio['vs_vllm']['ttft_p50']:.3f}x the TTFT p50")
    out = {"rounds": rows, "median": med, "ratio": ratio,
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k != "key"}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
