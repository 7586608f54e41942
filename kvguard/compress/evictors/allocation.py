"""How an evictor's total budget is split across layers and KV heads.

The budget of the tokens between the protected sinks and recent window (the
"middle") can be split three ways; the total kept over all layers and heads is
always budget × layers × heads:

- `uniform`: every layer and head keeps the same number (what the cache stores).
- `pyramid` (PyramidKV, Cai et al., 2024): more tokens in lower layers, whose
  attention is spread wide, fewer in upper layers, whose attention concentrates.
  The middle budgets fall linearly with depth, from 2m − m/β in the first layer
  to m/β in the last (m the uniform middle, β = 20 as in the paper); they sum to
  layers × m.
- `adaptive` (Ada-KV, Feng et al., 2024): the layer's heads together keep
  heads × m middle tokens, chosen as the top of all heads' scores at once, so a
  head whose mass is spread wide gets more than one whose mass sits on a few
  keys; each head keeps at least a safeguard share (α = 0.2, as in the paper)
  of the even split.
- `pyramid-adaptive`: the pyramid's budget for the layer, split as `adaptive`.
- `global`: Ada-KV's selection over every layer and head of the model at once
  (layers × heads × m middle tokens, the same safeguard per head), so a layer
  whose attention leaves the sinks and window more also keeps more. Every head's
  mass sums to the same number of queries, so the scores compare across layers
  as they do across heads. Not in the papers above: an extension of Ada-KV's
  argument (the output error is bounded by the attention mass evicted) from one
  layer to all.
"""

from __future__ import annotations

import torch

ALLOCATIONS = ("uniform", "pyramid", "adaptive", "pyramid-adaptive", "global")
PYRAMID_BETA = 20
SAFEGUARD = 0.2


def pyramid(middle: int, num_layers: int, cap: int) -> list[int]:
    """Per-layer middle budgets: non-increasing with depth, each within [0, cap], summing to
    num_layers × middle (middle <= cap). The linear targets are rounded by largest remainder;
    what a layer cannot take (cap) goes to the next layers up."""
    if not 0 <= middle <= cap:
        raise ValueError(f"middle budget {middle} must be within 0..{cap}")
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    total = middle * num_layers
    if num_layers == 1:
        return [middle]
    low = middle / PYRAMID_BETA
    high = 2 * middle - low
    targets = [high - (high - low) * i / (num_layers - 1) for i in range(num_layers)]
    counts = [int(t) for t in targets]
    # largest remainders first; among equals the lower layer (keeps the counts non-increasing)
    order = sorted(range(num_layers), key=lambda i: (-(targets[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    excess = sum(max(c - cap, 0) for c in counts)
    counts = [min(c, cap) for c in counts]
    for i in range(num_layers):  # the capped layers are the lowest: fill upwards, keeping the order
        take = min(excess, cap - counts[i])
        counts[i] += take
        excess -= take
    return counts


def adaptive(scores: torch.Tensor, total: int, safeguard: float = SAFEGUARD) -> torch.Tensor:
    """Per-head counts [H] summing to `total` from the candidates' scores [H, n] (total <= H × n):
    each head first gets its top floor(safeguard × total / H), then the rest of the budget
    goes to the best remaining scores of all heads together (ties: the lower head, then the
    earlier position)."""
    h, n = scores.shape
    if not 0 <= total <= h * n:
        raise ValueError(f"a total of {total} does not fit {h} heads of {n} candidates")
    floor = min(int(safeguard * total / h), n)
    ranked = scores.float().sort(dim=-1, descending=True, stable=True).values[:, floor:]  # [H, n - floor]
    rest = total - floor * h
    counts = torch.full((h,), floor, dtype=torch.long)
    if rest > 0:
        flat = ranked.flatten()
        # a stable descending sort of the flattened scores: ties resolved by head, then rank
        chosen = flat.sort(descending=True, stable=True).indices[:rest]
        counts += torch.bincount(chosen // ranked.shape[1], minlength=h)
    return counts
