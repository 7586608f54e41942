"""The batching loop: one thread runs the model over the shared CacheManager, step by step.

Each step, under the manager's lock (so an erasure from the sidecar lands between steps):
  1. reap: a request whose sequence an erasure removed ends with an error naming the
     erasure; a cancelled one (its client left) is freed at once;
  2. schedule (scheduler.py decides, over page counts): the waiting requests it names get a
     sequence (sharing their tenant's cached prompt pages); the requests that gave way for
     pages have theirs freed, to prefill again later;
  3. prefill: the chosen requests feed their next prompt tokens, `chunk` in all, in one
     forward pass (rows padded on the left), so a long prompt holds the decodes back one
     chunk at a time;
  4. decode: every running request feeds its last token, all rows in one forward pass
     (the cache's `append_step`/`attend_step`), and samples its next. When every row is
     greedy and nothing waits, up to `run_ahead` more steps follow, each queued on the device
     from the argmax of the one before before that one's tokens are read, so the host's part
     of a step runs while the device runs the step before.
What the clients get runs behind the device by a step: once a decode step is queued on the
device, the text of the tokens sampled before it is made (detok.py, one batch) and every
item of the step goes to the handlers' event loops in one call each, while the device works;
then the step's tokens are sampled. A token that ends its request (end of text, a stop
string, the length) ends it at once, and a request with stop strings gets its text at once.
Requests join and leave between steps; the cache learns each step's rows (`set_rows`) and
the model each row's position (position_ids). A row's parameters never fail the step of the
others: sampling cannot make a NaN, and a row whose sampling or detokenization still fails
ends alone with a 500.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time

import torch

from ..cache.pool import device_index
from ..client import SidecarUnavailable
from ..errors import ConfigError, InputError, OutOfPages
from ..hf import CacheFullError, DecodeGraph, KVGuardCache, cache_kwarg
from ..types import Subject
from .detok import Detok, Detokenizer
from .scheduler import Plan, Request, SamplingParams, Scheduler, pages_needed

_log = logging.getLogger(__name__)
ERASED = "the request was ended by an erasure of its user or session"
_NOBODY = Subject("-", "-", "-")  # the serving cache's own subject: it never opens a row itself
WARMUP = Subject("kvguard", "warmup", "warmup")  # the start-up requests' (Engine.warmup), erased after


class Engine:
    """model: a transformers causal LM loaded with attn_implementation="kvguard"; manager: the
    CacheManager its K/V go to; client: the SidecarClient that opens and frees sequences (their
    events reach the audit log), None only in tests of the engine alone."""

    def __init__(self, model, tokenizer, manager, *, client=None, chunk: int = 256, max_seqs: int = 64,
                 max_model_len: int | None = None, ignore_eos: bool = False, policy_name: str = "none",
                 use_graphs: bool = True, max_waiting: int | None = None, run_ahead: int = 3):
        self.model, self.tokenizer, self.manager, self.client = model, tokenizer, manager, client
        self.cache = KVGuardCache(model.config, _NOBODY, manager=manager)
        self.kwarg = cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.quantized = "main" in manager.pools
        cfg = manager.cfg
        capacity = {"hot": cfg.num_hot_pages} | ({"main": cfg.num_pages} if self.quantized else {}) | (
            {"split": manager.pools["split"].num_pages} if "split" in manager.pools else {})
        if self.quantized:
            # a prefill chunk's tokens pass through 16-bit pages before they are quantized: the
            # pages of one chunk, and each row's partly filled page, are kept free for that
            transient = math.ceil(chunk / cfg.page_size) + max_seqs
            if cfg.num_hot_pages - transient < 2:
                raise ConfigError(f"num_hot_pages {cfg.num_hot_pages} is too small: a prefill chunk of {chunk} "
                                  f"tokens for up to {max_seqs} rows passes through {transient} 16-bit pages; "
                                  f"give at least {transient + 2 * max_seqs}")
            capacity["hot"] -= transient
        self.chunk = chunk
        self.scheduler = Scheduler(capacity, max_seqs, need=self.pages_needed, chunk=chunk, max_waiting=max_waiting)
        self.policy_name = policy_name  # named in each request's `open` record
        self.run_ahead = run_ahead  # decode steps queued before the tokens of the one before are read
        # on the kernel path, decode steps replay from a CUDA graph per batch size (one bucket per
        # number of rows), rebound to each step's rows; capture=False runs them eagerly through
        # the same fixed buffers (a CPU under Triton's interpreter); a K/V split cache whose
        # evictor needs each key's attention mass decodes eagerly (that mass comes from its
        # reference path)
        needs_mass = manager.evictor is not None and manager.evictor.needs_mass
        graphs = manager.cfg.use_kernels and use_graphs and not (manager.cfg.kv_split is not None and needs_mass)
        self.graphs: dict[int, DecodeGraph] | None = {} if graphs else None
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(limit, max_model_len or limit)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if isinstance(eos, list) else [eos]
        # ignore_eos: every request runs to max_tokens (a benchmark's fixed output length)
        self.eos = set() if ignore_eos else {e for e in [*eos, tokenizer.eos_token_id] if e is not None}
        self.detok = Detokenizer(tokenizer)
        self._behind: list[Request] = []  # requests with tokens not yet made text
        self._outbox: list[tuple[Request, tuple]] = []  # items for the handlers, sent once a step
        self.steps = self.decode_steps = self.tokens_out = self.prefill_tokens = 0
        self.step_seconds = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvguard-engine", daemon=True)

    def warmup(self, prompt_len: int, rows: int | None = None) -> float:
        """Before start(): serve `rows` requests (default max_seqs) of `prompt_len` tokens once,
        the i-th asking for L + i tokens (L: the prompt steps and two), so that what serving
        launches is compiled and captured now and not on the first requests: prompt chunks
        batched as the scheduler batches them, then a decode step at every batch size from `rows`
        down to 1 as they end (its Triton kernels compiled, its CUDA graph captured). The first
        half of the prompts are a whole number of pages, the rest a token short of it: a chunk
        of prompts that fill their last pages is attended over quantized pages alone, one that
        does not over those and 16-bit pages, and each launches prompt-kernel variants of its
        own. Their
        sequences belong to WARMUP, are recorded like any, and the subject is erased at the end,
        which frees its cached prompt pages. Returns seconds."""
        if self._thread.is_alive():
            raise RuntimeError("warmup runs before the engine's thread starts")
        rows = min(rows or self.scheduler.max_seqs, self.scheduler.max_seqs)
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 32000)
        first = -(-rows * prompt_len // self.chunk) + 2  # every prompt is in before the first ends
        prompt_len = max(1, min(prompt_len, self.max_model_len - first - rows - 1))
        t0, eos, self.eos = time.perf_counter(), self.eos, set()  # every request runs to its length
        try:
            page = self.manager.cfg.page_size
            whole = max(page, prompt_len - prompt_len % page)
            lens = [whole if i < (rows + 1) // 2 else max(1, whole - 1) for i in range(rows)]
            reqs = [Request(f"warmup-{i}", WARMUP, [(7 * i + 13 * j + 1) % vocab for j in range(n)],
                            SamplingParams(max_tokens=first + i, temperature=0)) for i, n in enumerate(lens)]
            for r in reqs:
                self.submit(r)
            while self.scheduler.active:
                self.step()
        finally:
            self.eos = eos
        self.manager.erase_user(WARMUP.tenant, WARMUP.user)
        self.steps = self.decode_steps = self.tokens_out = self.prefill_tokens = 0
        self.step_seconds = 0.0
        self.scheduler.peak = 0
        return time.perf_counter() - t0

    # --- the handlers' side -------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def check_length(self, prompt: int, max_tokens: int) -> None:
        if prompt < 1:
            raise InputError("the prompt is empty")
        if prompt + max_tokens > self.max_model_len:
            raise InputError(f"the prompt's {prompt} tokens and max_tokens {max_tokens} exceed the context limit "
                             f"of {self.max_model_len} tokens: shorten the prompt or lower max_tokens")
        if not self.scheduler.fits_ever(self.pages_needed(prompt + max_tokens)):
            raise InputError(f"{prompt + max_tokens} tokens need more KV pages than this server's pool holds: "
                             "shorten the prompt or lower max_tokens")

    def pages_needed(self, tokens: int) -> dict[str, int]:
        """What a request of `tokens` tokens reserves in each pool (scheduler.pages_needed)."""
        return pages_needed(self.manager.cfg, self.quantized, tokens, self.chunk)

    def submit(self, req: Request) -> None:
        """Queue a request (PoolFull when the queue is full; SidecarUnavailable when the audit
        log is behind: no request starts unaudited); its sequence opens when its turn comes."""
        self.check_length(len(req.prompt), req.params.max_tokens)
        client = self.client
        if client is not None and client.on_full == "refuse" and client.pending >= client.max_pending:
            raise SidecarUnavailable(f"{client.pending} events await the sidecar; refusing new requests until "
                                     "they are recorded")
        if not req.params.greedy:
            seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
            req.generator = torch.Generator().manual_seed(seed)
        self.scheduler.add(req)
        self._wake.set()

    def cancel(self, req: Request, reason: str) -> None:
        """Stop a request at the next step and free its sequence (its client left)."""
        if not req.finished:
            req.cancel = reason
            self._wake.set()

    # --- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.active:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a bug must not stop the server: end what ran, say so
                _log.exception("kvguard serve-llm: a step failed; its requests end with an error")
                with self.manager.lock:
                    for r in self.scheduler.active:
                        self._finish(r, error=(500, "the server failed while running this request"))
                self._deliver()

    def step(self) -> None:
        t0 = time.perf_counter()
        try:
            with self.manager.lock, torch.no_grad():
                self._reap()
                for r in self.scheduler.to_open():
                    self._open(r)
                plan: Plan = self.scheduler.schedule()
                for r in plan.preempted:
                    self._free(r)
                if plan.prefill:
                    self._prefill(plan.prefill)
                decode = [r for r in plan.decode if not r.finished]
                if decode:
                    self._decode(decode)
                else:
                    self._catch_up()
        finally:
            self._deliver()
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0

    def _reap(self) -> None:
        live = set(self.manager.sequences())
        for r in self.scheduler.active:
            if r.seq is not None and r.seq not in live:
                self._finish(r, error=(410, ERASED), free=False)
            elif r.cancel:
                self._finish(r, error=(499, r.cancel))

    def _open(self, r: Request) -> None:
        """Open a request's sequence, sharing its tenant's cached prompt pages; its `open` record
        follows under the same lock, so no erasure comes between them."""
        share = r.prompt[:-1] if self.manager.cfg.prefix_sharing else None  # the last token makes logits
        try:
            r.seq = (self.client.open if self.client is not None else self.manager.open)(r.subject, share)
            r.fed = self.manager.length(r.seq)
            if not r.preemptions:
                r.cached = r.fed
            self.manager.announce_open(r.seq, self.policy_name)
        except SidecarUnavailable:
            self._finish(r, error=(503, "the audit sidecar has not recorded recent events; no request runs "
                                        "unaudited, retry later"))
            return
        self.scheduler.opened(r)

    def _free(self, r: Request) -> None:
        """Free a request's sequence (it gave way for pages: it prefills again when its turn comes)."""
        if r.seq is not None and r.seq in set(self.manager.sequences()):
            (self.client.free if self.client is not None else self.manager.free)(r.seq)
        r.seq = None

    def _forward(self, rows: list[Request], ids: torch.Tensor, pos: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        self.cache.set_rows([r.seq for r in rows])
        dev = self.device
        out = self.model(input_ids=ids.to(dev), position_ids=pos.to(dev), use_cache=True, logits_to_keep=1,
                         attention_mask=None if mask is None else mask.to(dev), **{self.kwarg: self.cache})
        return out.logits[:, -1].float()

    def _prefill(self, chunks: list[tuple[Request, int]]) -> None:
        """Feed the scheduled prompt chunks as one batch padded on the left; a request whose
        prompt is done (after a preemption: its prompt and output) samples its next token and
        joins the decodes."""
        rows = [r for r, _ in chunks]
        spans = [(r.fed, r.fed + n) for r, n in chunks]
        t = max(b - a for a, b in spans)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        pos = torch.zeros(len(rows), t, dtype=torch.long)
        mask = torch.zeros(len(rows), t, dtype=torch.long)
        for i, (r, (a, b)) in enumerate(zip(rows, spans)):
            ids[i, t - (b - a):] = torch.tensor(r.tokens(a, b))
            pos[i, t - (b - a):] = torch.arange(a, b)
            mask[i, t - (b - a):] = 1
        try:
            logits = self._forward(rows, ids, pos, None if bool(mask.all()) else mask)
        except CacheFullError:  # the page counts were off: these rows give way (row by row, some wrote)
            _log.warning("kvguard serve-llm: no page for a prefill chunk; %d requests prefill again", len(rows))
            for r in rows:
                self.scheduler.preempt(r)
                self._free(r)
            return
        done = []
        for i, (r, (a, b)) in enumerate(zip(rows, spans)):
            self.prefill_tokens += b - a
            r.fed = b
            if b < r.target:
                continue
            if self.manager.cfg.prefix_sharing:
                self.manager.publish_prefix(r.seq, r.prompt)
            self.scheduler.started(r)
            done.append(i)
        if done:
            self._sample([rows[i] for i in done], logits[done])

    def _decode(self, rows: list[Request]) -> None:
        """A decode step of `rows`, and up to `run_ahead` more (`_ahead` says when): each queued
        on the device from the step before's tokens before those are read, so the host's part of
        a step (its pages, its tables, reading and handing on the tokens before) runs while the
        device runs the step before. While the device runs each, the text of the tokens before it
        is made and sent. A row that a token ended
        (end of text) is still in the step queued after it; that step's token for it is dropped."""
        ids = torch.tensor([r.output[-1] for r in rows])
        logits = self._step_rows(rows, ids)
        if logits is None:  # nothing of the step was written: the youngest row gives way
            youngest = max(rows, key=lambda r: r.arrival)
            _log.warning("kvguard serve-llm: no page for a decode step; request %s prefills again", youngest.request_id)
            self.scheduler.preempt(youngest)
            self._free(youngest)
            self._catch_up()
            return
        for ahead in range(self.run_ahead + 1):
            self.decode_steps += 1
            for r in rows:
                r.fed += 1
            top, read = _read_later(logits)
            nxt = self._ahead(rows) if ahead < self.run_ahead else None
            nxt_logits = None
            if nxt is not None:
                keep, nxt = nxt
                nxt_logits = self._step_rows(nxt, top if len(keep) == len(rows) else _rows_of(top, keep))
            self._catch_up()  # the text of the tokens before, while the device runs
            self._deliver()
            live = [i for i, r in enumerate(rows) if not r.finished]
            tokens = read()  # waits for this step, not for the one queued after it
            self._sample([rows[i] for i in live], logits if len(live) == len(rows) else _rows_of(logits, live),
                         [tokens[i] for i in live])
            self._deliver()
            if nxt_logits is None:
                return
            rows, logits = nxt, nxt_logits

    def _ahead(self, rows: list[Request]) -> tuple[list[int], list[Request]] | None:
        """The rows of the step after this one, when it may be queued before this one's tokens
        are read: on the graph path, every row greedy without stop strings, the rows this step's
        length ends left out, and the others' pages for the step reserved, unless a waiting
        request could start (Scheduler.extend: admissions and prompts come first). (their
        indices, the rows) or None."""
        if self.graphs is None or any(r.generator is not None or r.params.stop or r.cancel for r in rows):
            return None
        keep = [i for i, r in enumerate(rows) if not r.finished and len(r.output) + 1 < r.params.max_tokens
                and r.fed + 1 < self.max_model_len]
        nxt = [rows[i] for i in keep]
        if not nxt or not self.scheduler.extend(nxt, ending=len(nxt) < len(rows)):
            return None
        return keep, nxt

    def _step_rows(self, rows: list[Request], ids: torch.Tensor) -> torch.Tensor | None:
        """Queue a decode step of `rows` (ids [B]: each row's last token, on the host or the
        device); its logits [B, V], or None when there was no page for it (nothing written)."""
        pos = torch.tensor([r.fed for r in rows])
        try:
            if self.graphs is None:
                return self._forward(rows, ids[:, None], pos[:, None])
            return self._replay(rows, ids, pos)
        except (CacheFullError, OutOfPages):
            return None

    def _replay(self, rows: list[Request], ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """A decode step through the graph of its batch size, made at the first step of that size.
        The ids and positions go to the device without waiting for it (a fresh host tensor is
        staged before the copy returns)."""
        seqs = [r.seq for r in rows]
        self.cache.set_rows(seqs)
        graph = self.graphs.get(len(rows))
        if graph is None:
            graph = self.graphs[len(rows)] = DecodeGraph(self.model, self.cache, self.max_model_len)
        else:
            graph.rebind(seqs)
        return graph.step(ids.to(self.device, non_blocking=True), pos.to(self.device, non_blocking=True)).float()

    def _sample(self, rows: list[Request], logits: torch.Tensor, greedy: list[int] | None = None) -> None:
        """Each row's next token (logits: [B, V] on the device) handed on: the greedy ones from
        one argmax over the batch and one read of B ints (or `greedy`, read already), the others
        drawn by their own generators; a failure ends its row only."""
        if greedy is None:
            greedy = logits.argmax(-1).tolist()
        for i, r in enumerate(rows):
            try:
                tok = greedy[i] if r.generator is None else sample(logits[i], r.params, r.generator)
                self._accept(r, tok)
            except Exception:  # noqa: BLE001 - one row's failure is that row's: the others run on
                _log.exception("kvguard serve-llm: request %s failed while sampling; it alone ends", r.request_id)
                self._finish(r, error=(500, "the server failed while running this request"))

    def _accept(self, r: Request, tok: int) -> None:
        if tok in self.eos:
            self._send(r, self._text(r, final=True), final=True)
            self._finish(r, "stop")
            return
        r.output.append(tok)
        self.tokens_out += 1
        stops = r.params.stop
        if stops:
            text = self._text(r)
            start = max(0, len(r.text) - max(map(len, stops)))
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if hits:
                self._send(r, text[: min(hits)], final=True)
                self._finish(r, "stop")
                return
        if len(r.output) >= r.params.max_tokens or r.fed + 1 >= self.max_model_len:
            self._send(r, self._text(r, final=True), final=True)
            self._finish(r, "length")
            return
        if stops:
            self._send(r, text)
        else:
            self._behind.append(r)

    def _catch_up(self) -> None:
        """Make text of the tokens sampled since each request's last text, all in one batch, and
        send it; a failure ends its row only."""
        rows, self._behind = self._behind, []
        rows = list({id(r): r for r in rows if not r.finished}.values())  # a row once, however often it came
        if not rows:
            return
        try:
            texts = self._texts(rows)
        except Exception:  # noqa: BLE001 - the batch failed: find the row that fails, alone
            texts = []
            for r in rows:
                try:
                    texts.append(self._text(r))
                except Exception:  # noqa: BLE001
                    _log.exception("kvguard serve-llm: request %s failed while detokenizing; it alone ends",
                                   r.request_id)
                    self._finish(r, error=(500, "the server failed while running this request"))
                    texts.append(None)
        for r, text in zip(rows, texts):
            if text is not None and not r.finished:
                self._send(r, text)

    def _texts(self, rows: list[Request], final: bool = False) -> list[str]:
        """The rows' outputs as text so far (detok.py)."""
        for r in rows:
            if r.detok is None:
                r.detok = Detok()
        return self.detok.texts([r.output for r in rows], [r.detok for r in rows], final)

    def _text(self, r: Request, *, final: bool = False) -> str:
        return self._texts([r], final)[0]

    def _send(self, r: Request, text: str, *, final: bool = False) -> None:
        """Send the text not sent yet; unless final, hold back a partial character and what
        could be the start of a stop string."""
        if not final:
            text = text.rstrip("\ufffd")
            if r.params.stop:
                text = text[: max(len(r.text), len(text) - max(map(len, r.params.stop)) + 1)]
        if len(text) > len(r.text) and text.startswith(r.text):
            self._outbox.append((r, ("text", text[len(r.text):])))
            r.text = text

    def _finish(self, r: Request, reason: str | None = None, *, error: tuple[int, str] | None = None,
                free: bool = True) -> None:
        if r.finished:
            return
        if free:
            self._free(r)
        self.scheduler.release(r)
        if error is not None:
            self._outbox.append((r, ("error", *error)))
        else:
            self._outbox.append((r, ("done", reason, {
                "prompt_tokens": len(r.prompt), "completion_tokens": len(r.output),
                "total_tokens": len(r.prompt) + len(r.output), "cached_tokens": r.cached})))

    def _deliver(self) -> None:
        """Hand the items of the step so far to their handlers: one call into each event loop
        (each call wakes it), not one an item."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        loops: dict = {}
        for r, item in items:
            if r.loop is not None and r.queue is not None:
                loops.setdefault(r.loop, []).append((r.queue, item))
        for loop, batch in loops.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # its loop has closed: nobody waits for these
                _log.warning("kvguard serve-llm: %d items for a closed event loop dropped", len(batch))


def _rows_of(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """x's rows `index`, without waiting for the device (x[list] would copy the list and wait)."""
    return x.index_select(0, device_index(index, x.device))


def _read_later(logits: torch.Tensor):
    """(the argmax of each row's logits on the device, a function that reads them as a list).
    On CUDA the read waits for the work queued up to now only, not for a step queued after it:
    the argmax goes to pinned host memory behind an event."""
    top = logits.argmax(-1)
    if top.device.type != "cuda":
        return top, top.tolist
    host = torch.empty(top.shape, dtype=top.dtype, pin_memory=True)
    host.copy_(top, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list[int]:
        done.synchronize()
        return host.tolist()

    return top, read


def _put_all(batch: list[tuple]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """A token drawn from softmax(logits / temperature) within the top_p mass (logits: [V]),
    by the Gumbel-max trick in float64: no probabilities are divided or normalized by a sum,
    so no distribution of NaNs is ever drawn from; NaN logits count as impossible tokens, and
    a row with no possible token falls back to the greedy one."""
    greedy = int(logits.nan_to_num(nan=-math.inf).argmax())
    if params.greedy:
        return greedy
    x = logits.detach().to("cpu", torch.float64) / params.temperature
    x = torch.nan_to_num(x, nan=-math.inf, posinf=torch.finfo(torch.float64).max, neginf=-math.inf)
    if not bool(torch.isfinite(x).any()):
        return greedy
    if params.top_p < 1.0:
        probs = torch.softmax(x, -1)
        sorted_p, idx = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= params.top_p  # the most likely token always stays
        x[idx[drop]] = -math.inf
    u = torch.rand(x.shape, dtype=torch.float64, generator=generator).clamp_(min=1e-300, max=1 - 1e-16)
    return int((x - torch.log(-torch.log(u))).argmax())
