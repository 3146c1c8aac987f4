"""Helpers shared by the op families: broadcasting, type promotion, building loops."""
from __future__ import annotations

from typing import Callable, Sequence

import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind
from torch._prims_common import elementwise_dtypes

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.virtualized import V, ops

DEFAULT = Kind.DEFAULT
INT_TO_FLOAT = Kind.INT_TO_FLOAT
BOOL = Kind.ALWAYS_BOOL
NO_OPMATH = Kind.NO_OPMATH
COMPLEX_TO_FLOAT = Kind.COMPLEX_TO_FLOAT
BOOL_TO_LONG = Kind.BOOL_TO_LONG


def is_tensor(x) -> bool:
    return isinstance(x, TensorBox)


def broadcast_shapes(*sizes: Sequence) -> list:
    ndim = max((len(s) for s in sizes), default=0)
    out = []
    for i in range(-ndim, 0):
        dims = [s[i] for s in sizes if len(s) >= -i]
        non_one = [d for d in dims if d != 1]
        if not non_one:
            out.append(sympy.Integer(1))
            continue
        for d in non_one[1:]:
            if not sizevars.equal(d, non_one[0]):
                raise ir.Unsupported(f"cannot prove broadcast sizes equal: {non_one}")
        out.append(non_one[0])
    return out


def broadcast_loader(x: TensorBox, size: Sequence) -> Callable:
    """Loader of `x` expanded (numpy broadcasting) to `size`."""
    inner = x.make_loader()
    xs = x.get_size()
    skip = len(size) - len(xs)
    ones = [d == 1 and size[skip + i] != 1 for i, d in enumerate(xs)]

    def load(index):
        sub = index[skip:]
        return inner([sympy.Integer(0) if one else i for one, i in zip(ones, sub)])
    return load


def _meta(x):
    if is_tensor(x):
        return torch.empty([0] * len(x.get_size()), dtype=x.get_dtype(), device="meta")
    return x


def promote(args, kind=DEFAULT):
    """(compute dtype, result dtype) of an elementwise op, by torch's rules."""
    return elementwise_dtypes(*[_meta(a) for a in args], type_promotion_kind=kind)


def scalar_value(x):
    if isinstance(x, sympy.Expr):
        return x
    return x.item() if isinstance(x, torch.Tensor) else x


def loader_of(x, size, dtype) -> Callable:
    """Loader producing `x` (tensor or scalar) as `dtype` over `size`."""
    if is_tensor(x):
        load = broadcast_loader(x, size)
        if x.get_dtype() == dtype:
            return load
        return lambda index: ops.to_dtype(load(index), dtype)
    value = scalar_value(x)
    if isinstance(value, sympy.Expr) and not value.is_number:
        return lambda index: ops.index_expr(value, dtype)
    return lambda index: ops.constant(value, dtype)


def device_of(*args) -> torch.device:
    for a in args:
        if is_tensor(a):
            return a.get_device()
    return V.graph.current_node.meta["val"].device


def make_pointwise(fn: Callable, args: Sequence, kind=DEFAULT, out_dtype=None,
                   compute_dtype=None) -> TensorBox:
    """Elementwise `fn(*loaded args)` with broadcasting and type promotion."""
    tensors = [a for a in args if is_tensor(a)]
    for t in tensors:
        if t.get_dtype().is_complex:
            raise ir.Unsupported("complex dtypes")
    compute, result = promote(args, kind)
    compute = compute_dtype or compute
    result = out_dtype or result
    size = broadcast_shapes(*[t.get_size() for t in tensors])
    loaders = [loader_of(a, size, compute) for a in args]

    def inner(index):
        value = fn(*[load(index) for load in loaders])
        return ops.to_dtype(value, result) if compute != result else value
    return TensorBox(Pointwise(device_of(*args), result, inner, size))


def full(size, value, dtype, device) -> TensorBox:
    # a symbolic value too: a size, or a SymFloat the wrapper computes at run time
    return TensorBox(Pointwise(device, dtype, loader_of(value, size, dtype), list(size)))


def to_size(sizes) -> list:
    return [sizevars.from_torch(s) for s in sizes]


def canonical_dim(dim: int, ndim: int) -> int:
    if ndim == 0:
        ndim = 1
    if not -ndim <= dim < ndim:
        raise IndexError(f"dimension {dim} out of range for {ndim}-d tensor")
    return dim % ndim
