"""Decode steps of a transformers model over a KVGuardCache, replayed from a CUDA graph.

An eager decode step of a model at small batch is bound by the host: the Python of every
layer, the model's and the cache's, takes longer than the GPU's work. `DecodeGraph` captures
one step (the model's forward for one new token per row, the cache's token writes and decode
kernels inside it) and replays it. What is left to the host per step is the cache's
bookkeeping between steps (kvguard.cache.step.StaticStep: pages for new tokens, compaction,
quantization of pages that left the 16-bit window, all as in an eager step and audited the
same) and one graph launch.

    cache = KVGuardCache(model.config, subject, codec="int8", fp_sink=4)
    ids = greedy(model, cache, prompt_ids, max_new_tokens=128)    # the prompt eagerly, then replays

or step by step, after the prompt's forward pass through the cache:

    graph = DecodeGraph(model, cache, max_tokens=4096)
    logits = graph.step(next_ids, positions)                       # [B] each -> [B, vocab]

The first step runs eagerly (it compiles the kernels and fills their caches), the second
captures the graph and replays it, and every later step replays it. A graph serves one batch
of rows up to `max_tokens` tokens a row; with `capture=False` (the default off CUDA) the same
steps run eagerly through the same fixed buffers.

Fixed buffers need the cache's kernel path (CUDA with 16-bit K/V, or Triton's interpreter).
`greedy` over a cache off that path (on the CPU, or in float32) runs each decode step as an
eager forward pass of the model, the batch's token in one write and one attention call per
layer, as `model.generate` does: the tokens are those the graph would give.
"""

from __future__ import annotations

import torch

from ..cache import CacheManager
from ..cache.step import StaticStep
from ..errors import ConfigError, InputError
from .cache import KVGuardCache, cache_kwarg


class DecodeGraph:
    """One decode step of `model` over the rows of `cache`, replayed from a CUDA graph.

    model: a transformers causal LM whose attention is "kvguard".
    cache: the KVGuardCache the prompt went through (its rows are the graph's batch); its
        manager must run on the kernel path (on CUDA with float16/bfloat16 K/V).
    max_tokens: the most tokens a row may hold; a step past it is refused.
    capture: capture and replay a CUDA graph (default: when the cache is on CUDA).
    """

    def __init__(self, model, cache: KVGuardCache, max_tokens: int, *, capture: bool | None = None):
        if not isinstance(cache, KVGuardCache):
            raise InputError(f"cache must be a KVGuardCache, got {type(cache).__name__}")
        if not cache.seqs:
            raise InputError("the cache holds no rows yet: run the prompt through the model with it first")
        m = cache.manager
        if not isinstance(m, CacheManager) or m.cfg.window is not None:
            raise ConfigError("a decode graph runs the kernels, and no kernel reads a sliding window: a model "
                              "with window layers (Gemma 3) decodes eagerly (kvguard.hf.greedy does)")
        self.static = StaticStep(m, cache.seqs, max_tokens)
        dev = m.cfg.device
        self.capture = dev.type == "cuda" if capture is None else bool(capture)
        if self.capture and dev.type != "cuda":
            raise ConfigError(f"a CUDA graph needs the cache on CUDA; it is on {dev}")
        self.model, self.cache = model, cache
        self.batch = len(cache.seqs)
        self.ids = torch.zeros(self.batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.batch, 1, dtype=torch.long, device=dev)
        self._kwarg = cache_kwarg(model)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self._warm = False

    def rebind(self, seq_ids) -> None:
        """Step another batch of as many open sequences of the cache's manager from now on (a
        serving loop's rows, which change between steps): the captured graph replays for them."""
        self.static.rebind(seq_ids)
        self.cache.set_rows(self.static.seq_ids)

    def _ints(self, x, name: str) -> torch.Tensor:
        t = torch.as_tensor(x)
        if t.dtype not in (torch.int32, torch.int64) or t.numel() != self.batch or t.dim() > 2:
            raise InputError(f"{name} must hold one integer per row ({self.batch}), got "
                             f"{t.dtype} of shape {list(t.shape)}")
        return t.reshape(self.batch, 1)

    def step(self, input_ids, position_ids) -> torch.Tensor:
        """Feed each row's next token (input_ids [B] or [B, 1], at position_ids of the same
        shape) through the model; returns the logits of the next token, [B, vocab]."""
        ids, pos = self._ints(input_ids, "input_ids"), self._ints(position_ids, "position_ids")
        if ids.device.type == "cpu" and pos.device.type == "cpu":  # a device tensor is not read back to check
            vocab = self.model.config.vocab_size
            if int(ids.min()) < 0 or int(ids.max()) >= vocab or int(pos.min()) < 0:
                raise InputError(f"input_ids must lie in [0, {vocab}) and position_ids be >= 0")
        self.ids.copy_(ids, non_blocking=True)
        self.pos.copy_(pos, non_blocking=True)
        with torch.no_grad(), self.static:
            self.cache._static = self.static
            try:
                return self._run()
            finally:
                self.cache._static = None

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, position_ids=self.pos, use_cache=True, **{self._kwarg: self.cache})
        return out.logits[:, -1]

    def _run(self) -> torch.Tensor:
        if not self.capture:
            return self._forward()
        if not self._warm:  # eagerly, on a side stream: compiles kernels and fills their caches
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream(device=self.ids.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                out = self._forward()
            main.wait_stream(side)
            self._warm = True
            return out
        if self._graph is None:
            seen = [layer.seen for layer in self.cache.layers]
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self._out = self._forward()
            finally:  # capturing ran nothing (and a failed capture nothing either): the replay does
                for layer, n in zip(self.cache.layers, seen):
                    layer.seen = n
            self._graph = graph
        self._graph.replay()
        self.static.replayed()
        for layer in self.cache.layers:
            layer.seen += 1
        return self._out.clone()


def greedy(model, cache: KVGuardCache, input_ids: torch.Tensor, *, max_new_tokens: int,
           attention_mask: torch.Tensor | None = None, eos_token_id: int | None = None, pad_token_id: int = 0,
           capture: bool | None = None) -> torch.Tensor:
    """Greedy decoding, as `model.generate(do_sample=False)`: the prompt's forward pass eagerly
    through `cache` (left padding allowed, given by attention_mask), then one step per new
    token: a DecodeGraph step when the cache is on the kernel path (replayed from a CUDA graph
    on CUDA unless capture=False), else an eager forward pass of the batch's tokens (on the
    CPU, for one). The cache must hold no tokens yet (a new one, or one after `free()`). Rows
    that produced eos_token_id get pad_token_id after it; decoding stops when every row has.
    Returns [B, prompt + new] token ids."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise InputError("input_ids must be a [B, T] tensor of token ids with T >= 1")
    if cache.get_seq_length():
        raise InputError(f"the cache holds {cache.get_seq_length()} tokens already; greedy feeds the prompt from "
                         "position 0: pass a new KVGuardCache, or call cache.free() first")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if mask.shape != input_ids.shape:
        raise InputError(f"attention_mask has shape {list(mask.shape)}; input_ids {list(input_ids.shape)}")
    if not bool(mask[:, -1].all()):
        raise InputError("pad on the left: every row's last prompt token must be real")
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **{cache_kwarg(model): cache})
    nxt = out.logits[:, -1].argmax(-1)
    at = pos[:, -1] + 1
    done = torch.zeros_like(nxt, dtype=torch.bool)
    new = []
    step = None
    for i in range(max_new_tokens):
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
            done |= nxt == eos_token_id
        new.append(nxt)
        if i == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        if step is None:
            step = _decode_step(model, cache, max_new_tokens, capture)
        nxt = step(nxt, at).argmax(-1)
        at = at + 1
    return torch.cat([input_ids, torch.stack(new, 1).to(input_ids.dtype)], 1)


def _decode_step(model, cache: KVGuardCache, max_new_tokens: int, capture: bool | None):
    """greedy's decode step, (ids [B], positions [B]) -> logits [B, vocab]: a DecodeGraph's on
    the kernel path (or when a graph is asked for, which off it is refused), else the model's
    eager forward pass over the batch's one new token a row, which is generate's decode step."""
    if capture or cache.manager.cfg.use_kernels:
        longest = max(cache.manager.length(s) for s in cache.seqs)
        return DecodeGraph(model, cache, longest + max_new_tokens, capture=capture).step
    kwarg = cache_kwarg(model)

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=ids[:, None], position_ids=pos[:, None], use_cache=True, **{kwarg: cache})
        return out.logits[:, -1]

    return step
