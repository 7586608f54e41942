"""Incremental detokenization with SmolLM2's tokenizer: the streamed text is the whole output's
decode, never retracted, and each token decodes only a few tokens again (never the output)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvguard.serve.engine import Engine
from kvguard.serve.scheduler import Request, SamplingParams
from kvguard.types import Subject

TEXTS = ["def add(a, b):\n    return a + b  # sum\n\n\tprint(  add(1,2) )",
         "Hello, world! The quick brown fox jumps over the lazy dog. " * 3,
         "数据保护：用户的缓存页面在请求时被删除。🙂👍🏽 Ünïcödé façade — “quotes” …",
         "<|im_start|>user\nhi<|im_end|> after special tokens, and more text after them to stream"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvguard.hf.model import smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder())


class Counting:
    def __init__(self, tok):
        self.tok, self.most = tok, 0

    def decode(self, ids, **kw):
        self.most = max(self.most, len(ids))
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_whole_decode_and_decodes_few_tokens_a_step(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    counting = Counting(tok)
    engine = SimpleNamespace(tokenizer=counting)
    r = Request("1", Subject("t", "u", "s"), [1], SamplingParams(len(ids)))
    seen = ""
    for i in range(len(ids)):
        r.output.append(ids[i])
        now = Engine._text(engine, r, final=i == len(ids) - 1)
        assert now.startswith(seen) and "\ufffd" not in now[len(seen):] or i == len(ids) - 1
        seen = now
    assert seen == tok.decode(ids, skip_special_tokens=True)
    assert counting.most <= 8 < len(ids)
