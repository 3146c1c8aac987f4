"""Reductions: sum, mean, prod, amax, amin, argmax, argmin, any, all, max/min.dim, var.

Reductions are realized at once (consumers read their buffer); the scheduler fuses
their producers and consumers back into the same kernel. Long reductions over few
rows, or over few columns, are split in two so that enough programs share the work.
"""
from __future__ import annotations

import math

import sympy
import torch

from commfuse import ir, sizevars
from commfuse.dependencies import index_vars, trace_body
from commfuse.ir import Pointwise, Reduction, TensorBox
from commfuse.sizevars import index_symbol
from commfuse.virtualized import V, ops

from . import register
from .common import canonical_dim, make_pointwise
from .views import view

aten = torch.ops.aten
prims = torch.ops.prims

IDENTITY = {"sum": 0, "prod": 1, "any": False, "all": True}


def _dims(x, dims):
    n = len(x.get_size())
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(n))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({canonical_dim(d, n) for d in dims})


def reduce(x: TensorBox, dims, keepdim, reduction_type, dtype) -> TensorBox:
    """Reduce `x` over `dims`; the result is realized."""
    size = list(x.get_size())
    dims = [d for d in _dims(x, dims) if size]  # 0-d: nothing to reduce
    kept = [i for i in range(len(size)) if i not in dims]
    out_size = [sympy.Integer(1) if i in dims else s for i, s in enumerate(size)] if keepdim \
        else [size[i] for i in kept]
    red_sizes = [size[d] for d in dims]
    load = x.make_loader()
    src = x.get_dtype()
    rnumel = sizevars.product(red_sizes)
    if rnumel == 0 and reduction_type not in IDENTITY:  # max / argmax of nothing: aten raises, as eager
        raise ir.Unsupported(f"{reduction_type} over no elements")
    if rnumel == 0:  # the identity: no loop over an empty range (its index would divide by 0)
        return TensorBox(Pointwise(x.get_device(), dtype, lambda idx: ops.constant(IDENTITY[reduction_type], dtype),
                                   out_size))

    if rnumel == 1 or not dims:  # nothing to reduce: a cast (or an index of 0)
        def inner(idx):
            full = _full_index(idx, [sympy.Integer(0)] * len(dims), dims, kept, keepdim, len(size))
            if reduction_type in ("argmax", "argmin"):
                return ops.constant(0, torch.int64)
            if reduction_type in ("any", "all"):
                return ops.ne(load(full), ops.constant(0, src))
            if reduction_type == "welford_m2":  # one value deviates by nothing from its mean
                return ops.constant(0, dtype)
            return ops.to_dtype(load(full), dtype)
        return TensorBox(Pointwise(x.get_device(), dtype, inner, out_size))

    def inner(idx, ridx):
        full = _full_index(idx, sizevars.unravel(ridx[0], red_sizes) if len(ridx) == 1 and len(dims) > 1
                           else ridx, dims, kept, keepdim, len(size))
        return load(full)

    rr = [rnumel] if len(dims) > 1 else red_sizes
    node = Reduction(x.get_device(), dtype, inner, out_size, rr, reduction_type, src)
    split, columns = _split_factor(node, rnumel)
    if split > 1:
        return _split_reduce(x, load, size, dims, kept, keepdim, out_size, red_sizes,
                             reduction_type, dtype, split, columns)
    box = TensorBox(node)
    box.realize()
    return box


def _full_index(idx, ridx, dims, kept, keepdim, ndim):
    full = [None] * ndim
    for d, r in zip(dims, ridx):
        full[d] = r
    outer = [idx[i] for i in kept] if keepdim else list(idx)
    for i, v in zip(kept, outer):
        full[i] = v
    return full


def _split_factor(node, rnumel) -> tuple[int, bool]:
    """(parts, whether it reads columns) of a reduction split across programs (1: not split)."""
    xnumel = sizevars.product(node.ranges)
    if node.reduction_type in ("argmax", "argmin", "softmax_sum") or \
            not (sizevars.is_static(xnumel) and sizevars.is_static(rnumel)):
        return 1, False
    columns = _reads_columns(node)
    split = min(V.choices.reduction_split(int(xnumel), int(rnumel), columns, node.device), int(rnumel) // 2)
    if node.reduction_type == "welford_m2":  # equal parts, none padded: a padded lane would count
        split = math.gcd(split, int(rnumel))
    return split, columns  # parts of 2 or more: a part of 1 is no reduction


def _reads_columns(node) -> bool:
    """Does the reduction read some input transposed: stride 1 along its innermost output dim, a
    jump along the reduction (a sum over dim 0: the scheduler will tile it, `looped_tiles`)?"""
    xs = [v for v in index_vars("i", node.ranges) if v != 0]
    return bool(xs) and any(sizevars.walks_columns(a.index, xs[-1], index_symbol("r", 0))
                            for a in trace_body(node).reads if not a.indirect)


def _split_reduce(x, load, size, dims, kept, keepdim, out_size, red_sizes, reduction_type, dtype, split,
                  columns):
    """Each row's reduction in `split` parts, then the parts reduced. Rows of a `columns` reduction
    are dealt out (part s takes rows s, s + split, ...) and the parts laid out first, so the first
    kernel still walks its input along the columns; otherwise each part is a contiguous chunk."""
    rnumel = int(sizevars.product(red_sizes))
    chunk = -(-rnumel // split)
    src = x.get_dtype()
    low, high = (float("-inf"), float("inf")) if src.is_floating_point else (False, True) if src == torch.bool \
        else (torch.iinfo(src).min, torch.iinfo(src).max)
    ident = {**IDENTITY, "max": low, "min": high, "welford_m2": 0}[reduction_type]  # M2's parts are never padded
    partial_dtype = dtype if reduction_type not in ("sum", "prod") or not dtype.is_floating_point \
        else (torch.float32 if dtype.itemsize < 4 else dtype)

    def part(idx, s):  # index of the partials: the parts first for columns
        return [s] + list(idx) if columns else list(idx) + [s]

    def inner(idx, ridx):
        s, outer = (idx[0], idx[1:]) if columns else (idx[-1], idx[:-1])
        flat = ridx[0] * split + s if columns else s * chunk + ridx[0]
        full = _full_index(outer, sizevars.unravel(flat, red_sizes), dims, kept, keepdim, len(size))
        if chunk * split == rnumel:
            return load(full)
        cond = ops.lt(ops.index_expr(flat, torch.int64), ops.index_expr(sympy.Integer(rnumel), torch.int64))
        return ops.masked(cond, lambda: load(full), ident)
    stage1 = TensorBox(Reduction(x.get_device(), partial_dtype, inner, part(out_size, sympy.Integer(split)),
                                 [sympy.Integer(chunk)], reduction_type, src,
                                 (split, rnumel) if columns and reduction_type == "sum" else ()))
    stage1.realize()
    load1 = stage1.make_loader()
    if reduction_type == "welford_m2":
        return _combine_m2(x, inner, part, out_size, split, chunk, load1, dtype)
    return _reduce_parts(x.get_device(), load1, part, out_size, split, reduction_type, dtype, partial_dtype)


def _reduce_parts(dev, load_part, part, out_size, split, reduction_type, dtype, part_dtype):
    """A split reduction's second stage: each output reduces its `split` partials."""
    box = TensorBox(Reduction(dev, dtype, lambda idx, ridx: load_part(part(idx, ridx[0])), list(out_size),
                              [sympy.Integer(split)], reduction_type, part_dtype))
    box.realize()
    return box


def _combine_m2(x, inner, part, out_size, split, chunk, load_m2, dtype):
    # M2 of the whole row from its `split` parts of `chunk` values each (Chan): the parts' M2 plus
    # chunk * (part mean - mean)**2 for each part. The parts' sums come from the same pass.
    dev, parts = x.get_device(), [sympy.Integer(split)]
    sums = TensorBox(Reduction(dev, dtype, inner, part(out_size, parts[0]), [sympy.Integer(chunk)], "sum",
                               x.get_dtype()))
    sums.realize()
    load_sum = sums.make_loader()
    load_total = _reduce_parts(dev, load_sum, part, out_size, split, "sum", dtype, dtype).make_loader()

    def term(idx, ridx):
        at = part(idx, ridx[0])
        n_part, n = ops.constant(float(chunk), dtype), ops.constant(float(chunk * split), dtype)
        d = ops.sub(ops.truediv(load_sum(at), n_part), ops.truediv(load_total(idx), n))
        return ops.add(load_m2(at), ops.mul(n_part, _sq(d)))
    m2 = TensorBox(Reduction(dev, dtype, term, list(out_size), parts, "sum", dtype))
    m2.realize()
    return m2


def _sum_dtype(x, dtype):
    if dtype is not None:
        return dtype
    d = x.get_dtype()
    return torch.int64 if (d == torch.bool or not d.is_floating_point and not d.is_complex) else d


def _check(x):
    if x.get_dtype().is_complex:
        raise ir.Unsupported("complex reductions")


def _accumulate(x, dims, keepdim, kind, dtype):
    """sum / prod: integers and bools accumulate in int64, like torch."""
    _check(x)
    dtype = _sum_dtype(x, dtype)
    if x.get_dtype() != dtype:
        x = make_pointwise(lambda v: v, [x], out_dtype=dtype, compute_dtype=dtype)
    return reduce(x, dims, keepdim, kind, dtype)


@register(aten.sum.dim_IntList, aten.sum.default, prims.sum.default)
def sum_(x, dims=None, keepdim=False, *, dtype=None, output_dtype=None):
    return _accumulate(x, dims, keepdim, "sum", dtype or output_dtype)


@register(aten.prod.dim_int, aten.prod.default, prims.prod.default)
def prod(x, dim=None, keepdim=False, *, dtype=None, output_dtype=None):
    return _accumulate(x, dim, keepdim, "prod", dtype or output_dtype)


@register(aten.mean.dim, aten.mean.default)
def mean(x, dims=None, keepdim=False, *, dtype=None):
    _check(x)
    dtype = dtype or x.get_dtype()
    if not dtype.is_floating_point:
        raise ir.Unsupported("mean of an integer tensor")
    acc = torch.float32 if dtype.itemsize < 4 else dtype
    size = x.get_size()
    n = sizevars.product(size[d] for d in _dims(x, dims)) if size else sympy.Integer(1)
    total = sum_(x, dims, keepdim, dtype=acc)
    return make_pointwise(lambda s: ops.truediv(s, ops.index_expr(n, acc)), [total],
                          out_dtype=dtype, compute_dtype=acc)


@register(aten.amax, aten.amin, prims.amax, prims.amin, with_op=True)
def amax_amin(op, x, dims=None, keepdim=False):
    _check(x)
    kind = "max" if op.overloadpacket in (aten.amax, prims.amax) else "min"
    return reduce(x, dims, keepdim, kind, x.get_dtype())


@register(aten.argmax, aten.argmin, with_op=True)
def argmax_argmin(op, x, dim=None, keepdim=False):
    _check(x)
    kind = "argmax" if op.overloadpacket is aten.argmax else "argmin"
    if dim is None:
        x, dim = view(x, [-1]), 0
        if keepdim:
            raise ir.Unsupported("argmax over all dims with keepdim")
    return reduce(x, [dim], keepdim, kind, torch.int64)


@register(aten.max.dim, aten.min.dim, with_op=True)
def max_min_dim(op, x, dim, keepdim=False):
    _check(x)
    is_max = op is aten.max.dim
    values = reduce(x, [dim], keepdim, "max" if is_max else "min", x.get_dtype())
    indices = reduce(x, [dim], keepdim, "argmax" if is_max else "argmin", torch.int64)
    return values, indices


@register(aten.max.default, aten.min.default, with_op=True)
def max_min_all(op, x):
    return reduce(x, None, False, "max" if op is aten.max.default else "min",
                  x.get_dtype())


@register(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.dims, aten.all.default,
          with_op=True)
def any_all(op, x, dims=None, keepdim=False):
    _check(x)
    kind = "any" if op.overloadpacket is aten.any else "all"
    b = make_pointwise(lambda v: ops.ne(v, ops.constant(0, x.get_dtype())), [x], out_dtype=torch.bool,
                       compute_dtype=x.get_dtype()) if x.get_dtype() != torch.bool else x
    return reduce(b, dims, keepdim, kind, torch.bool)


@register(prims.var.default)
def var(x, dims, correction=1, *, output_dtype=None):
    _check(x)
    dtype = output_dtype or x.get_dtype()
    acc = torch.float32 if dtype.itemsize < 4 else dtype
    size = x.get_size()
    n = sizevars.product(size[d] for d in _dims(x, dims))
    ss = reduce(x, dims, False, "welford_m2", acc)  # one pass over x (codegen: Welford where looped)
    denom = sympy.Max(n - correction, 0)
    return make_pointwise(lambda s: ops.truediv(s, ops.index_expr(denom, acc)), [ss], out_dtype=dtype,
                          compute_dtype=acc)


def _sq(v):
    return ops.mul(v, v)
