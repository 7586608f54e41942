"""What every evictor is: a budget, protected sinks and recent window, and a score.

An evictor chooses which token positions of a sequence survive a compaction; the
cache then moves the survivors into fewer pages and frees the rest.

Evictors that score by attention mass choose per layer and KV head, as H2O and
SnapKV do: each (layer, head) keeps its own `budget` positions, the same number
for all, so the survivors still fill whole pages (slot j of a page then holds
position keep[layer, head, j]; keys carry their rotary position already, and a
compacted sequence needs no causal mask). With `per_head=False` they choose one
set for the sequence from the mass summed over layers and heads. Positional
evictors (StreamingLLM) choose one set, the same for every head.

Two options change what a mass-based evictor keeps (allocation.py has the first):

- `allocation`: `uniform` (the default, and the only one the cache stores: a page
  holds every layer and head, so all of them keep the same count), or `pyramid`,
  `adaptive`, `pyramid-adaptive`, `global`, which give layers and heads unequal
  shares of the same total; `keep_masks` applies them (the read-time simulation
  of kvguard/eval/headwise.py uses it).
- `scoring`: `mass` (the attention mass, as published) or `value_aware` (mass ×
  the value's L1 norm, as VATP, Guo et al., 2024: a key that is attended to but
  whose value is near zero adds little to the output). The cache passes each
  position's value norm when the evictor `needs_values`.

And one changes how: `granularity: page` drops, per layer and head, the whole
pages (page-aligned runs of `page_size` slots) with the least summed score first,
and single tokens only for what is left over. A compaction then moves every other
page's codes with their scales (kvguard/cache/compaction.py): no token is
requantized, where dropping single tokens makes some join another page's scales.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from .allocation import ALLOCATIONS, adaptive, pyramid

SCORINGS = ("mass", "value_aware")
GRANULARITIES = ("token", "page")

@dataclass
class Evictor(ABC):
    """Keeps `sink` first tokens, the `window` most recent, and the best-scored of the
    rest, `budget` tokens in all. Subclasses implement `score`."""

    name: ClassVar[str]
    # True when the evictor needs each key's attention mass from `attend`.
    needs_mass: ClassVar[bool] = False
    # True when the mass is votes of the queries since the last compaction, not a running total.
    fresh_votes: ClassVar[bool] = False

    budget: int = 256
    sink: int = 4
    window: int = 64
    per_head: bool = True  # mass-based evictors: a keep set per layer and KV head
    allocation: str = "uniform"  # how the total is split over layers and heads (allocation.py)
    scoring: str = "mass"  # "value_aware": mass × the value's L1 norm
    granularity: str = "token"  # "page": whole pages of a head dropped first (no requantization)

    def __post_init__(self) -> None:
        if not isinstance(self.per_head, bool):
            raise ValueError(f"{self.name}: per_head must be true or false, got {self.per_head!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"{self.name}: allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"{self.name}: scoring must be one of {', '.join(SCORINGS)}, got {self.scoring!r}")
        if not self.needs_mass and (self.allocation != "uniform" or self.scoring != "mass"):
            raise ValueError(f"{self.name}: allocation and scoring are options of the evictors that score by "
                             "attention mass (h2o, snapkv)")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{self.name}: granularity must be one of {', '.join(GRANULARITIES)}, "
                             f"got {self.granularity!r}")
        if self.granularity != "token" and not (self.needs_mass and self.per_head):
            raise ValueError(f"{self.name}: granularity page drops each head's pages by their attention mass: "
                             "an option of h2o and snapkv with per_head: true")
        if not self.per_head and self.allocation != "uniform":
            raise ValueError(f"{self.name}: allocation {self.allocation} splits the budget over layers and heads;"
                             " it needs per_head: true")
        for field in ("budget", "sink", "window"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{self.name}: {field} must be a non-negative integer, got {value!r}")
        if self.budget < self.sink + self.window or self.budget == 0:
            raise ValueError(
                f"{self.name}: budget {self.budget} is smaller than sink {self.sink} + window {self.window};"
                " raise the budget or shrink the window"
            )

    @abstractmethod
    def score(self, length: int, mass: torch.Tensor) -> torch.Tensor:
        """Scores [..., length] of every position (higher stays), from `mass`
        [..., length], the attention mass accumulated per position (per layer and KV
        head in the cache; zeros when the evictor does not need it). A positional
        evictor returns one row [length]."""
        ...

    @property
    def needs_values(self) -> bool:
        """True when `select` needs each position's value norm."""
        return self.scoring == "value_aware"

    def _weighted(self, length: int, mass: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        mass = mass[..., :length].float()
        if self.needs_values:
            if values is None:
                raise ValueError(f"{self.name}: value_aware scoring needs the values' norms")
            mass = mass * values[..., :length].float().to(mass.device)
        return mass

    def select(self, length: int, mass: torch.Tensor, values: torch.Tensor | None = None,
               page_size: int = 16) -> torch.Tensor | None:
        """Positions to keep, sorted along the last dimension: [budget] for one set, or
        [..., budget] (mass's leading dimensions) per layer and head. None when the
        sequence is within budget. `values`: each position's value L1 norm, shaped as
        `mass` (value_aware scoring only). `page_size`: the slots of a page (granularity
        page). The uniform allocation only: the others keep unequal counts (`keep_mask`)."""
        if self.allocation != "uniform":
            raise ValueError(f"{self.name}: allocation {self.allocation} keeps unequal counts per layer and "
                             "head, which the cache does not store; use keep_mask (read-time simulation)")
        if length <= self.budget:
            return None
        mass = self._weighted(length, mass, values)
        if self.needs_mass and not self.per_head:
            mass = mass.reshape(-1, length).sum(0)
        middle = self.budget - self.sink - self.window
        parts = [torch.arange(self.sink)]
        if middle > 0:
            scores = self.score(length, mass)[..., self.sink : length - self.window].cpu()
            if self.granularity == "page":
                parts.append(self._whole_pages_first(scores, middle, page_size) + self.sink)
            else:
                parts.append(torch.topk(scores, middle, dim=-1, sorted=False).indices + self.sink)
        parts.append(torch.arange(length - self.window, length))
        lead = parts[1].shape[:-1] if middle > 0 else ()
        return torch.cat([p.expand(*lead, p.shape[-1]) for p in parts], dim=-1).sort(dim=-1).values

    def _whole_pages_first(self, scores: torch.Tensor, middle: int, page: int) -> torch.Tensor:
        """Of scores [..., C] (slots sink .. sink + C - 1), the `middle` kept, [..., middle]: the
        whole pages (slots p * page .. p * page + page - 1 all among them) with the least summed
        score dropped first, as many as fit what must go, then the lowest single slots."""
        c = scores.shape[-1]
        drop = c - middle
        first = -self.sink % page  # the first whole page's offset among the slots
        full = max(0, (c - first) // page)
        whole = min(drop // page, full)
        rows = scores.reshape(-1, c).float()
        kept = torch.ones_like(rows, dtype=torch.bool)
        if whole:
            sums = rows[:, first:first + full * page].reshape(-1, full, page).sum(-1)
            gone = torch.topk(sums, whole, dim=-1, largest=False, sorted=False).indices  # [rows, whole]
            cols = (first + gone[..., None] * page + torch.arange(page)).flatten(1)
            kept.scatter_(1, cols, False)
        rest = drop - whole * page
        if rest:
            low = torch.topk(rows.masked_fill(~kept, float("inf")), rest, dim=-1, largest=False, sorted=False)
            kept.scatter_(1, low.indices, False)
        return kept.nonzero()[:, 1].reshape(*scores.shape[:-1], middle)

    def keep_mask(self, length: int, mass: torch.Tensor, layer: int, num_layers: int,
                  values: torch.Tensor | None = None) -> torch.Tensor:
        """Which of `length` positions each KV head of layer `layer` (of `num_layers`) keeps,
        bool [H, length], from its mass [H, length] (and value norms for value_aware), with
        this evictor's allocation. The heads of all layers together keep what `select`'s
        uniform budget keeps in total (fewer only where a layer is shorter than its share)."""
        h = mass.shape[0]
        if length <= self.budget:
            return torch.ones(h, length, dtype=torch.bool)
        if self.allocation == "global":
            raise ValueError(f"{self.name}: the global allocation chooses for every layer at once: use keep_masks")
        if self.allocation == "uniform":
            keep = torch.zeros(h, length, dtype=torch.bool)
            return keep.scatter_(1, self.select(length, mass, values).cpu(), True)
        scores = self._middle_scores(length, mass, values)  # [H, candidates]
        middle = self.budget - self.sink - self.window
        if self.allocation.startswith("pyramid"):
            middle = pyramid(middle, num_layers, scores.shape[-1])[layer]
        counts = adaptive(scores, h * middle).tolist() if self.allocation.endswith("adaptive") else [middle] * h
        return self._keep_top(length, scores, counts)

    def keep_masks(self, length: int, mass: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
        """`keep_mask` for every layer at once, bool [layers, H, length] from mass [layers, H,
        length]: what the global allocation needs (the others choose layer by layer)."""
        layers, h = mass.shape[:2]
        if self.allocation != "global" or length <= self.budget:
            return torch.stack([self.keep_mask(length, mass[i], i, layers, None if values is None else values[i])
                                for i in range(layers)])
        scores = self._middle_scores(length, mass, values)  # [layers, H, candidates]
        counts = adaptive(scores.flatten(0, 1), layers * h * (self.budget - self.sink - self.window))
        return self._keep_top(length, scores.flatten(0, 1), counts.tolist()).reshape(layers, h, length)

    def _middle_scores(self, length: int, mass: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """The scores of the positions between the sinks and the window, on the CPU."""
        return self.score(length, self._weighted(length, mass, values))[..., self.sink : length - self.window].cpu()

    def _keep_top(self, length: int, scores: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of `scores` [N, candidates] keeping the sinks, the window and their top counts[i]."""
        keep = torch.zeros(scores.shape[0], length, dtype=torch.bool)
        keep[:, : self.sink] = True
        keep[:, length - self.window :] = True
        for row, count in enumerate(counts):
            if count:
                keep[row, self.sink + torch.topk(scores[row], count, sorted=False).indices] = True
        return keep
