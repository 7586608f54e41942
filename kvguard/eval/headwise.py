"""Per-(layer, KV head) eviction, simulated at read time.

The cross-check of the cache's own per-head compaction (H2O and SnapKV keep a
set of tokens per layer and KV head, kvguard/compress/evictors/base.py): this
cache holds every token and, after the prefix, lets each layer's KV head read
only the prefix tokens its own attention mass would keep (the same evictor's
`select`, run per head), plus every later token. It frees nothing, like sparse;
its read ratio is the share of visible keys a head reads. Its perplexity should
match the `-prefix` methods', which evict for real.

It is also the only place where the unequal budgets of the evictors' `allocation`
option (pyramid, adaptive: kvguard/compress/evictors/allocation.py) run: the
cache's pages hold every layer and KV head, so its compaction keeps the same
count in all of them. Value-aware scoring reads each position's value norm from
the pages, as the cache's compaction does.

With `merge` (an experiment: D2O / CaM's idea, not what the cache stores) the tokens a head
evicts are not simply dropped: each is merged into the kept token of that head whose key is most
like its own (cosine), whose value becomes the mass-weighted mean of its own and its merged
tokens' values (mass: the attention each received in the prefix).
"""

from __future__ import annotations

import math

import torch

from ..compress.evictors import make_evictor
from .probe import ProbeCache


class HeadwiseCache(ProbeCache):
    def __init__(self, config, subject, *, evictor: dict, merge: bool = False, **options):
        super().__init__(config, subject, **options)
        self.merge = merge
        self.merged: dict[int, torch.Tensor] = {}  # layer -> [H, prefix, D] the prefix's values, merged
        self.evictor = make_evictor(evictor["name"], **{k: v for k, v in evictor.items() if k != "name"})
        self.mass: dict[int, torch.Tensor] = {}  # layer -> [H, prefix] attention mass seen in the prefix
        self.values: dict[int, torch.Tensor] = {}  # layer -> [H, prefix] each value's L1 norm (value_aware)
        self.keep: dict[int, torch.Tensor] = {}  # layer -> [H, prefix] bool

    def _evicts(self, layer: int) -> bool:
        """Evictors act on the global layers; a sliding-window layer keeps its window (Gemma 3)."""
        return self.windows is None or self.windows[layer] is None

    def _keep(self, layer: int) -> torch.Tensor:
        if layer not in self.keep:
            # every layer's prefix has been read by now: choose for all of them at once (the
            # global allocation compares layers)
            layers = [i for i in range(self.shape["num_layers"]) if self._evicts(i)]
            mass = torch.stack([self.mass[i] for i in layers])
            values = torch.stack([self.values[i] for i in layers]) if self.values else None
            keep = self.evictor.keep_masks(mass.shape[-1], mass, values).to(mass.device)
            self.keep = dict(zip(layers, keep))
        return self.keep[layer]

    def _attend_row(self, seq, layer, q, scale):
        if not self._evicts(layer):  # a window layer: the cache's own read of what it holds of its window
            if self.scoring:
                self.read.append(1.0)
            return super()._attend_row(seq, layer, q, scale)
        k, v = self._manager.kv(seq, layer, dtype=torch.float32)  # [H, L, D]
        h, length, d = k.shape
        t, g = q.shape[0], q.shape[1] // h
        qf = q.float().reshape(t, h, g, d).permute(1, 2, 0, 3)  # [H, g, T, D]
        scores = torch.einsum("hgtd,hld->hgtl", qf, k) * (1.0 / math.sqrt(d) if scale is None else scale)
        causal = torch.arange(length)[None, :] <= torch.arange(length - t, length)[:, None]  # [T, L]
        allowed = causal.expand(h, g, t, length)
        if layer in self.mass or self.scoring:  # after the prefix: each head reads what it keeps
            keep = self._keep(layer)
            if self.merge:
                v = self._merged(layer, k, v, keep)
            allowed = allowed.clone()
            allowed[..., : keep.shape[1]] &= keep[:, None, None, :]
            if self.scoring:
                self.read.append(allowed.sum().item() / (causal.sum().item() * h * g))
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        if layer not in self.mass:  # the prefix: what each KV head attended to
            observe = getattr(self.evictor, "observe", t) if self.evictor.needs_mass else t
            self.mass[layer] = probs[:, :, -min(observe, t):].sum(dim=(1, 2))  # [H, L]
            if self.evictor.needs_values:
                self.values[layer] = v.abs().sum(-1)  # [H, L]
        out = torch.einsum("hgtl,hld->hgtd", probs, v).permute(2, 0, 1, 3).reshape(t, h * g, d)
        return out.to(q.dtype)

    def _merged(self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """v [H, L, D] with each head's prefix values merged (merge_values), once a layer."""
        n = keep.shape[1]
        if layer not in self.merged:
            self.merged[layer] = merge_values(k[:, :n], v[:, :n], self.mass[layer], keep)
        out = v.clone()
        out[:, :n] = self.merged[layer].to(v.dtype)
        return out


def merge_values(k: torch.Tensor, v: torch.Tensor, mass: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per head, each evicted token's value merged into the kept token whose key is most like its
    own (cosine): a kept token's value becomes the mean of its own and its merged tokens' values,
    weighted by their mass. k, v [H, L, D]; mass [H, L]; keep [H, L] bool (some kept in each
    head). Returns v' [H, L, D] fp32 (the evicted tokens' rows as they were: nothing reads them)."""
    n = keep.shape[1]
    kf, vf, w = k.float(), v.float(), mass.float().clamp_min(1e-12)
    unit = torch.nn.functional.normalize(kf, dim=-1)
    sim = (unit @ unit.transpose(1, 2)).masked_fill(~keep[:, None, :], -2.0)  # [H, from, to]: only kept targets
    to = torch.where(keep, torch.arange(n, device=k.device), sim.argmax(-1))  # [H, L]: a kept token, itself
    num = torch.zeros_like(vf).scatter_add_(1, to[..., None].expand_as(vf), w[..., None] * vf)
    den = torch.zeros_like(w).scatter_add_(1, to, w)
    return torch.where(keep[..., None], num / den.clamp_min(1e-12)[..., None], vf)
