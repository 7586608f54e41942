"""A GGUF model written out as a safetensors folder: for engines that load such folders (vLLM,
in bfloat16), and as kvguard's own cache of the models it is measured on (float32, model.py),
which load from it in a fraction of a second where the GGUF is dequantized again each time.

transformers dequantizes a GGUF at load; the loaded model refuses `save_pretrained` (it is
marked GGUF-quantized), so its weights are copied into a fresh model of the same config and
that one is saved, with the tokenizer. The logits of the two are the same.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


@contextlib.contextmanager
def _read_once():
    """transformers parses a GGUF's header three times (tokenizer, config, weights), each time
    building a numpy view per vocabulary entry: with Gemma 3's 262,144 tokens, ~12 s a parse
    here. Meanwhile `gguf.GGUFReader`, which it imports at each call, hands back the reader of
    a file it already opened (a reader is read-only over a memory map)."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def export_folder(gguf: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `gguf` as a model folder at `out` (config, safetensors, tokenizer) unless it is there
    already; returns `out`. Written into a sibling folder renamed whole, so a crash leaves no half
    folder, under a file lock that other processes exporting to `out` wait on."""
    gguf, out = Path(gguf), Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if (out / "config.json").exists() and (out / "model.safetensors").exists():
            return out  # another process wrote it while this one waited
        os.environ["HF_HUB_OFFLINE"] = "1"
        import shutil
        import tempfile

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging

        logging.disable_progress_bar()
        with _read_once():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        config = src.config
        if hasattr(config, "quantization_config"):  # the weights are plain tensors now
            del config.quantization_config
        fresh = type(src)(config).to(dtype)
        fresh.load_state_dict(src.state_dict())
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            fresh.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            shutil.rmtree(out, ignore_errors=True)  # a folder left without its weights
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out
