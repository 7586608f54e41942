"""Incremental detokenization with SmolLM2's tokenizer: the streamed text is the whole output's
decode, never retracted, and each token decodes only a few tokens again (never the output);
through the tokenizer's Rust backend in one batch for many requests, or one call a window, the
same text as the tokenizer's own decode."""

from __future__ import annotations

import pytest

from kvguard.serve.detok import Detok, Detokenizer

TEXTS = ["def add(a, b):\n    return a + b  # sum\n\n\tprint(  add(1,2) )",
         "Hello, world! The quick brown fox jumps over the lazy dog. " * 3,
         "数据保护：用户的缓存页面在请求时被删除。🙂👍🏽 Ünïcödé façade — “quotes” …",
         "<|im_start|>user\nhi<|im_end|> after special tokens, and more text after them to stream"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvguard.hf.model import smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder())


def counting(detok: Detokenizer) -> list[int]:
    """The longest window each call of detok's decode_batch decoded, appended as it runs."""
    most, inner = [], detok.decode_batch

    def decode_batch(seqs):
        most.append(max(map(len, seqs)))
        return inner(seqs)

    detok.decode_batch = decode_batch
    return most


@pytest.mark.parametrize("batched", [True, False], ids=["rust-batch", "call-a-window"])
def test_streamed_text_is_the_whole_decode_and_decodes_few_tokens_a_step(tok, batched):
    """Every text streamed at once, a token a step each, as a serving step's rows are."""
    detok = Detokenizer(tok)
    if not batched:
        detok = Detokenizer(type("NoBackend", (), {"decode": staticmethod(tok.decode)})())
    most = counting(detok)
    ids = [tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    outs, states, seen = [[] for _ in ids], [Detok() for _ in ids], [""] * len(ids)
    for i in range(max(map(len, ids))):
        live = [j for j in range(len(ids)) if i < len(ids[j])]
        for j in live:
            outs[j].append(ids[j][i])
        last = [i == len(ids[j]) - 1 for j in live]
        texts = detok.texts([outs[j] for j in live], [states[j] for j in live])
        for j, now, end in zip(live, texts, last):
            if end:
                now = detok.texts([outs[j]], [states[j]], final=True)[0]
            assert now.startswith(seen[j])
            assert "\ufffd" not in now[len(seen[j]):] or end
            seen[j] = now
    for j, x in enumerate(ids):
        assert seen[j] == tok.decode(x, skip_special_tokens=True)
    assert max(most) <= 8 < min(map(len, ids))


def test_the_batch_is_one_call(tok):
    detok = Detokenizer(tok)
    most = counting(detok)
    outs = [tok(t, add_special_tokens=False).input_ids[:3] for t in TEXTS]
    detok.texts(outs, [Detok() for _ in outs])
    assert len(most) == 1
