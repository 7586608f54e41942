"""With the sidecar unreachable nothing runs unaudited: keys cannot be checked (503), and once
the events it has not recorded reach the bound, new requests get 503 while /readyz says so."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient
from transformers import LlamaConfig, LlamaForCausalLM

from kvguard.cache import CacheConfig, CacheManager
from kvguard.client import SidecarClient
from kvguard.hf import register
from kvguard.hf.cache import shape_fields
from kvguard.serve.app import create_app
from kvguard.serve.engine import Engine
from kvguard.serve.keys import Key, KeyChecker


class Tok:
    eos_token_id = None

    def __call__(self, text, **_):
        return type("Enc", (), {"input_ids": [ord(c) % 96 for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


class KnownKeys(KeyChecker):
    async def _ask(self, token):
        return Key("k1", frozenset({"infer"}), "acme")


def test_an_unreachable_sidecar_gives_503_never_an_unaudited_request(tmp_path):
    register()
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("kvguard")
    manager = CacheManager(CacheConfig(**shape_fields(cfg), num_pages=32, dtype=torch.float32))
    gone = tmp_path / "no.sock"
    client = SidecarClient(manager, token="kvg_x", socket=gone, on_full="refuse", max_pending=1, poll_wait_s=0.2)
    engine = Engine(model, Tok(), manager, client=client).start()
    body = {"model": "m", "prompt": "hello", "max_tokens": 2, "user": "u1"}
    auth = {"Authorization": "Bearer kvg_abc"}
    try:
        unchecked = create_app(engine, KeyChecker(token="kvg_x", socket=gone), model_name="m", policy_name="none")
        with TestClient(unchecked) as http:
            r = http.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 503 and r.headers["retry-after"] == "5" and "sidecar" in r.json()["detail"]
        app = create_app(engine, KnownKeys(token="kvg_x", socket=gone), model_name="m", policy_name="none",
                         client=client)
        with TestClient(app) as http:
            assert http.get("/readyz").status_code == 503
            assert http.post("/v1/completions", json=body, headers=auth).status_code == 200
            client._collect()  # the sender takes the request's events: they wait for the sidecar
            assert client.pending >= 1
            r = http.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 503 and "unaudited" in r.json()["detail"]
            assert manager.sequences() == []
    finally:
        engine.stop()
        client._stop.set()
