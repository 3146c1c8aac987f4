"""Helpers the generated modules import."""
from __future__ import annotations

import types

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def empty_strided(size, stride, device, dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, device=device, dtype=dtype)


# on the current CUDA device without the dispatcher: a sequence-parallel training step's 182
# allocations took 1.1 ms of its host time through torch.empty_strided (profiled on 4x H200)
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda


def as_meta_layout(t: torch.Tensor, size, stride, dtype=None) -> torch.Tensor:
    """`t`, an aten op's result, in the size and strides of the op's meta function, which the
    compiled kernels index by. A kernel may return other strides than its meta function says
    (for some inputs, on some devices): it is then copied, never read wrongly. With `dtype` (a
    kernel of ours reads it), one of another dtype is converted: the CPU's mixed-precision norms
    give fp32 statistics and gradients where their meta functions say bf16 (or the reverse)."""
    if t.stride() == stride and t.shape == size and (dtype is None or t.dtype == dtype):  # (the usual case)
        return t
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    shape = t.shape
    if len(shape) != len(size) or any(a != b for a, b in zip(shape, size)):
        raise RuntimeError(f"commfuse: an aten op returned shape {tuple(shape)} where its meta "
                           f"function said {tuple(size)}")
    if all(a == b or n <= 1 for a, b, n in zip(t.stride(), stride, size)):
        return t
    return torch.empty_strided(size, stride, dtype=t.dtype, device=t.device).copy_(t)


# reinterpret_tensor(base, size, stride, offset): `base`'s memory in other sizes and strides, an
# alias, not an autograd view, so that an output laid over a buffer of ours is a tensor the caller
# may update in place under autograd. Called directly: a wrapper's frame added a third to its cost.
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor


def workspace(cache: dict, key: str, numel: int, dtype, device) -> torch.Tensor:
    """A zeroed scratch tensor kept for the module's life (the same memory in every CUDA-graph
    replay): the split-K matmul adds into it and leaves it zeroed again."""
    t = cache.get(key)
    if t is None:
        t = cache[key] = torch.zeros(numel, dtype=dtype, device=device)
    return t


class Ops:
    # A torch.ops namespace for generated code, each `op.overload` bound to a faster callable of
    # the same operator: a matmul's Python binding (torch.mm: 1.5 µs of host time a call against
    # 4-5 through its OpOverload, timed on CPU), else the overload's C++ function (1 µs less).
    FAST = {("mm", "out"): torch.mm, ("mm", "default"): torch.mm, ("addmm", "out"): torch.addmm,
            ("bmm", "out"): torch.bmm, ("bmm", "default"): torch.bmm, ("baddbmm", "out"): torch.baddbmm}

    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name):  # once per op: the namespace it returns is kept as an attribute
        packet = getattr(self._namespace, name)
        fast = self.FAST if self._namespace is torch.ops.aten else {}
        ops = types.SimpleNamespace(**{o: fast.get((name, o)) or getattr(packet, o)._op for o in packet.overloads()})
        setattr(self, name, ops)
        return ops
