"""StreamingLLM (Xiao et al., 2023): attention sinks plus a recent window; nothing in between."""

from dataclasses import dataclass

import torch

from .base import Evictor


@dataclass
class StreamingLLM(Evictor):
    name = "streamingllm"

    def __post_init__(self) -> None:
        super().__post_init__()
        # Nothing between sinks and window survives, so the window takes the rest of the budget.
        self.window = self.budget - self.sink

    def score(self, length, mass):
        return torch.zeros(length)
