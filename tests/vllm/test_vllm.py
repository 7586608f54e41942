"""Real vLLM behind kvguard's front, with kvguard's connector inside it (fixtures: conftest.py).

The stock openai client through the front: chat, streams, completions, and prefix-cache
isolation by the salt the front sets (never the client). Erasure of a user mid-stream
through the sidecar's admin API: her stream ends with the erasure's error, her blocks leave
vLLM's prefix cache and are overwritten in the worker's KV tensors (read back there; the
acknowledgement waits for it), the receipt with vLLM's counts verifies offline, another
user's greedy output is unchanged. Blocks vLLM evicts come back from kvguard's host tier on
a later hit of the same tenant's prompt, audited, and an erasure empties the tier of them
too. The run's log: every block stored and freed a signed
record under pseudonyms, no raw id or prompt text anywhere, the bundle verifies. Failures:
the sidecar unreachable (503), vLLM killed (502, not ready). The last test kills vLLM."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import signal
import socket
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from kvguard.audit.cli import main as audit_main
from kvguard.audit.keys import PublicKey, SigningKey
from kvguard.audit.receipt import verify_fleet_receipt

from tests.sidecar.conftest import ROOT
from tests.sidecar.test_erasure_e2e import database_dump
from tests.vllm.conftest import BLOCK, BLOCKS, MODEL, stop_vllm

pytestmark = pytest.mark.xdist_group("vllm")  # one worker starts vLLM once per store, not every worker
SYSTEM = ("You are a careful assistant for a library. " * 12).strip()  # ~100 tokens: several full blocks


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(c: openai.OpenAI, user: str, text: str, system: str = SYSTEM, **kw):
    return c.chat.completions.create(model=MODEL, user=user, max_tokens=8, temperature=0,
                                     messages=[{"role": "system", "content": system},
                                               {"role": "user", "content": text}], **kw)


def test_chat_stream_and_completions_through_the_front(stack):
    c = client(stack.front, stack.key("acme"))
    r = ask(c, "alice", "Name a colour.")
    assert r.model == MODEL and r.choices[0].message.content and r.usage.completion_tokens > 0
    parts = list(ask(c, "alice", "Name a fruit.", stream=True, stream_options={"include_usage": True}))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text and parts[-1].usage.completion_tokens > 0
    assert all(p.model == MODEL for p in parts)
    t = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                             user="alice")
    assert t.choices[0].text
    # the same greedy request sent to vLLM directly gives the same text: the front changes no output
    direct = openai.OpenAI(base_url=stack.vllm + "/v1", api_key="x", max_retries=0)
    d = direct.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert d.choices[0].text == t.choices[0].text


def test_prefix_cache_is_shared_within_a_tenant_and_never_across(stack):
    acme, globex = client(stack.front, stack.key("acme")), client(stack.front, stack.key("globex"))
    system = "Isolation. " + SYSTEM  # blocks no earlier test computed
    first = ask(acme, "bob", "Say hello.", system)
    again = ask(acme, "carol", "Say hello again.", system)  # same tenant, same system prompt
    other = ask(globex, "dave", "Say hello.", system)  # the same prompt in another tenant
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 96
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # sent to vLLM directly (no salt), the same prompts share blocks with each other, not with kvguard's
    direct = openai.OpenAI(base_url=stack.vllm + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    d1 = direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    d2 = direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert d1.usage.prompt_tokens_details.cached_tokens == 0
    assert d2.usage.prompt_tokens_details.cached_tokens >= 96


def test_a_client_cannot_set_the_salt_or_transfer_params(stack):
    c = client(stack.front, stack.key("acme"))
    for extra in ({"cache_salt": "guess"}, {"kv_transfer_params": {"kvguard": {"tenant": "globex"}}}):
        with pytest.raises(openai.UnprocessableEntityError):
            ask(c, "alice", "Hi.", extra_body=extra)


SECRET = "Alice's account number is 4417 1234 5678 9113 and her diagnosis is confidential. " * 3


def erase(stack, tenant: str, user: str) -> dict:
    with stack.sidecar.client("admin") as admin:
        r = admin.post("/v1/erasure-requests", json={"tenant": tenant, "user": user, "legal_basis": "gdpr-art17"},
                       headers={"Idempotency-Key": uuid.uuid4().hex})
        assert r.status_code == 202, r.text
        rid, deadline = r.json()["id"], time.monotonic() + 90
        while (done := admin.get(f"/v1/erasure-requests/{rid}").json())["state"] != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.2)
    return done


def test_erasure_mid_stream_ends_the_stream_and_overwrites_the_blocks(stack):
    acme = client(stack.front, stack.key("acme"))
    system = "Private. " + SECRET
    bob_before = ask(acme, "bob", "Count to five.").choices[0].message.content
    streaming = []
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Write a very long story about numbers."}]
    r = httpx.post(stack.vllm + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
    full = r.json()["count"] // BLOCK  # her prompt's full blocks: vLLM's prefix cache keeps them
    assert full >= 3, r.text

    def alice() -> str:
        with pytest.raises(openai.APIError) as err:
            for ch in acme.chat.completions.create(
                    model=MODEL, user="alice", max_tokens=1500, temperature=0, stream=True, messages=messages):
                streaming.append(ch)
        return str(err.value)

    with cf.ThreadPoolExecutor(1) as pool:
        a = pool.submit(alice)
        deadline = time.monotonic() + 60
        while len(streaming) < 3:
            assert time.monotonic() < deadline and not a.done(), "alice's stream did not start"
            time.sleep(0.02)
        done = erase(stack, "acme", "alice")
        message = a.result(60)
    assert "erasure" in message and "alice" not in message

    processes = done["result"]["processes"]
    front = next(v for k, v in processes.items() if k.startswith("front/"))
    vllm = next(v for k, v in processes.items() if k.startswith("vllm-dp0/"))
    assert front["sequences"] == 1  # her stream, ended by the front; vLLM aborted it when the front closed it
    # her blocks, overwritten in every worker and read back as zeros: at least her prompt's full
    # ones, which left the prefix cache first (her last, partial block and those of the tokens
    # streamed so far are gone already when vLLM aborted her request before the erasure reached it)
    assert full <= vllm["prefix_entries"] <= vllm["pages"]
    with stack.sidecar.client("audit:read") as auditor:
        pem = auditor.get("/v1/audit/public-keys").json()[0]["public_key_pem"]
    [record] = verify_fleet_receipt(done["receipt"], [PublicKey.from_text(pem)])
    assert record.op == "erase" and record.details["request"] == done["id"]

    # her prompt is in no cache: the same prompt from another user of her tenant computes it again
    again = ask(acme, "carol", "Write a very long story about numbers.", system)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    # bob is untouched
    assert ask(acme, "bob", "Count to five.").choices[0].message.content == bob_before


def fill(stack, tokens: int) -> None:
    """Send vLLM (through the front) distinct prompts of real text, `tokens` in all: the blocks
    cached before them are evicted from its prefix cache."""
    text = Path(json.__file__).read_text() + Path(json.decoder.__file__).read_text()
    c = client(stack.front, stack.key("globex"))
    sent, i = 0, 0
    while sent < tokens:
        chunk = text[i * 4000:(i + 1) * 4000]
        n = httpx.post(stack.vllm + "/tokenize", json={"model": MODEL, "prompt": chunk}, timeout=30).json()["count"]
        assert 500 < n < 1900, n
        c.completions.create(model=MODEL, prompt=chunk, max_tokens=1, user=f"filler{i}")
        sent, i = sent + n, i + 1


def test_evicted_blocks_come_back_from_the_host_tier_audited_and_erasure_empties_it(stack):
    acme = client(stack.front, stack.key("acme"))
    system = "Offload. " + SYSTEM + " " + SYSTEM
    first = ask(acme, "grace", "Which book?", system)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    full = (first.usage.prompt_tokens - 1) // BLOCK  # the blocks a hit can cover (never the last token)
    assert full >= 5
    fill(stack, (BLOCKS + 16) * BLOCK)  # more than vLLM's whole pool: her blocks are evicted
    # the same prompt in another tenant (another salt: no hit) is computed into blocks vLLM
    # takes from others; their earlier data is copied out and overwritten before its forward
    # pass writes into them, never after: its answer is the one computed before any eviction
    other = ask(client(stack.front, stack.key("globex")), "ivan", "Which book?", system)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == first.choices[0].message.content
    again = ask(acme, "grace", "Which book?", system)
    # her blocks were gone from vLLM's prefix cache: every one came back from the host tier, and
    # the INT8 copy gives the same greedy answer
    assert again.usage.prompt_tokens_details.cached_tokens == full * BLOCK
    assert again.choices[0].message.content == first.choices[0].message.content
    assert stack.client.flush(30)
    time.sleep(2)  # the connector's sender
    with stack.sidecar.client("audit:read") as auditor:
        records = {op: [r for r in auditor.get("/v1/audit/records", params={"op": op, "limit": 1000}).json()["records"]
                        if r["details"].get("process", "").startswith("vllm-dp0/")]
                   for op in ("offload", "fetch")}
    assert records["offload"] and records["fetch"]
    assert any(len(r["details"]["pages"]) >= full and r["details"]["src"] == stack.tier for r in records["fetch"])
    for r in records["offload"]:  # counts, tiers and block ids only: never a token id or a hash
        assert r["details"]["dst"] == stack.tier and all(p.startswith("vllm:") for p in r["details"]["pages"])
        assert set(r["details"]) <= {"bytes", "event", "n_tokens", "pages", "process", "seq", "src", "dst",
                                     "stored_bytes"}, r["details"]
    on_disk = lambda: len(list((stack.sidecar.data_dir.parent / "kv-offload").rglob("*.page")))  # noqa: E731
    before = on_disk()
    done = erase(stack, "acme", "grace")
    vllm = next(v for k, v in done["result"]["processes"].items() if k.startswith("vllm-dp0/"))
    assert vllm["tier_copies"] >= full  # her copies, emptied in the worker and read back as zeros
    if stack.tier == "disk":  # each a sealed file of the worker's folder: overwritten and gone
        assert before >= full and on_disk() == before - vllm["tier_copies"]
    # her prompt is in no cache and no tier: another user of her tenant computes it again
    assert ask(acme, "heidi", "Which book?", system).usage.prompt_tokens_details.cached_tokens == 0


def test_every_block_is_a_signed_record_without_raw_ids_and_the_bundle_verifies(stack, tmp_path):
    acme = client(stack.front, stack.key("acme"))
    ask(acme, "erin", "Tell me about audit logs.", "Audit. " + SYSTEM)
    erase(stack, "acme", "erin")  # her blocks' erase record, from vLLM's own process
    assert stack.client.flush(30)
    time.sleep(2)  # the connector's sender and the next checkpoint
    with stack.sidecar.client("audit:read") as auditor:
        records = []
        for op in ("open", "store", "free", "erase"):
            r = auditor.get("/v1/audit/records", params={"op": op, "limit": 1000})
            assert r.status_code == 200, r.text
            records += r.json()["records"] if isinstance(r.json(), dict) else r.json()
    ops = {rec["op"] for rec in records if rec["details"].get("process", "").startswith("vllm-dp0/")}
    assert {"open", "store", "free", "erase"} <= ops
    stored = [rec for rec in records if rec["op"] == "store"]
    assert all(p.startswith("vllm:") for rec in stored for p in rec["details"]["pages"])
    # no raw id, prompt text or token id anywhere in the store
    # signatures, hashes and sealed fields are long runs of base64 or hex, where a three-letter
    # name turns up by chance ("bob" did, once): they are left out of the search
    dump = re.sub(rb"[A-Za-z0-9+/=_-]{24,}", b"", database_dump(stack.sidecar.db_url))
    for raw in ("alice", "erin", "bob", "4417 1234", "account number", "audit logs"):
        assert raw.encode() not in dump, raw
    for rec in stored:  # counts and block ids only: never a token id
        assert set(rec["details"]) <= {"bytes", "event", "n_tokens", "pages", "process", "seq"}, rec["details"]
    # the signed chain, exported and verified offline
    key = stack.sidecar.data_dir / "signing.key"
    pub = tmp_path / "log.pub"
    pub.write_text(SigningKey.load(key).public_key.to_pem())
    bundle = tmp_path / "run.zip"
    assert audit_main(["export", "--database-url", stack.sidecar.db_url, "--origin",
                       stack.sidecar.env["KVGUARD_ORIGIN"], "--key", str(key), "-o", str(bundle),
                       "--no-progress"]) == 0
    assert audit_main(["verify", str(bundle), "--public-key", str(pub)]) == 0


def test_no_request_runs_unaudited_when_the_sidecar_is_unreachable(stack, tmp_path):
    """A front whose sidecar does not answer (a socket nobody listens on) runs nothing."""
    from fastapi.testclient import TestClient

    from kvguard.serve.cli import build_upstream

    dead = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead))
    s.close()
    app, front_client = build_upstream(stack.vllm, model_name=MODEL, socket=dead, ingest_token="kvg_x",
                                       client_options={"poll_wait_s": 0.2})
    try:
        with TestClient(app) as tc:
            r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "user": "u"},
                        headers={"Authorization": "Bearer " + stack.key("acme")})
            assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json"
            assert tc.get("/readyz").status_code == 503
    finally:
        front_client.close(flush_timeout_s=0.5)


def test_the_overhead_benchmark_runs(stack):
    import importlib.util

    path = ROOT / "benchmarks" / "serving" / "vllm_front_bench.py"
    spec = importlib.util.spec_from_file_location("vllm_front_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # the module's vLLM stands in for the plain one too: what is run here is the script, not the numbers
    out = bench.main(["--plain", stack.vllm, "--direct", stack.vllm, "--front", stack.front, "--key",
                      stack.key("acme"), "--small"])
    assert all(out["median"][t]["tok_s"] > 0 for t in ("vllm", "direct", "front"))
    assert out["ratio"]["vs_vllm"]["tok_s"] > 0
    assert out["rounds"]["front"][0]["tokens"] > 0


@pytest.mark.parametrize("stack", ["sqlite"], indirect=True)  # its own sidecar: the stack's store plays no part
def test_the_cpu_comparison_benchmark_runs(stack, smollm2_dir, capsys):
    """benchmarks/serving/serve_cpu_vs_vllm.py --small against this module's vLLM: it starts a
    sidecar and serve-llm of its own, sends both the same load and prints the ratio."""
    import importlib.util

    path = ROOT / "benchmarks" / "serving" / "serve_cpu_vs_vllm.py"
    spec = importlib.util.spec_from_file_location("serve_cpu_vs_vllm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    med = bench.main(["--model-dir", str(smollm2_dir), "--vllm", stack.vllm, "--small"])
    assert set(med) == {"vllm", "kvguard"} and all(m["tok_s"] > 0 for m in med.values()), med
    assert "kvguard / vLLM: " in capsys.readouterr().out


def test_vllm_killed_mid_run_is_named_and_the_front_stops_taking_requests(stack):
    acme = client(stack.front, stack.key("acme"))
    stop_vllm(stack.proc, signal.SIGKILL)  # the server, its engine core and workers
    with pytest.raises(openai.APIStatusError) as err:
        ask(acme, "frank", "Hello?")
    assert err.value.status_code == 502 and "unreachable" in str(err.value)
    assert httpx.get(stack.front + "/readyz").status_code == 503
