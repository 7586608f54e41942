"""A GGUF model written out as a safetensors folder, for engines that load such folders (vLLM).

transformers dequantizes a GGUF at load; the loaded model refuses `save_pretrained` (it is
marked GGUF-quantized), so its weights are copied into a fresh model of the same config and
that one is saved, with the tokenizer. The logits of the two are the same.
"""

from __future__ import annotations

from pathlib import Path

import torch


def export_folder(gguf: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `gguf` as a model folder at `out` (config, safetensors, tokenizer); returns `out`.
    Written into a sibling folder first and renamed, so a crash leaves no half folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    src = AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    config = src.config
    if hasattr(config, "quantization_config"):  # the weights are plain tensors now
        del config.quantization_config
    fresh = type(src)(config).to(dtype)
    fresh.load_state_dict(src.state_dict())
    fresh.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out
