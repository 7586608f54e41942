"""kvguard inside Hugging Face transformers (>= 5.0): a KV cache and an attention
implementation that put a model's K/V in kvguard's pages (Llama-family models, and Gemma 3,
whose sliding-window layers keep only their window: `load_gemma3`).

    from kvguard.hf import KVGuardCache, load_smollm2
    model, tok = load_smollm2()                      # attn_implementation="kvguard"
    cache = KVGuardCache(model.config, Subject("acme", "alice", "s-1"), codec="int8", fp_sink=4)
    out = model.generate(**tok(prompt, return_tensors="pt"), cache=cache, max_new_tokens=32)
    cache.events.take_events()                       # quantize / evict / ... events
    cache.free()

`cache=` is the keyword of transformers >= 5.24; before, `past_key_values=` (`cache_kwarg(model)`
says which). A call that passes no cache (a text-generation pipeline's) gets a fresh one from
`use_default_cache` (default.py), which `load_smollm2` sets up.

Importing this module registers the "kvguard" attention implementation.
"""

from .attention import kvguard_attention, kvguard_mask, register
from .cache import ATTN_IMPLEMENTATION, CacheFullError, KVGuardCache, KVGuardLayer, cache_kwarg, layer_windows
from .default import DEFAULT_SUBJECT, DefaultCache, use_default_cache
from .graph import DecodeGraph, greedy
from .model import gemma3_folder, gemma3_gguf, load_gemma3, load_smollm2, smollm2_folder, smollm2_gguf

register()

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_SUBJECT", "CacheFullError", "DecodeGraph", "DefaultCache",
           "KVGuardCache", "KVGuardLayer", "cache_kwarg", "gemma3_folder", "gemma3_gguf", "greedy",
           "kvguard_attention", "kvguard_mask", "layer_windows", "load_gemma3", "load_smollm2", "register",
           "smollm2_folder", "smollm2_gguf", "use_default_cache"]
