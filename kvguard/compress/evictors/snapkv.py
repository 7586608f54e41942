"""SnapKV (Li et al., 2024): after prefill, the last `observe` queries vote for the
keys they attend to; votes are max-pooled over neighbouring positions so that
whole phrases survive, and the top-scored keys plus the window are kept.

The cache accumulates the votes only from the prefill's observation window
(`mass_queries` = observe); positions written after the prefill score zero, so
later compactions drop the oldest of them first.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Evictor


@dataclass
class SnapKV(Evictor):
    name = "snapkv"
    needs_mass = True
    observe: int = 32
    pool: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.observe < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError("snapkv: observe must be >= 1 and pool an odd number >= 1")

    def score(self, length, mass):
        m = mass[..., :length].float()
        pooled = F.max_pool1d(m.reshape(-1, 1, length), self.pool, stride=1, padding=self.pool // 2)
        return pooled.reshape(m.shape)
