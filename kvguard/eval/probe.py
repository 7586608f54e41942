"""A KVGuardCache that also measures what compression does to attention.

Beside the compressed pages it keeps a shadow copy of every K/V it was given, in
the cache's 16-bit dtype and never compressed or evicted. While `scoring` is on,
each layer's attention output over the pages, O', is compared with the output
over the shadow, O, for the same queries: the squared error and the squared norm
are summed per layer, so deviation_l = ||O' - O||_F / ||O||_F over every scored
query, head and channel. The model goes on with O' (the compressed model).
"""

from __future__ import annotations

import torch

from ..cache.attention import dense_attention
from ..hf import KVGuardCache
from .sparse import quest_attention


class ProbeCache(KVGuardCache):
    batched_decode = False  # decode steps go through _attend_row, which the sparse and head-wise probes replace

    def __init__(self, config, subject, *, sparse_pages: int | None = None, measure: bool = True, **options):
        super().__init__(config, subject, **options)
        self.sparse_pages = sparse_pages
        self.measure = measure  # False: no shadow, only the sparse selector (for timing runs)
        self.scoring = False
        layers = self.shape["num_layers"]
        self.shadow: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self.err2 = torch.zeros(layers, dtype=torch.float64)
        self.ref2 = torch.zeros(layers, dtype=torch.float64)
        self.read: list[float] = []  # sparse: fraction of visible keys read, per call

    def attend(self, layer, query, key, value, padding, scale):
        if query.shape[0] != 1:
            raise ValueError("the probe measures one sequence at a time")
        out = super().attend(layer, query, key, value, padding, scale)  # [1, T, Hq, D]
        if not self.measure:
            return out
        dtype = self._manager.cfg.dtype
        k, v = key[0].to(dtype), value[0].to(dtype)  # [H, T, D]
        if self.shadow[layer] is not None:
            k, v = torch.cat([self.shadow[layer][0], k], 1), torch.cat([self.shadow[layer][1], v], 1)
        self.shadow[layer] = (k, v)
        if self.scoring:
            # the reference reads what the model attends to: a sliding-window layer, its window
            ref, _ = dense_attention(query[0].transpose(0, 1), k, v, scale=scale, window=self.window(layer))
            self.err2[layer] += (out[0].double() - ref.double()).pow(2).sum()
            self.ref2[layer] += ref.double().pow(2).sum()
        return out

    def _attend_row(self, seq, layer, q, scale):
        if not self.sparse_pages:
            out = super()._attend_row(seq, layer, q, scale)
            split = self._manager.split
            if split is not None and self.scoring:  # the K/V split: the fraction of values it read
                self.read.append(split.last_read)
            return out
        k, v = self._manager.kv(seq, layer, dtype=torch.float32)
        out, read = quest_attention(q, k, v, page_size=self._manager.cfg.page_size, top_k=self.sparse_pages,
                                    scale=scale)
        if self.scoring:
            self.read.append(read)
        return out

    def deviation(self) -> list[float]:
        """Per layer: ||O' - O|| / ||O|| over everything scored so far."""
        return (self.err2.sqrt() / self.ref2.sqrt().clamp_min(1e-30)).tolist()
