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
