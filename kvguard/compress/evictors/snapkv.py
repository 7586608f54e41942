"""SnapKV (Li et al., 2024): after prefill, the last `observe` queries vote for the
keys they attend to; votes are max-pooled over neighbouring positions so that
whole phrases survive, and the top-scored keys plus the window are kept.

The votes of a prefill chunk are those of its last `observe` queries, as in the
paper, which compresses the prompt once. A cache that keeps decoding compacts
again whenever it passes its budget by a page; then the decode queries since the
previous compaction are the observation window, and the votes start from zero
after each compaction.
"""

from dataclasses import dataclass

import torch.nn.functional as F

from .base import Evictor


@dataclass
class SnapKV(Evictor):
    name = "snapkv"
    needs_mass = True
    fresh_votes = True
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
