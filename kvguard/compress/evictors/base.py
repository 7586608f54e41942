"""What every evictor is: a budget, protected sinks and recent window, and a score.

An evictor chooses which token positions of a sequence survive a compaction; the
cache then moves the survivors into fewer pages and frees the rest. The keep set
is one for all layers and heads, because a page holds every layer's K and V.
"""

from __future__ import annotations

from dataclasses import dataclass
from abc import ABC, abstractmethod
from typing import ClassVar

import torch


@dataclass
class Evictor(ABC):
    """Keeps `sink` first tokens, the `window` most recent, and the best-scored of the
    rest, `budget` tokens in all. Subclasses implement `score`."""

    name: ClassVar[str]
    # True when the evictor needs each key's attention mass from `attend`.
    needs_mass: ClassVar[bool] = False

    budget: int = 256
    sink: int = 4
    window: int = 64

    def __post_init__(self) -> None:
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
        """Scores [length] of every position; higher stays. `mass` is the accumulated
        attention mass per position (zeros when the evictor does not need it)."""
        ...

    def select(self, length: int, mass: torch.Tensor) -> torch.Tensor | None:
        """Sorted positions to keep, or None when the sequence is within budget."""
        if length <= self.budget:
            return None
        middle = self.budget - self.sink - self.window
        idx = [torch.arange(self.sink)]
        if middle > 0:
            scores = self.score(length, mass)[self.sink : length - self.window]
            top = torch.topk(scores.float().cpu(), middle, sorted=False).indices + self.sink
            idx.append(top)
        idx.append(torch.arange(length - self.window, length))
        return torch.cat(idx).sort().values
