"""What kvguard costs a vLLM deployment: the same load sent to vLLM directly and through
kvguard's front (with kvguard's connector inside that vLLM), alternating rounds in one run.

N streaming clients send M chat requests each (a ~250-token system prompt shared by all, a
short question, --output tokens, greedy) to each URL. Printed: output tokens/s and TTFT
p50/p99 per target, every round, and the ratio front ÷ direct of the medians. Start the
stack first (docs/vllm.md: `kvguard serve`, vLLM with the connector, `kvguard serve-llm
--upstream`), then:

    python benchmarks/vllm_front_bench.py --direct http://127.0.0.1:8001 \\
        --front http://127.0.0.1:8000 --key "$INFER_KEY" --model smollm2 --rounds 3

Direct requests carry no subject: the connector records their blocks under "vllm-direct",
so both targets pay the connector; the front's own cost (auth, salt, relay) is the ratio.
`--small` runs one short round (what the test of this script runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--direct", required=True, help="vLLM's own OpenAI server")
    p.add_argument("--front", required=True, help="kvguard serve-llm --upstream before that vLLM")
    p.add_argument("--key", required=True, help="an infer key of the front")
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
    rows: dict[str, list[dict]] = {"direct": [], "front": []}
    asyncio.run(load(a.direct, None, a.model, 2, 1, 4))  # warm: the shared system prompt's blocks exist
    for r in range(a.rounds):
        for name, url, key in (("direct", a.direct, None), ("front", a.front, a.key)):
            res = asyncio.run(load(url, key, a.model, a.clients, a.requests, a.output))
            rows[name].append(res)
            print(f"round {r + 1} {name:6s} {res['tok_s']:8.1f} tok/s  TTFT p50 {res['ttft_p50']:.3f} s  "
                  f"p99 {res['ttft_p99']:.3f} s  ({res['tokens']} tokens)", flush=True)
    med = {n: {k: statistics.median(x[k] for x in v) for k in ("tok_s", "ttft_p50", "ttft_p99")}
           for n, v in rows.items()}
    ratio = {"tok_s": med["front"]["tok_s"] / med["direct"]["tok_s"],
             "ttft_p50": med["front"]["ttft_p50"] / med["direct"]["ttft_p50"]}
    print("\n| target | output tok/s | TTFT p50 (s) | TTFT p99 (s) |\n|---|---|---|---|")
    for n in ("direct", "front"):
        print(f"| {n} | {med[n]['tok_s']:.1f} | {med[n]['ttft_p50']:.3f} | {med[n]['ttft_p99']:.3f} |")
    print(f"\nfront / direct: {ratio['tok_s']:.3f}x the tokens/s, {ratio['ttft_p50']:.3f}x the TTFT p50 "
          f"(medians of {a.rounds} rounds)")
    out = {"rounds": rows, "median": med, "ratio": ratio, "args": vars(a)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
