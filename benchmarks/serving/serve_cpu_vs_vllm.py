"""`kvguard serve-llm --model smollm2` against a plain vLLM on the CPU: the same chat load, the same
model, alternating rounds in one run.

A sidecar (SQLite, a scratch folder), kvguard's server (its own engine, 16-bit pages) and vLLM
from .venv-vllm (`--enforce-eager --block-size 32`, VLLM_CPU_KVCACHE_SPACE=2, no connector) run
side by side; N streaming clients send M chat requests each (benchmarks/serving/vllm_front_bench.py's
load: a ~250-token system prompt shared by all, a short question, --output tokens, greedy):

    python benchmarks/serving/serve_cpu_vs_vllm.py --model-dir ~/.cache/kvguard/smollm2-hf-0.1.2 --rounds 1

The model folder is kvguard.hf.export.export_folder's (SmolLM2's GGUF as a transformers folder).
Printed: output tokens/s and TTFT p50/p99 per server and round, and kvguard ÷ vLLM of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def wait_for(url: str, proc: subprocess.Popen, log: Path, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start: {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.5)


def main(argv=None) -> dict:
    from kvguard.audit.store import make_engine
    from serve_bench import free_port, start_sidecar
    from sqlalchemy.orm import Session
    from vllm_front_bench import load

    from kvguard.sidecar.auth import create_token
    from kvguard.sidecar.service import load_or_create_secret

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="SmolLM2 as a transformers folder (for vLLM)")
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per client")
    p.add_argument("--output", type=int, default=64, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-seqs", type=int, default=16, help="both servers' most sequences at once")
    p.add_argument("--kvguard-args", default="", help="more serve-llm arguments (space-separated)")
    p.add_argument("--vllm", metavar="URL", help="a vLLM already serving the model as 'smollm2' (not started)")
    p.add_argument("--small", action="store_true", help="one round of 2 clients x 2 requests x 8 tokens (the test's)")
    a = p.parse_args(argv)
    if a.small:
        a.rounds, a.clients, a.requests, a.output, a.max_seqs = 1, 2, 2, 8, 4
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sidecar, sock, ingest = start_sidecar(tmp)
        procs.append(sidecar)
        db = make_engine(f"sqlite:///{tmp / 'data' / 'audit.db'}")
        with Session(db) as s:
            key = create_token(s, "bench-key", ["infer"], tenants=["bench"],
                               index_key=load_or_create_secret(tmp / "data" / "index.key"))
        db.dispose()
        try:
            vport, kport = free_port(), free_port()
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}
            vlog = tmp / "vllm.log"
            procs.append(None if a.vllm else subprocess.Popen(
                [str(a.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(a.model_dir),
                 "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(vport), "--enforce-eager",
                 "--max-model-len", "2048", "--block-size", "32", "--max-num-seqs", str(a.max_seqs)],
                env=env, cwd=tmp, stdout=open(vlog, "wb"), stderr=subprocess.STDOUT))
            klog = tmp / "serve-llm.log"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvguard", "serve-llm", "--model", "smollm2", "--device", "cpu", "--socket",
                 str(sock), "--port", str(kport), "--max-seqs", str(a.max_seqs), *a.kvguard_args.split()],
                env={**os.environ, "KVGUARD_INGEST_TOKEN": ingest}, cwd=tmp, stdout=open(klog, "wb"),
                stderr=subprocess.STDOUT))
            targets = {"vllm": (a.vllm or f"http://127.0.0.1:{vport}", None), "kvguard": (f"http://127.0.0.1:{kport}", key)}
            if not a.vllm:
                wait_for(targets["vllm"][0] + "/health", procs[1], vlog, "vLLM")
            wait_for(targets["kvguard"][0] + "/readyz", procs[2], klog, "kvguard serve-llm")
            for url, k in targets.values():  # warm: the shared system prompt is cached in both
                asyncio.run(load(url, k, "smollm2", 2, 1, 4))
            rows: dict[str, list[dict]] = {n: [] for n in targets}
            for r in range(a.rounds):
                for name, (url, k) in targets.items():
                    res = asyncio.run(load(url, k, "smollm2", a.clients, a.requests, a.output))
                    rows[name].append(res)
                    print(f"round {r + 1} {name:8s} {res['tok_s']:8.1f} tok/s  TTFT p50 {res['ttft_p50']:.3f} s  "
                          f"p99 {res['ttft_p99']:.3f} s  ({res['tokens']} tokens)", flush=True)
        finally:
            for proc in reversed([x for x in procs if x is not None]):
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
    med = {n: {k: statistics.median(x[k] for x in v) for k in ("tok_s", "ttft_p50", "ttft_p99")}
           for n, v in rows.items()}
    print("\n| server | output tok/s | TTFT p50 (s) | TTFT p99 (s) |\n|---|---|---|---|")
    for n, m in med.items():
        print(f"| {n} | {m['tok_s']:.1f} | {m['ttft_p50']:.3f} | {m['ttft_p99']:.3f} |")
    print(f"\nkvguard / vLLM: {med['kvguard']['tok_s'] / med['vllm']['tok_s']:.3f}x the output tokens/s "
          f"(medians of {a.rounds} rounds)")
    return med


if __name__ == "__main__":
    main()
