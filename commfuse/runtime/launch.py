"""Kernel launches without the JIT's per-launch work.

`kernel[grid](*args)` binds the arguments, computes the specialization key (each pointer's
alignment, each integer's value), looks the compiled kernel up and reads the current stream:
about 16 µs of host time per launch on an H100, against about 4 µs for the compiled kernel's own
launcher. A graph launches many kernels per call, and when the host is slower than the GPU (small
steps, decode, FSDP's prefetch issued from the host), that is the step time.

What the JIT's key depends on is the same for every launch of one graph call: the alignment of
the graph's input tensors and the values of its dynamic sizes (every other pointer is an
allocation of ours or of aten, aligned, at offsets fixed by those sizes; every integer is a
literal or a function of them). So a graph call computes that key once (`Launches.begin`). Under
the key of its first call, each launch site runs through the JIT once and keeps the compiled
kernel; after that it calls that kernel's launcher directly. A call with another key goes
through the JIT for all its launches, as before.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

try:  # the hooks a launch calls (Triton >= 3.4): while one is set, launches go through the JIT
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None


class Launches:
    """The launch sites of one generated graph on one CUDA device."""

    def __init__(self, device_index: int):
        self.device_index = device_index
        self.key = None  # the first call's key: the one the bound kernels were specialized under

    def begin(self, key):
        """This call's raw CUDA stream where its launches may go straight to the bound kernels,
        else None."""
        if self.key is None:
            self.key = key
        if key != self.key or not _hooks_idle():
            return None
        return torch._C._cuda_getCurrentRawStream(self.device_index)


class Site:
    """One launch of a kernel in a graph's `call`, with its constexprs and launch options."""
    __slots__ = ("kernel", "options", "bound")

    def __init__(self, kernel, options: dict):
        self.kernel, self.options, self.bound = kernel, options, None

    def __call__(self, stream, grid, *args):
        bound = self.bound
        if bound is not None and stream is not None:
            run, function, metadata, constexprs = bound
            run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args, *constexprs)
            return
        with _disable_current_modes():  # Triton's interpreter copies tensors by torch ops, which a
            compiled = self.kernel[grid](*args, **self.options)  # caller's dispatch mode must not see
        if stream is not None:  # launched under the graph's first key: keep it
            self.bound = _bound(self.kernel, compiled, self.options, len(args))


def _bound(kernel, compiled, options: dict, nargs: int):
    """(launcher, function, packed metadata, constexpr values) of a compiled kernel; None where
    the launcher cannot be called directly (an unexpected Triton, a constexpr among the
    arguments passed by position)."""
    params = getattr(kernel, "params", None)
    if params is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    if any(p.is_constexpr for p in params[:nargs]) or not all(p.is_constexpr for p in params[nargs:]):
        return None
    try:
        constexprs = tuple(options[p.name] for p in params[nargs:])
    except KeyError:  # a default left to the JIT
        return None
    return compiled.run, compiled.function, compiled.packed_metadata, constexprs


def _hooks_idle() -> bool:
    return _knobs is not None and all(h is None or not getattr(h, "calls", True)
                                      for h in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook))
