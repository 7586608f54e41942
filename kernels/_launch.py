"""Launching a kernel again without Triton's per-call binding.

A decode step launches the same few kernels once per layer with arguments that differ only in
their values. Triton's launch (`kernel[grid](*args, **constexprs)`) binds and specializes
every argument, looks the compiled kernel up and builds launch metadata on every call: on an
H200's host ~26 µs for the decode kernel's 40 arguments, of which the launch itself is ~8 µs
(`benchmarks/cache/gpu_cache_bench.py --launch` times a decode call both ways). `launch` keeps the
compiled kernel of each kind of call and launches it directly.

A kind of call is the kernel, its compile-time arguments and the class Triton 3.6
specializes each runtime argument by (`_arg_class`): a tensor by dtype and 16-byte alignment,
an int by being 1, a multiple of 16, and fitting in 32 bits; floats and bools are not
specialized. The first call of a kind goes through Triton (which compiles when it must); the
compiled kernel it returns serves the later calls of that kind. Under the interpreter, with
launch hooks installed (a profiler), or with another Triton, every call takes Triton's path.
"""

from __future__ import annotations

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

_DIRECT = triton.__version__.startswith("3.6.")  # CompiledKernel.run's arguments are those of 3.6
_COMPILED: dict[tuple, tuple] = {}
_MAX_COMPILED = 512


def _arg_class(a) -> object:
    """What Triton 3.6 compiles a runtime argument's kernel for (native_specialize_impl); None
    for an argument of a kind that `launch` leaves to Triton."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31
    if isinstance(a, float):
        return float
    return None


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, key: tuple) -> None:
    """kernel[grid](*args, **constexprs), args being every runtime argument in order and
    constexprs the rest (and launch options such as num_warps); `key` is hashable and equal for
    equal constexprs."""
    if (not _DIRECT or not isinstance(kernel, JITFunction)  # the interpreter's kernels are not JITFunctions
            or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls):
        kernel[grid](*args, **constexprs)
        return
    classes = tuple(_arg_class(a) for a in args)
    device = torch.cuda.current_device()
    kind = (kernel, key, classes, device)
    hit = _COMPILED.get(kind) if None not in classes else None
    if hit is None:
        compiled = kernel[grid](*args, **constexprs)
        rest = kernel.params[len(args):]
        if None in classes or not all(p.is_constexpr for p in rest):
            return
        # the compile-time arguments, in the signature's order after the runtime ones: the
        # launcher takes every argument and skips these
        tail = tuple(constexprs.get(p.name, p.default) for p in rest)
        if len(_COMPILED) >= _MAX_COMPILED:
            _COMPILED.clear()
        _COMPILED[kind] = (compiled, tail)
        return
    compiled, tail = hit
    g = (*grid, 1, 1)
    compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *tail)
