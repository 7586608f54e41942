"""A batch's decode steps with device arguments that stay put, for CUDA graphs.

A decode step on the kernel path hands the kernels a few small device tensors: the rows the
new token goes to, each pool's block table, the tokens each row holds there, and (for an
evictor that scores by attention mass) where each key's mass goes. `StaticStep` keeps them in
buffers of fixed shape and address, sized once for `max_tokens` tokens a row, and refreshes
them in place before every step. A CUDA graph captured over a step (with the model's forward
around it) then reads the current pages when it is replayed.

The host's work that an eager step does between layers moves out of the step: `begin` does,
in this order, what the first layer's `append_step` does (compaction past the evictor's
budget, a new 16-bit page for each row that starts one) and what `attend_step` needs (pages
back from lower tiers), then fills the buffers; `end` does what the layers' writes leave for
the host (lengths, room for the mass, pages that left the 16-bit window quantized). Between
the two, `write` and `attend` per layer only launch device work. One difference from an eager
step: the pages that leave the 16-bit window are quantized after the step, so its last layer
reads them still in 16-bit, as every other layer does.

The manager's lock is held from `begin` to `end`: an erasure that arrives meanwhile waits until
the step has written its tokens, and finds no step in flight over pages it frees.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import torch

from ..errors import ConfigError, InputError, OutOfPages
from ..types import SeqId
from . import paged
from .manager import CacheManager
from .pages import SPLIT
from .sequence import Sequence


class StaticStep:
    """Decode steps of one batch of sequences through fixed device buffers.

    manager: a CacheManager on the kernel path (`use_kernels`).
    seq_ids: the batch's sequences, one per row, each holding the same tokens in every layer.
    max_tokens: the most tokens a row may hold after a step; sizes the buffers and the
        kernels' split of the context (a graph captured for it serves every length below).

    Use: `begin()`, then per layer `write(layer, k, v)` and `attend(layer, q)`, then `end()`;
    or `with step: ...` around the layers.
    """

    def __init__(self, manager: CacheManager, seq_ids: Seq[SeqId], max_tokens: int):
        c = manager.cfg
        if not c.use_kernels:
            raise ConfigError("a static decode step runs on the kernel path: a cache with use_kernels "
                              "(on CUDA with float16 or bfloat16 K/V)")
        split = manager.split
        if split is not None and manager.evictor is not None and manager.evictor.needs_mass:
            raise ConfigError("a K/V split cache whose evictor scores by attention mass decodes eagerly (the "
                              "mass of every key comes from its reference path)")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        with manager.lock:
            seqs = manager.seqs.batch(seq_ids)
            for seq in seqs:
                self._check_between_steps(seq)
                if seq.lengths[0] >= max_tokens:
                    raise InputError(f"sequence {seq.id} already holds {seq.lengths[0]} tokens; "
                                     f"max_tokens is {max_tokens}")
        self.manager = manager
        self.seq_ids = [seq.id for seq in seqs]
        self.max_tokens = max_tokens
        s, h, dev = c.page_size, c.num_kv_heads, c.device
        b = len(seqs)
        self.pages = math.ceil(max_tokens / s)
        self.names = list(manager.pools)  # the 16-bit pool, then the codec's
        self.with_mass = manager.evictor is not None and manager.evictor.needs_mass
        self.rows = torch.zeros(b * h, dtype=torch.long, device=dev)
        self.lens = torch.zeros(len(self.names), b, dtype=torch.int32, device=dev)
        # a row's pages in a pool: at most the step's, and at most the pool's (a K/V split cache's
        # 16-bit and codec pools hold a window: a table as wide as the context would have the
        # kernels walk empty slots)
        self.width = {name: min(self.pages, manager.pools[name].num_pages) for name in self.names}
        self.tables = {name: torch.zeros(b, self.width[name], dtype=torch.int32, device=dev) for name in self.names}
        self.positions = ({name: torch.full((b, self.width[name] * s), -1, dtype=torch.long, device=dev)
                           for name in self.names} if self.with_mass else {})
        # (address, head stride, columns) of each row's mass buffer, per layer (paged_decode_sets'
        # mass_into row table): rewritten when a buffer moves (a compaction replaces it)
        self.mass_rows = (torch.zeros(c.num_layers, b, 3, dtype=torch.int64, device=dev)
                          if self.with_mass else None)
        # the K/V split: how many cold pages each row reads (top-k and fraction rules), and the
        # pages each layer read, reported after the step (split.ValueSplit.record)
        self.split = split
        if split is not None:
            self.k = split.rule.pages(self.width[SPLIT])  # None: the mass rule
            self.want = torch.zeros(b, dtype=torch.int32, device=dev) if self.k is not None else None
            self.reads = torch.zeros(c.num_layers, b, self.k or self.width[SPLIT], dtype=torch.int32, device=dev)
            self.read_counts = torch.zeros(c.num_layers, b, dtype=torch.int32, device=dev)
        self._versions: tuple | None = None  # the page-list versions the tables were filled from
        self._mass_at: tuple | None = None
        self._open = False

    def rebind(self, seq_ids: Seq[SeqId]) -> None:
        """Serve another batch of as many rows from the next step on (a serving loop's rows
        change between steps): the buffers keep their shape and address, so a graph captured
        over this step replays for the new rows; `begin` refills them from the new rows' pages."""
        if self._open:
            raise InputError("rebind between steps, not inside one")
        m = self.manager
        with m.lock:
            seqs = m.seqs.batch(seq_ids)
            if len(seqs) != len(self.seq_ids):
                raise InputError(f"this step serves {len(self.seq_ids)} rows; {len(seqs)} were given")
            for seq in seqs:
                self._check_between_steps(seq)
                if seq.lengths[0] >= self.max_tokens:
                    raise InputError(f"sequence {seq.id} already holds {seq.lengths[0]} tokens; "
                                     f"max_tokens is {self.max_tokens}")
        self.seq_ids = [seq.id for seq in seqs]
        self._versions = None  # other sequences' layouts: their versions say nothing about the tables
        self._mass_at = None

    # --- host, between steps --------------------------------------------------------------------

    def _check_between_steps(self, seq: Sequence) -> None:
        if len(set(seq.lengths)) != 1:
            raise InputError(f"sequence {seq.id} holds different numbers of tokens in its layers: "
                             "a static step starts between steps")
        if seq.lengths[0] < 1:
            raise InputError(f"sequence {seq.id} holds no token yet: prefill it first")

    def begin(self) -> None:
        """Make room for every row's next token and point the buffers at the pages."""
        if self._open:
            raise InputError("this step has begun already; end() it first")
        m, c = self.manager, self.manager.cfg
        s = c.page_size
        m.lock.acquire()
        try:
            seqs = m.seqs.batch(self.seq_ids)
            for seq in seqs:
                self._check_between_steps(seq)
                if seq.lengths[0] + 1 > self.max_tokens:
                    raise InputError(f"sequence {seq.id} would hold {seq.lengths[0] + 1} tokens; this step "
                                     f"was made for at most {self.max_tokens}")
            for seq in seqs:  # as an eager step's first layer: compaction, then the split's moves
                m.compactor.auto_compact(seq, 0)
                if self.split is not None:
                    self.split.settle(seq)
            if not m.writer.reserve(seqs, 0, [1] * len(seqs)):
                starting = sum(seq.lengths[0] // s >= len(seq.pages) for seq in seqs)
                raise OutOfPages(f"no free 16-bit page for the next token of {starting} rows: raise "
                                 "num_hot_pages or configure an evictor with a budget")
            for seq in seqs:  # pages back from lower tiers; split values stay in host memory
                m.residency.fetch_all(seq, values=self.split is None)
                if self.with_mass:
                    seq.grow_mass(self.pages * s)
            self._fill(seqs)
        except BaseException:
            m.lock.release()
            raise
        self._seqs = seqs
        self._ran: set[int] = set()  # layers whose split reads ran (reported should the step fail)
        self._open = True

    def _fill(self, seqs: list[Sequence]) -> None:
        bt = self.manager.block_tables
        self.rows.copy_(bt.token_rows(seqs, 0, [1] * len(seqs)))
        lays = [bt.layout(seq) for seq in seqs]
        n = [seq.lengths[0] + 1 for seq in seqs]  # every layer's tokens once this step has written
        tokens = [[bt.held(lay, name, k) for k, lay in zip(n, lays)] for name in self.names]
        self.lens.copy_(torch.tensor(tokens, dtype=torch.int32), non_blocking=True)
        if self.split is not None and self.want is not None:
            cold = tokens[self.names.index(SPLIT)]
            self.want.copy_(torch.tensor([self.split.rule.pages(t // self.manager.cfg.page_size) for t in cold],
                                         dtype=torch.int32), non_blocking=True)
        versions = tuple(lay.version for lay in lays)
        if versions != self._versions:
            for name in self.names:
                table = bt.batch_table(seqs, lays, name)  # [B, most pages of a row]
                self.tables[name].zero_()
                self.tables[name][:, : table.shape[1]].copy_(table)
                if self.with_mass:
                    pos = bt.batch_positions(seqs, name)  # [B, most pages * S], -1 past a row's
                    self.positions[name].fill_(-1)
                    self.positions[name][:, : pos.shape[1]].copy_(pos)
            self._versions = versions
        if self.with_mass:
            at = tuple((seq.mass_buf.data_ptr(), seq.mass_buf.stride(0), seq.mass_buf.stride(1),
                        seq.mass_buf.shape[-1]) for seq in seqs)
            if at != self._mass_at:
                esize = 4  # fp32
                table = torch.tensor([[(ptr + layer * stride0 * esize, head, cols) for ptr, stride0, head, cols in at]
                                      for layer in range(self.manager.cfg.num_layers)], dtype=torch.int64)
                self.mass_rows.copy_(table, non_blocking=True)
                self._mass_at = at

    def end(self) -> None:
        """Account for the step's tokens: lengths, and the pages that left the 16-bit window."""
        if not self._open:
            raise InputError("end() without begin()")
        m = self.manager
        try:
            for seq in self._seqs:  # what Sequence.written does once every layer has the token
                seq.lengths = [n + 1 for n in seq.lengths]
                seq.grow_mass(seq.lengths[0])
            if self.split is not None:
                self.split.record(self.reads, self.read_counts, self._seqs)
                # earlier steps' reads that reached the host, as events: host work while the
                # device runs this step (a replayed graph's work is queued by now)
                self.split.drain(wait=False)
            m.quantizer.quantize_ready(self._seqs)
        finally:
            self._open = False
            self._seqs = []
            m.lock.release()

    def abort(self) -> None:
        """Leave a step that did not finish (the forward pass failed): the lengths stay as they
        were; the values the split read in the layers that ran are reported all the same."""
        if self._open:
            try:
                if self.split is not None and self._ran:
                    ran = sorted(self._ran)
                    self.split.record(self.reads[ran], self.read_counts[ran], self._seqs)
            finally:
                self._open = False
                self._seqs = []
                self.manager.lock.release()

    def replayed(self) -> None:
        """A CUDA graph captured over this step's layers ran them all (its replay runs no Python)."""
        self._ran = set(range(self.manager.cfg.num_layers))

    def __enter__(self) -> StaticStep:
        self.begin()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.end()
        else:
            self.abort()

    # --- device, inside a step ------------------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every row's new token of one layer, k, v [B, H, D] in the cache's dtype."""
        self.manager.writer.write_tokens(layer, self.rows, k, v)

    def attend(self, layer: int, q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Decode attention of q [B, Hq, D] over what every row holds (this step's token included)."""
        m = self.manager
        s = m.cfg.page_size
        sets = [(m.pools[name].fields[layer], self.tables[name], min(self.max_tokens, self.width[name] * s))
                for name in self.names]
        if self.split is not None:
            return self._rotated(lambda q: self._attend_split(layer, q, sets, scale), q)
        into = None
        if self.with_mass:
            into = [(self.mass_rows[layer], self.positions[name]) for name in self.names]
        return self._rotated(lambda q: paged.decode(q, sets, self.lens, into, scale=scale), q)

    def _attend_split(self, layer: int, q: torch.Tensor, sets: list[tuple], scale: float | None) -> torch.Tensor:
        out, chosen, count = self.split.decode(q, sets, self.lens, self.names.index(SPLIT), self.k, self.want, scale,
                                              layer)
        self.reads[layer].copy_(chosen)
        self.read_counts[layer].copy_(count)
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):  # capturing runs nothing
            self._ran.add(layer)
        return out

    def _rotated(self, fn, q: torch.Tensor) -> torch.Tensor:
        r = self.manager.rotation
        return fn(q) if r is None else r.inverse(fn(r(q)))
