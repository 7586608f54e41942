"""Block tables: where each sequence's tokens are, per pool, as the kernels take them.

A sequence's `Layout` (its page indices per pool, those pools' page ids on the host and the
device) is derived from its page list and rebuilt only after the list changes. From it come the
arguments of a step: the rows its new tokens go to (`token_rows`), each pool's block table of a
batch (`batch_table`), the tokens each row holds there (`held`), the positions of those tokens
(`positions`, `batch_positions`), and the decode kernels' arguments made of them
(`decode_sets`, `decode_args`). What a step's layers share is copied to the device once and kept
while the rows' pages hold, so a decode step costs no walk over the pages.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import torch

from .config import CacheConfig
from .pool import PagePool, device_index
from .sequence import Layout, Sequence


class BlockTables:
    def __init__(self, cfg: CacheConfig, pools: dict[str, PagePool]):
        self.cfg = cfg
        self.pools = pools
        self._tables: OrderedDict[tuple, tuple] = OrderedDict()  # see while_pages_hold
        self._ints: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # see device_ints

    def layout(self, seq: Sequence) -> Layout:
        """The sequence's pages per pool, rebuilt only when its page list changed."""
        lay = seq.layout
        if lay is not None and lay.version == seq.pages.version:
            return lay
        idx: dict[str, list[int]] = {name: [] for name in self.pools}
        away = 0
        for i, r in enumerate(seq.pages):
            if r.where in idx:
                idx[r.where].append(i)
            else:
                away += 1
        host, tables = {}, {}
        if self.cfg.use_kernels:
            for name, ix in idx.items():
                if ix:
                    host[name] = torch.tensor([int(seq.pages[i].page) for i in ix], dtype=torch.int32)
                    tables[name] = host[name].view(1, -1).to(self.cfg.device, non_blocking=True)
        seq.layout = Layout(seq.pages.version, idx, host, tables, away)
        return seq.layout

    def token_rows(self, seqs: list[Sequence], layer: int, counts: list[int]) -> torch.Tensor:
        """Where the next counts[i] tokens of seqs[i] go in the 16-bit pool viewed as
        [P * H * S, D]: rows (page * H + head) * S + slot, sequence by sequence, token by token,
        head by head; the same for every layer of a step or prompt, so copied to the device once."""
        s, h = self.cfg.page_size, self.cfg.num_kv_heads
        at = tuple((seq.id, seq.pages.version, seq.lengths[layer], n) for seq, n in zip(seqs, counts))

        def rows():
            out = []
            for seq, (_, _, start, n) in zip(seqs, at):
                for pos in range(start, start + n):
                    base = int(seq.pages[pos // s].page) * h * s + pos % s
                    out.extend(base + i * s for i in range(h))
            return out

        return self.device_ints(("rows", at), rows)

    def positions(self, seq: Sequence, name: str) -> torch.Tensor:
        """Positions of a pool's tokens in the kernels' order (ascending): token j of the pool is
        position idx[j // S] * S + j % S. Kept with the layout."""
        lay, s = self.layout(seq), self.cfg.page_size
        pos = lay.positions.get(name)
        if pos is None:
            dev = self.cfg.device
            pos = lay.positions[name] = (device_index(lay.idx[name], dev).unsqueeze(1) * s
                                         + torch.arange(s, device=dev)).flatten()
        return pos

    def held(self, lay: Layout, name: str, n: int) -> int:
        """How many of a sequence's first n positions one pool holds."""
        s = self.cfg.page_size
        need = -(-n // s)  # pages the n positions fill
        idx = lay.idx[name]
        count = bisect.bisect_left(idx, need)
        partial = need * s - n if count and idx[count - 1] == need - 1 else 0  # only the last page
        return count * s - partial

    def batch_table(self, seqs: list[Sequence], lays: list[Layout], name: str) -> torch.Tensor:
        """[B, most pages] int32 block table of several sequences in one pool, zero-padded."""
        def build():
            empty = torch.zeros(0, dtype=torch.int32)
            rows = torch.nn.utils.rnn.pad_sequence([lay.host.get(name, empty) for lay in lays], batch_first=True)
            return rows.to(self.cfg.device, non_blocking=True)

        return self.while_pages_hold(("table", name, tuple(seq.id for seq in seqs)), lays, build)

    def batch_positions(self, seqs: list[Sequence], name: str, pad: int = -1) -> torch.Tensor:
        """[B, most pages * S] positions of several sequences' tokens in one pool, in the order
        of batch_table's rows (ascending), padded with `pad`: -1 for the mass kernels, which
        skip it, or a position past any query's for searchsorted."""
        lays = [self.layout(seq) for seq in seqs]

        def build():
            empty = torch.zeros(0, dtype=torch.long, device=self.cfg.device)
            rows = [self.positions(seq, name) if lay.idx[name] else empty for seq, lay in zip(seqs, lays)]
            return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)

        return self.while_pages_hold(("positions", name, pad, tuple(seq.id for seq in seqs)), lays, build)

    def query_limits(self, seqs: list[Sequence], lays: list[Layout], name: str, at: torch.Tensor,
                     key: tuple) -> torch.Tensor:
        """[B, T] int32: how many of each row's tokens in one pool each query at positions `at`
        [B, T] sees (those at or before it); `key` names the queries, the same for every layer
        of a chunk, so the limits are kept while the rows' pages hold."""
        return self.while_pages_hold(
            ("limits", name, *key, tuple(seq.id for seq in seqs)), lays,
            lambda: torch.searchsorted(self.batch_positions(seqs, name, pad=2**62), at, right=True).to(torch.int32))

    def decode_sets(self, seqs: list[Sequence], layer: int):
        """paged.decode's sets for one layer: (fields, block table [B, *], tokens per row) per pool
        holding some of the rows' tokens, and (pool, tokens per row) of each. A row's table holds
        all its pages of the pool in order; only the first `tokens` are read (a page past this
        layer's tokens is another layer's new one)."""
        lays = [self.layout(seq) for seq in seqs]
        sets, used = [], []
        for name in self.pools:
            tokens = [self.held(lay, name, seq.lengths[layer]) for seq, lay in zip(seqs, lays)]
            if any(tokens):
                table = lays[0].tables[name] if len(seqs) == 1 else self.batch_table(seqs, lays, name)
                sets.append((self.pools[name].fields[layer], table, tokens))
                used.append((name, tokens))
        return sets, used

    def decode_args(self, seqs: list[Sequence], layer: int, with_mass: bool):
        """paged.decode's sets, lens and mass_into for one layer of a batch step."""
        sets, used = self.decode_sets(seqs, layer)
        tokens = tuple(tuple(t) for _, t in used)
        lens = self.device_ints(("lens", tokens), lambda: tokens, torch.int32)  # [sets, B]
        into = None
        if with_mass:  # the kernels add each key's mass into the row's totals at the key's position
            buffers = [seq.mass_buf[layer] for seq in seqs]
            into = [(buffers, self.positions(seqs[0], name)[None] if len(seqs) == 1
                     else self.batch_positions(seqs, name)) for name, _ in used]
        return sets, lens, into

    def while_pages_hold(self, key: tuple, lays: list[Layout], build) -> torch.Tensor:
        """build(), kept under key while no row's pages change (the same for every layer of a
        step, and for the steps until a row's next page): an LRU of the last few batches'."""
        versions = tuple(lay.version for lay in lays)
        hit = self._tables.get(key)
        if hit is not None and hit[0] == versions:
            self._tables.move_to_end(key)
            return hit[1]
        value = build()
        self._tables[key] = (versions, value)
        while len(self._tables) > 32:
            self._tables.popitem(last=False)
        return value

    def device_ints(self, key: tuple, values, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host ints (`values()`) as a tensor on the cache's device, kept under `key` for the
        other layers of the step, which ask for the same ones (the rows a step writes, the
        tokens it reads): one host-to-device copy a step, not one a layer. An LRU of the last
        few; the tensors are only read."""
        hit = self._ints.get(key)
        if hit is not None and hit.dtype == dtype:
            self._ints.move_to_end(key)
            return hit
        t = self._ints[key] = device_index(values(), self.cfg.device, dtype)
        while len(self._ints) > 64:
            self._ints.popitem(last=False)
        return t
