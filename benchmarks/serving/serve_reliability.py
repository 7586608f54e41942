"""`kvguard serve-llm` as hostile clients would treat it: one table of figures.

    .venv/bin/python benchmarks/serving/serve_reliability.py [--small]

A real `kvguard serve-llm --model smollm2` process (CPU) on loopback beside a production-mode
sidecar (`kvguard serve`, SQLite), every exchange bounded in count and time:

* the route x credential matrix: every route with no token, a forged one, each sidecar scope's
  token and two tenants' infer keys; right = 401 without a valid token, 403 with one of another
  scope, 200 with the route's (infer for the API, audit:read or admin for /metrics, none for
  the probes);
* a bad-input corpus on both completion routes, each body with a Content-Length and chunked
  (malformed, deeply nested, NUL, invalid UTF-8, huge numbers, each field of the wrong type, NaN,
  infinite, negative and tiny temperatures, a 1 MB prompt), then oversized, unauthenticated,
  huge-header, non-ASCII and trailing-slash requests: no 5xx, no traceback in the server's log;
* idle and slow connections (nothing sent, half the headers, less body than the
  Content-Length): all cut by the read deadline while /healthz and a request are served;
* bursts of valid requests at once (64 and 100 of 8 tokens against --max-seqs 64; `--small`: 4 and 6
  of 2 tokens against 4):
  each answered 200 or 429 with Retry-After, none 5xx;
* the server's peak RSS through it all, under a stated cap.

Exits 1 when a figure is off what it must be (the CI test runs `--small`).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks._lib.reliability import Report, rss_mb, send_raw  # noqa: E402
from tests.serve.conftest import make_tokens  # noqa: E402
from tests.sidecar.conftest import ROOT, free_port, start_server  # noqa: E402

READ_TIMEOUT_S = 2
RSS_CAP_MB = 2500  # serve-llm's peak RSS (SmolLM2-135M in float32 on the CPU, its pages, torch) stays under
SCOPES = ("admin", "ingest", "erasure:write", "erasure:read", "audit:read")


class Llm:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log
        self.where = ("127.0.0.1", int(url.rsplit(":", 1)[1]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_llm(sidecar, tmp: Path, max_seqs: int) -> Llm:
    port = free_port()
    log = tmp / "serve-llm.log"
    env = {**sidecar.env, "KVGUARD_INGEST_TOKEN": sidecar.tokens["ingest"], "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-m", "kvguard", "serve-llm", "--model", "smollm2", "--socket",
                             str(sidecar.socket), "--port", str(port), "--max-seqs", str(max_seqs), "--num-pages",
                             str(max_seqs * 8), "--read-timeout", str(READ_TIMEOUT_S), "--device", "cpu"],
                            env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    llm = Llm(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvguard serve-llm exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(llm.url + "/readyz", timeout=2).status_code == 200:
                return llm
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    llm.stop()
    raise AssertionError("kvguard serve-llm did not become ready")


def completion(i: int = 0, **extra) -> dict:
    return {"model": "smollm2", "prompt": f"Item {i}: the quick brown fox", "user": f"u{i % 5}", "max_tokens": 1,
            "temperature": 0} | extra


def chat(**extra) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "user": "u1", "max_tokens": 1,
            "temperature": 0} | extra


def matrix(llm: Llm, tokens: dict, report: Report) -> None:
    routes = [("POST", "/v1/chat/completions", chat()), ("POST", "/v1/completions", completion()),
              ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/healthz", None),
              ("GET", "/readyz", None)]
    right = wrong = 0
    bad = []
    with httpx.Client(base_url=llm.url, timeout=60) as c:
        for method, path, body in routes:
            for cred in ("none", "forged", *SCOPES, "acme", "globex"):
                headers = {} if cred == "none" else {
                    "Authorization": "Bearer " + ("kvg_" + "x" * 43 if cred == "forged" else tokens[cred])}
                r = c.request(method, path, json=body, headers=headers)
                if path in ("/healthz", "/readyz"):
                    expect = 200
                elif cred in ("none", "forged"):
                    expect = 401
                elif path == "/metrics":
                    expect = 200 if cred in ("audit:read", "admin") else 403
                else:
                    expect = 200 if cred in ("acme", "globex") else 403
                good = r.status_code == expect
                right, wrong = right + good, wrong + (not good)
                if not good:
                    bad.append(f"{method} {path} {cred}: {r.status_code}")
    report.add("route x credential", f"{right} right, {wrong} wrong" + (f" ({'; '.join(bad[:5])})" if bad else ""),
               wrong == 0 and right > 0)


def corpus(llm: Llm, tokens: dict, report: Report, small: bool) -> None:
    auth = f"Authorization: Bearer {tokens['acme']}\r\n".encode()
    base = completion()
    bodies = {
        "malformed": b'{"model": ',
        "deeply nested": b"[" * 200_000 + b"]" * 200_000,
        "nested in a field": json.dumps({**base, "stop": json.loads("[" * 500 + "]" * 500)}).encode(),
        "NUL escaped": json.dumps({**base, "user": "a\u0000b"}).encode(),
        "NUL raw": b'{"model": "smollm2", "prompt": "a\x00b", "user": "u", "max_tokens": 1}',
        "invalid UTF-8": b'{"model": "smollm2", "prompt": "\xff\xfe\xc3", "user": "u", "max_tokens": 1}',
        "huge float": json.dumps(base)[:-1].encode() + b', "top_p": 1e999999}',
        "huge integer": json.dumps({**base, "max_tokens": 0})[:-1].encode().replace(b'"max_tokens": 0', b'"max_tokens": '
                                                                                   + b"9" * 4000) + b"}",
        "NaN temperature": json.dumps(base)[:-1].encode().replace(b'"temperature": 0', b'"temperature": NaN') + b"}",
        "infinite temperature": json.dumps(base).encode().replace(b'"temperature": 0', b'"temperature": Infinity'),
        "negative temperature": json.dumps({**base, "temperature": -1}).encode(),
        "tiny temperature": json.dumps({**base, "temperature": 1e-300}).encode(),
        "1 MB prompt": json.dumps({**base, "prompt": "word " * 200_000}).encode(),
        "prompt of token ids": json.dumps({**base, "prompt": [1, 2, 3]}).encode(),
        "unknown field": json.dumps({**base, "logit_bias": {"1": 100}}).encode(),
        **{f"{field} as {value!r}": json.dumps({**base, field: value}).encode()
           for field, value in (("max_tokens", "16"), ("temperature", True), ("stream", "yes"), ("seed", "123"),
                                ("top_p", "1"), ("n", True), ("user", 5))},
    }
    statuses: dict[int, int] = {}
    sent = 0
    for _ in range(1 if small else 3):
        for path in (b"/v1/completions", b"/v1/chat/completions"):
            for body in bodies.values():
                for chunked in (False, True):
                    head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                    if chunked:
                        data = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                    else:
                        data = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
                    code = send_raw(("tcp", llm.where), data, wait_s=30)
                    statuses[code] = statuses.get(code, 0) + 1
                    sent += 1
            line = b"POST " + path
            for data in (line + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 104857600\r\n\r\n",
                         line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n" + b"a" * 60000,
                         line + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n"
                         + b"200000\r\n" + b"a" * 0x200000 + b"\r\n0\r\n\r\n",
                         line + b" HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
                         line + b"/ HTTP/1.1\r\nHost: evil.example\r\n" + auth + b"Content-Length: 2\r\n\r\n{}",
                         b"GET /v1/mo\xffdels HTTP/1.1\r\nHost: x\r\n\r\n",
                         line + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: text/plain\r\n"
                         b"Content-Length: 2\r\n\r\n{}"):
                code = send_raw(("tcp", llm.where), data, wait_s=30)
                statuses[code] = statuses.get(code, 0) + 1
                sent += 1
    five = sum(n for code, n in statuses.items() if code >= 500)
    shown = ", ".join(f"{code or 'closed'}: {n}" for code, n in sorted(statuses.items()))
    report.add("bad-input corpus, both routes", f"{sent} requests, {five} × 5xx ({shown})", five == 0)


def slow_clients(llm: Llm, tokens: dict, report: Report, small: bool) -> None:
    n = 30 if small else 300
    key = tokens["acme"].encode()
    conns, t0 = [], time.monotonic()
    for i in range(n):
        s = socket.create_connection(llm.where)
        if i % 3 == 1:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        elif i % 3 == 2:  # less body than the Content-Length
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"" % key)
        conns.append(s)
    health = httpx.get(llm.url + "/healthz", timeout=5).status_code
    served = httpx.post(llm.url + "/v1/completions", json=completion(), timeout=60,
                        headers={"Authorization": f"Bearer {tokens['acme']}"}).status_code
    meanwhile = time.monotonic() - t0
    held, codes = [], {}
    for s in conns:
        s.settimeout(READ_TIMEOUT_S + 10)
        out = b""
        try:
            while chunk := s.recv(4096):
                out += chunk
        except OSError:
            pass
        held.append(time.monotonic() - t0)
        code = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/") else 0
        codes[code] = codes.get(code, 0) + 1
        s.close()
    cut = sum(h < READ_TIMEOUT_S + 3 for h in held)
    report.add("idle and slow connections",
               f"{cut}/{n} cut (answers {dict(sorted(codes.items()))}), longest held {max(held):.1f} s (deadline "
               f"{READ_TIMEOUT_S} s); meanwhile /healthz {health}, a request {served}, in {meanwhile:.2f} s",
               cut == n and health == 200 and served == 200)


def burst(llm: Llm, tokens: dict, report: Report, n: int, max_tokens: int) -> None:
    why: dict[str, int] = {}

    def one(i: int) -> tuple[int, float, bool]:
        t = time.perf_counter()
        r = httpx.post(llm.url + "/v1/completions", json=completion(i, max_tokens=max_tokens), timeout=300,
                       headers={"Authorization": f"Bearer {tokens['acme' if i % 2 else 'globex']}"})
        well = (r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")) or (
            r.status_code == 429 and r.headers.get("retry-after") == "1"
            and r.headers["content-type"].startswith("application/problem+json"))
        if not well:
            detail = f"{r.status_code} {r.json().get('detail', '')[:60]}" if r.headers.get(
                "content-type", "").endswith("json") else str(r.status_code)
            why[detail] = why.get(detail, 0) + 1
        return r.status_code, time.perf_counter() - t, well

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    codes: dict[int, int] = {}
    for code, _, _ in results:
        codes[code] = codes.get(code, 0) + 1
    lat = sorted(t for code, t, _ in results if code == 200)
    p50 = lat[len(lat) // 2] if lat else float("nan")
    worst = lat[-1] if lat else float("nan")
    report.add(f"burst of {n} valid requests", f"{dict(sorted(codes.items()))} in {wall:.1f} s; 200s p50 {p50:.1f} s, "
                                               f"slowest {worst:.1f} s" + (f"; {why}" if why else ""),
               all(w for _, _, w in results) and 200 in codes)


def run(report: Report, small: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="kvguard-serve-reliability-") as tmp:
        tmp = Path(tmp)
        db_url = f"sqlite:///{tmp / 'audit.db'}"
        tokens = make_tokens(tmp / "data", db_url, extra_scopes=("erasure:write", "erasure:read"))
        sidecar = start_server(tmp, db_url, tokens=tokens)
        llm = None
        try:
            llm = start_llm(sidecar, tmp, 4 if small else 64)
            _, peak0 = rss_mb(llm.proc.pid)
            matrix(llm, tokens, report)
            corpus(llm, tokens, report, small)
            slow_clients(llm, tokens, report, small)
            for n in ((4, 6) if small else (64, 100)):
                burst(llm, tokens, report, n, 2 if small else 8)
            now, peak = rss_mb(llm.proc.pid)
            report.add("serve-llm memory", f"peak RSS {peak:.0f} MB (ready {peak0:.0f} MB, now {now:.0f} MB; "
                                           f"cap {RSS_CAP_MB} MB)", peak < RSS_CAP_MB)
            alive = httpx.get(llm.url + "/readyz", timeout=10).status_code == 200
            llm.stop()
            log = llm.log.read_text(errors="replace")
            tracebacks = log.count("Traceback")
            report.add("serve-llm's log", f"{tracebacks} tracebacks, {log.count('Exception in ASGI')} ASGI "
                                          f"exceptions; ready to the end: {alive}", tracebacks == 0 and alive)
        finally:
            if llm is not None:
                llm.stop()
            sidecar.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="fewer rounds, clients and requests (the CI test)")
    args = p.parse_args(argv)
    report = Report()
    t0 = time.monotonic()
    run(report, args.small)
    print(report.table())
    print(f"\n{time.strftime('%Y-%m-%d')}, {'small' if args.small else 'full'} run, {time.monotonic() - t0:.0f} s, "
          f"{os.cpu_count()} CPUs")
    return 0 if all(r.ok for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
