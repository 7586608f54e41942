"""`kvguard serve-llm --upstream`: what it refuses before it starts (no sidecar or vLLM needed)."""

from __future__ import annotations

import argparse

import pytest

from kvguard.errors import ConfigError
from kvguard.serve.cli import add_arguments, run


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
