"""`kvguard serve-llm --model gemma3` with the stock openai client: completions give transformers'
own greedy tokens through a cache of sliding-window and global layers, and chat, which a model
without a chat template cannot take, is a 400 that says where to go instead."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from transformers import DynamicCache

from kvguard.cache import LayeredManager
from kvguard.hf import cache_kwarg
from tests.sidecar.conftest import free_port

from .conftest import Llm

pytestmark = pytest.mark.xdist_group("gemma3")  # the worker that loads Gemma 3 for tests/hf/test_gemma3.py

N = 12
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def gemma_llm(sidecar, gemma3):
    from kvguard.serve.cli import build

    model, tok = gemma3
    app, engine, client = build(model, tok, model_name="gemma3", socket=sidecar.socket,
                                ingest_token=sidecar.tokens["ingest"], client_options={"poll_wait_s": 1.0},
                                num_pages=32, max_seqs=4, chunk=64)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    else:
        raise AssertionError("kvguard serve-llm did not become ready")
    llm = Llm(url, app, engine, client, server, thread)
    yield llm
    llm.stop()


def test_completions_match_transformers_and_chat_is_refused(gemma_llm, sidecar, gemma3):
    model, tok = gemma3
    assert isinstance(gemma_llm.engine.manager, LayeredManager)
    c = openai.OpenAI(base_url=gemma_llm.url + "/v1", api_key=sidecar.tokens["acme"], max_retries=0, timeout=120)
    got = c.completions.create(model="gemma3", prompt=PROMPT, max_tokens=N, user="u-1", temperature=0)
    assert got.usage.completion_tokens == N
    ids = torch.tensor([tok(PROMPT).input_ids])
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=N, do_sample=False,
                                 **{cache_kwarg(model): DynamicCache(config=model.config)})
    finally:
        model.set_attn_implementation(impl)
    assert got.choices[0].text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert [m.id for m in c.models.list().data] == ["gemma3"]
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        c.chat.completions.create(model="gemma3", messages=[{"role": "user", "content": "Hi"}], max_tokens=N,
                                  user="u-1")
    assert gemma_llm.client.flush(10)  # the requests' cache events reached the audit log
