"""A model's linear layers on the CPU through oneDNN, their weights reordered once (serve-llm's CPU path).

A decode step of a small model on the CPU is bound by reading its weights once: `F.linear` reads
them in PyTorch's plain layout; oneDNN's matmul over weights reordered once into its own blocked
layout (`mkldnn::_reorder_linear_weight`, what torch's compiler does to frozen CPU graphs) reads
the same fp32 weights about 1.5 times as fast for a decode batch, with the same arithmetic up to
the order of its sums. `pack_linears` swaps each `nn.Linear` of a model for a `PackedLinear`
that keeps the original weight (tied embeddings, state dicts and autograd still see it) beside
the reordered copy it multiplies with; where this PyTorch or CPU cannot reorder the weight's
dtype (16-bit weights need AVX-512 or AVX-NE-CONVERT), nothing is swapped. `default_dtype` is
serve-llm's on the CPU: bfloat16 where the CPU multiplies it natively.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

_log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward through oneDNN over a reordered copy of its weight; with autograd
    on for a parameter that needs it, the plain `F.linear`."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = packed

    @classmethod
    def of(cls, linear: nn.Linear, rows: int) -> PackedLinear | None:
        """The packed layer, or None where oneDNN cannot reorder this weight here (its error is
        logged once by pack_linears) or its product disagrees with F.linear's on a probe."""
        w = linear.weight.detach()
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            probe = torch.randn(2, w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except (RuntimeError, AttributeError) as e:
            _log.info("kvguard: linear layers stay unpacked (%s)", str(e).splitlines()[0][:200])
            return None
        want = F.linear(probe, w)
        if not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()) + 1e-6):
            _log.warning("kvguard: oneDNN's packed product differs from F.linear's; linear layers stay unpacked")
            return None
        return cls(linear, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, rows: int = 8) -> int:
    """Swap every CPU `nn.Linear` of `model` for a PackedLinear, its weight reordered for
    batches of about `rows` rows (a decode step's; others run too, a little slower). Returns how
    many were swapped: 0 when oneDNN is missing or cannot reorder the model's dtype here."""
    if not torch.backends.mkldnn.is_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.device.type == "cpu"]
    done = 0
    for parent, name, child in swaps:
        packed = PackedLinear.of(child, rows)
        if packed is None:
            break
        setattr(parent, name, packed)
        done += 1
    return done


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags as Linux lists them; empty elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def default_dtype(flags: set[str] | None = None) -> torch.dtype:
    """A model's dtype on this CPU when none is asked for: bfloat16 where the CPU multiplies it
    natively (AVX512-BF16 or AMX-BF16), whose products read half the bytes of float32's (serve-llm
    on SmolLM2, 2 vCPUs with AVX512-BF16: 117-130 output tokens/s against 108-112); float32
    elsewhere, where bfloat16 products are emulated and slower."""
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if flags & {"avx512_bf16", "amx_bf16"} else torch.float32
