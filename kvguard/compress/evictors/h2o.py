"""H2O (Zhang et al., 2023): keep the heavy hitters, the keys with the largest
attention mass accumulated over every query so far, plus the recent window."""

from dataclasses import dataclass

from .base import Evictor


@dataclass
class H2O(Evictor):
    name = "h2o"
    needs_mass = True

    def score(self, length, mass):
        return mass[..., :length]
