"""Parts of `kvguard serve-llm --upstream` without a sidecar or vLLM: what the command refuses
before it starts, and how the front keeps and forgets cache salts."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from kvguard.errors import ConfigError
from kvguard.serve.cli import add_arguments, run
from kvguard.serve.upstream import Salts
from kvguard.types import Subject


def args(tmp_path, *argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    sock = tmp_path / "ingest.sock"
    sock.touch()
    return p.parse_args(["--socket", str(sock), *argv])


@pytest.mark.parametrize("argv,message", [
    ((), "give --model"),
    (("--model", "smollm2", "--upstream", "http://127.0.0.1:8001"), "give --model"),
    (("--upstream", "ftp://127.0.0.1:8001", "--served-model-name", "m"), "http:// or https://"),
    (("--upstream", "http://127.0.0.1:8001"), "name the model"),
])
def test_the_front_refuses_what_it_cannot_serve(tmp_path, monkeypatch, argv, message):
    monkeypatch.setenv("KVGUARD_INGEST_TOKEN", "kvg_test")
    with pytest.raises(ConfigError, match=message):
        run(args(tmp_path, *argv))


def test_salts_are_kept_briefly_dropped_on_erasure_and_asked_anew_after_it():
    asked = []

    def sidecar(request: httpx.Request) -> httpx.Response:
        body = request.read().decode()
        asked.append(body)
        return httpx.Response(200, json={"salt": f"salt-{len(asked)}"})

    salts = Salts(httpx.AsyncClient(base_url="http://sidecar", transport=httpx.MockTransport(sidecar)))
    alice, bob = Subject("acme", "alice", "s1"), Subject("acme", "bob", "s2")

    async def go():
        a1 = await salts.salt(alice, "user")
        assert await salts.salt(alice, "user") == a1 and len(asked) == 1  # kept
        t1 = await salts.salt(alice, "tenant")
        await salts.salt(bob, "user")
        salts.forget("acme", "user", "alice")
        assert await salts.salt(alice, "user") != a1  # asked anew, and again next time: not kept for now
        n = len(asked)
        await salts.salt(alice, "user")
        assert len(asked) == n + 1
        assert await salts.salt(bob, "user") == "salt-3"  # bob's kept
        assert await salts.salt(bob, "tenant") == t1  # the tenant's salt is not hers to drop

    asyncio.run(go())


def test_a_salt_is_asked_again_once_when_the_connection_drops_but_not_after_a_timeout():
    """The sidecar closing a kept-alive connection as the front takes it is not an outage: the
    salt is asked again, once. A timeout is not retried (the caller would wait twice)."""
    calls = []

    def flaky(errors):
        def handler(request: httpx.Request) -> httpx.Response:
            calls.append(request.url.path)
            if errors:
                raise errors.pop(0)
            return httpx.Response(200, json={"salt": "s"})
        return handler

    async def ask(errors):
        salts = Salts(httpx.AsyncClient(base_url="http://sidecar", transport=httpx.MockTransport(flaky(errors))))
        return await salts.salt(Subject("acme", "alice", "s1"), "user")

    assert asyncio.run(ask([httpx.RemoteProtocolError("Server disconnected without sending a response.")])) == "s"
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(httpx.RemoteProtocolError):  # twice: the sidecar is gone
        asyncio.run(ask([httpx.RemoteProtocolError("a"), httpx.RemoteProtocolError("b")]))
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(ask([httpx.ReadTimeout("slow")]))
    assert len(calls) == 1


@pytest.mark.parametrize("upstream_name", ["upstream-name", "served"])
def test_a_stream_is_relayed_renamed_and_an_erasure_ends_it_while_vllm_is_silent(upstream_name):
    """The front's relay without vLLM: a fake upstream streams two chunks, then nothing for a
    minute (a long prefill, a queue). The client gets the two chunks under the served model's
    name without vLLM's transfer parameters; an erasure of the subject meanwhile ends the
    stream at once with the erasure's error, and the upstream connection is closed. Under the
    same name upstream, a line with nothing to strip passes as it came."""
    import json
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from fastapi.testclient import TestClient

    from kvguard.serve.keys import Key, KeyChecker
    from kvguard.serve.upstream import Inflight, create_upstream_app
    from tests.sidecar.conftest import free_port

    closed = threading.Event()
    fake = FastAPI()

    @fake.post("/v1/chat/completions")
    async def chat():
        async def lines():
            try:
                for i in range(2):
                    chunk = {"model": upstream_name, "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
                    if i == 0:
                        chunk["kv_transfer_params"] = {"x": 1}
                    yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(60)
            finally:
                closed.set()
        return StreamingResponse(lines(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)

    class Keys(KeyChecker):
        async def check(self, token, scope="infer"):
            return Key("k1", frozenset({"infer"}), "acme")

    salts = Salts(httpx.AsyncClient(base_url="http://sidecar", transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"salt": "s"}))))
    inflight = Inflight()
    app = create_upstream_app(f"http://127.0.0.1:{port}", Keys(token="kvg_x"), salts, inflight,
                              model_name="served", upstream_model=upstream_name)
    try:
        with TestClient(app) as tc, tc.stream(
                "POST", "/v1/chat/completions", headers={"Authorization": "Bearer kvg_x"},
                json={"model": "served", "user": "alice", "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 2:
                    t0 = time.monotonic()
                    threading.Thread(target=inflight.end, args=(lambda s: s.user == "alice",)).start()
            assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["t0", "t1"]
            assert all(e["model"] == "served" and "kv_transfer_params" not in e for e in events[:2])
            assert events[2]["error"]["code"] == 410 and "erasure" in events[2]["error"]["message"]
            assert time.monotonic() - t0 < 5  # not the upstream's minute of silence
        assert closed.wait(10)  # the front closed its connection to vLLM: vLLM aborts the request
    finally:
        server.should_exit = True
