"""export.py reads a GGUF's header once for the tokenizer, the config and the weights."""

from __future__ import annotations

import gguf

from kvguard.hf.export import _read_once
from kvguard.hf.model import smollm2_gguf


def test_a_gguf_is_parsed_once_while_exporting_and_the_reader_is_restored_after():
    path = smollm2_gguf()
    real = gguf.GGUFReader
    with _read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file: the same reader
        assert isinstance(first, real) and len(first.tensors) > 0
    assert gguf.GGUFReader is real
