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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


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

    def __post_init__(self) -> None:
        if not isinstance(self.per_head, bool):
            raise ValueError(f"{self.name}: per_head must be true or false, got {self.per_head!r}")
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

    def select(self, length: int, mass: torch.Tensor) -> torch.Tensor | None:
        """Positions to keep, sorted along the last dimension: [budget] for one set, or
        [..., budget] (mass's leading dimensions) per layer and head. None when the
        sequence is within budget."""
        if length <= self.budget:
            return None
        mass = mass[..., :length].float()
        if self.needs_mass and not self.per_head:
            mass = mass.reshape(-1, length).sum(0)
        middle = self.budget - self.sink - self.window
        parts = [torch.arange(self.sink)]
        if middle > 0:
            scores = self.score(length, mass)[..., self.sink : length - self.window]
            parts.append(torch.topk(scores.cpu(), middle, dim=-1, sorted=False).indices + self.sink)
        parts.append(torch.arange(length - self.window, length))
        lead = parts[1].shape[:-1] if middle > 0 else ()
        return torch.cat([p.expand(*lead, p.shape[-1]) for p in parts], dim=-1).sort(dim=-1).values
