"""Elementwise math, comparison, logical, bitwise and cast ops; where, clamp, masked_fill;
constructors (full, arange, ...)."""
from __future__ import annotations

import dataclasses

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims.fma)

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.virtualized import OPS, V, ops

from . import register
from .common import (BOOL, DEFAULT, INT_TO_FLOAT, broadcast_shapes, full, is_tensor,
                     loader_of, make_pointwise, promote, to_size)
from .views import expand

aten = torch.ops.aten
prims = torch.ops.prims


def _simple(op_name: str):
    return lambda *args: getattr(ops, op_name)(*args)


def _register_simple(table, kind):
    for aten_op, op_name in list(table.items()):
        prim = getattr(prims, aten_op.__name__ if isinstance(aten_op, torch._ops.OpOverloadPacket)
                       else aten_op.overloadpacket.__name__, None)
        if isinstance(prim, torch._ops.OpOverloadPacket) and prim not in table:
            table[prim] = op_name  # prims decompositions produce the same math
    for aten_op, op_name in table.items():
        assert op_name in OPS, op_name

        def lower(*args, _fn=_simple(op_name), _kind=kind, _name=op_name, **kwargs):
            if kwargs:
                raise ir.Unsupported(f"keyword arguments {kwargs}")
            out = make_pointwise(_fn, args, _kind)
            if not V.choices.kernel_math_exact(_name, out.get_device(), out.get_dtype()):
                raise ir.Unsupported(f"{_name} of {out.get_dtype()} is not exact in Triton's interpreter")
            return out
        register(aten_op)(lower)


_register_simple({
    aten.abs: "abs", aten.neg: "neg", aten._neg_view: "neg", aten.maximum: "maximum", aten.minimum: "minimum",
    aten.mul: "mul", aten.sign: "sign", aten.floor: "floor", aten.ceil: "ceil",
    aten.trunc: "trunc", aten.round.default: "round", aten.relu: "relu",
    aten.bitwise_not: "bitwise_not", aten.bitwise_and: "bitwise_and",
    aten.bitwise_or: "bitwise_or", aten.bitwise_xor: "bitwise_xor",
    aten.bitwise_left_shift: "bitwise_left_shift", aten.bitwise_right_shift: "bitwise_right_shift",
    aten.remainder: "remainder", aten.fmod: "fmod", aten.copysign: "copysign",
    aten.fmax: "fmax", aten.fmin: "fmin", aten.square: "square", aten.sgn: "sign",
}, DEFAULT)

_register_simple({
    aten.exp: "exp", aten.exp2: "exp2", aten.expm1: "expm1", aten.log: "log", aten.log2: "log2",
    aten.log10: "log10", aten.log1p: "log1p", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt",
    aten.sin: "sin", aten.cos: "cos", aten.tan: "tan", aten.asin: "asin", aten.acos: "acos",
    aten.atan: "atan", aten.sinh: "sinh", aten.cosh: "cosh", aten.tanh: "tanh",
    aten.asinh: "asinh", aten.acosh: "acosh", aten.atanh: "atanh", aten.sigmoid: "sigmoid",
    aten.erf: "erf", aten.erfc: "erfc", aten.reciprocal: "reciprocal",
    aten.atan2: "atan2", aten.hypot: "hypot",
}, INT_TO_FLOAT)

_register_simple({
    aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le", aten.gt: "gt", aten.ge: "ge",
    aten.logical_and: "logical_and", aten.logical_or: "logical_or",
    aten.logical_xor: "logical_xor", aten.logical_not: "logical_not",
    aten.isnan: "isnan", aten.isinf: "isinf", aten.signbit: "signbit",
}, BOOL)


@register(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, with_op=True)
def add_sub(op, a, b, alpha=1):
    sub = op in (aten.sub.Tensor, aten.sub.Scalar)
    if alpha != 1:
        if is_tensor(b):
            b = make_pointwise(lambda v: ops.mul(v, ops.constant(alpha, promote([b, alpha])[0])),
                               [b])
        else:
            b = b * alpha
    return make_pointwise(lambda x, y: ops.sub(x, y) if sub else ops.add(x, y), [a, b])


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(a, b, alpha=1):
    if alpha != 1:
        raise ir.Unsupported("rsub alpha")
    return make_pointwise(lambda x, y: ops.sub(y, x), [a, b])


@register(aten.div.Tensor, aten.div.Scalar, aten.true_divide)
def div(a, b):
    return make_pointwise(lambda x, y: ops.truediv(x, y), [a, b], INT_TO_FLOAT)


@register(prims.div)
def prims_div(a, b):
    """True division for floats, truncation for integers."""
    compute, _ = promote([a, b])
    if compute.is_floating_point:
        return div(a, b)
    return make_pointwise(lambda x, y: ops.truncdiv(x, y), [a, b])


@register(prims.add, prims.sub, with_op=True)
def prims_add_sub(op, a, b):
    sub = op.overloadpacket is prims.sub
    return make_pointwise(lambda x, y: ops.sub(x, y) if sub else ops.add(x, y), [a, b])


@register(prims.where)
def prims_where(cond, a, b):
    return where(cond, a, b)


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(a, b, rounding_mode=None):
    if rounding_mode is None:
        return div(a, b)
    compute, result = promote([a, b])
    if rounding_mode == "floor":
        f = lambda x, y: ops.floordiv(x, y)  # noqa: E731
    else:
        f = (lambda x, y: ops.trunc(ops.truediv(x, y))) if compute.is_floating_point else \
            (lambda x, y: ops.truncdiv(x, y))
    return make_pointwise(f, [a, b])


@register(aten.floor_divide)
def floor_divide(a, b):
    return div_mode(a, b, rounding_mode="floor")


@register(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def pow_(a, b):
    compute, result = promote([a, b])
    if not is_tensor(b) and b == 0.5:  # eager takes sqrt too (sqrt(-0.) is -0., sqrt(-inf) nan)
        return make_pointwise(lambda x: ops.sqrt(x), [a], INT_TO_FLOAT)
    if not is_tensor(b) and V.choices.pow_by_multiplication(b, compute.is_floating_point):
        return make_pointwise(lambda x: _pow_int(x, int(b), compute), [a], out_dtype=result, compute_dtype=compute)
    if not compute.is_floating_point:
        raise ir.Unsupported("integer pow")  # aten's errors for negative exponents, as eager
    return make_pointwise(lambda x, y: ops.pow(x, y), [a, b])


def _pow_int(x, n: int, dtype):
    """x ** n by squaring; a reciprocal for n < 0 (1 / x**2 for n = -2, as eager)."""
    if n < 0:
        return ops.reciprocal(_pow_int(x, -n, dtype))
    if n <= 1:
        return x if n else ops.constant(1, dtype)  # x ** 0 is 1 for nan and inf too
    half = _pow_int(x, n // 2, dtype)
    return ops.mul(ops.mul(half, half), x) if n % 2 else ops.mul(half, half)


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(cond, a, b):
    compute, result = promote([a, b])
    size = broadcast_shapes(*[t.get_size() for t in (cond, a, b) if is_tensor(t)])
    lc = loader_of(cond, size, torch.bool)
    la, lb = loader_of(a, size, result), loader_of(b, size, result)
    device = next(t for t in (cond, a, b) if is_tensor(t)).get_device()
    return TensorBox(Pointwise(device, result, lambda i: ops.where(lc(i), la(i), lb(i)), size))


@register(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min, aten.clamp_max, with_op=True)
def clamp(op, x, lo=None, hi=None):
    if op in (aten.clamp_max.default, aten.clamp_max.Tensor):
        lo, hi = None, lo
    args = [x] + [v for v in (lo, hi) if v is not None]
    has_lo, has_hi = lo is not None, hi is not None

    def fn(v, *bounds):
        bounds = list(bounds)
        if has_lo:
            lo_v = bounds.pop(0)
            v = ops.where(ops.isnan(v), v, ops.maximum(v, lo_v)) if _is_float(x) else ops.maximum(v, lo_v)
        if has_hi:
            hi_v = bounds.pop(0)
            v = ops.where(ops.isnan(v), v, ops.minimum(v, hi_v)) if _is_float(x) else ops.minimum(v, hi_v)
        return v
    return make_pointwise(fn, args)


def _is_float(x):
    return is_tensor(x) and x.get_dtype().is_floating_point


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    if is_tensor(value) and value.get_size():
        raise ir.Unsupported("masked_fill value must be 0-d")
    dtype = x.get_dtype()
    size = broadcast_shapes(x.get_size(), mask.get_size())
    lx, lm, lv = loader_of(x, size, dtype), loader_of(mask, size, torch.bool), loader_of(value, size, dtype)
    return TensorBox(Pointwise(x.get_device(), dtype, lambda i: ops.where(lm(i), lv(i), lx(i)), size))


@register(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(a, b, w):
    return make_pointwise(lambda x, y, t: ops.add(x, ops.mul(t, ops.sub(y, x))), [a, b, w])


@register(prims.fma)
def fma(a, b, c):  # a * b + c (torch's lerp decomposition): rounded after the product too
    return make_pointwise(lambda x, y, z: ops.add(ops.mul(x, y), z), [a, b, c])


@register(aten.addcmul, aten.addcdiv, with_op=True)
def addc(op, a, b, c, value=1):
    mul = op.overloadpacket is aten.addcmul
    compute, _ = promote([a, b, c])
    return make_pointwise(lambda x, y, z: ops.add(x, ops.mul(ops.constant(value, compute),
                                                             ops.mul(y, z) if mul else ops.truediv(y, z))),
                          [a, b, c])


@register(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other)
def xlogy(a, b):
    def fn(x, y):
        z = ops.constant(0.0, torch.float32)
        r = ops.where(ops.eq(x, z), z, ops.mul(x, ops.log(y)))
        return ops.where(ops.isnan(y), y, r)
    return make_pointwise(fn, [a, b], INT_TO_FLOAT)


@register(aten.nan_to_num)
def nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    dtype = x.get_dtype()
    if not dtype.is_floating_point:
        return make_pointwise(lambda v: v, [x])
    info = torch.finfo(dtype)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf

    def fn(v):
        v = ops.where(ops.isnan(v), ops.constant(nan, dtype), v)
        pos = ops.logical_and(ops.isinf(v), ops.gt(v, ops.constant(0, dtype)))
        neg = ops.logical_and(ops.isinf(v), ops.lt(v, ops.constant(0, dtype)))
        v = ops.where(pos, ops.constant(posinf, dtype), v)
        return ops.where(neg, ops.constant(neginf, dtype), v)
    return make_pointwise(fn, [x])


# ----------------------------------------------------------------------------- casts
@register(prims.convert_element_type, aten._to_copy, with_op=True)
def to_dtype(op, x, dtype=None, **kwargs):
    if op is aten._to_copy.default:
        dev = kwargs.pop("device", None)
        kwargs.pop("layout", None), kwargs.pop("pin_memory", None), kwargs.pop("non_blocking", None)
        kwargs.pop("memory_format", None)
        if kwargs or (dev is not None and torch.device(dev) != x.get_device()):
            raise ir.Unsupported("device copies run through aten")
    dtype = dtype or x.get_dtype()
    if dtype.is_complex or x.get_dtype().is_complex:
        raise ir.Unsupported("complex")
    load = x.make_loader()
    return TensorBox(Pointwise(x.get_device(), dtype, lambda i: ops.to_dtype(load(i), dtype, explicit=True),
                               list(x.get_size())))


@register(aten.copy.default)
def copy(x, src, non_blocking=False):
    """Functional `x.copy_(src)` (a slice assignment, functionalized): src's values in x's shape
    and dtype."""
    if not is_tensor(src) or src.get_device() != x.get_device():
        raise ir.Unsupported("copies across devices run through aten")
    return to_dtype(aten._to_copy.default, expand(src, x.get_size()), x.get_dtype())


@register(aten.copy_.default)
def copy_into_input(dst, src, non_blocking=False):
    """A graph input updated in place (functionalization's write-back of a parameter or optimizer
    state): the kernel that computes the value stores it into the input, no copy after it."""
    if not is_tensor(dst) or type(dst.data) is not ir.InputBuffer:
        raise ir.Unsupported("copy_ into other than a whole graph input (donated ones are freed early)")
    d = dst.data
    layout = ir.MutationLayout(**{f.name: getattr(d.layout, f.name) for f in dataclasses.fields(ir.Layout)}, target=d.name)
    return TensorBox(V.graph.register_buffer(ir.ComputedBuffer, layout=layout, data=copy(dst, src).data))


@register(aten.alias, aten.detach)
def alias(x):
    """The same values, no copy (a graph output aliasing another one, a saved activation)."""
    if not is_tensor(x):
        raise ir.Unsupported("alias of a non-tensor")
    return x


@register(aten.clone, aten.lift_fresh_copy)
def clone(x, **kwargs):
    if not is_tensor(x):
        raise ir.Unsupported("clone of a non-tensor")
    load = x.make_loader()
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(), load, list(x.get_size())))


# ----------------------------------------------------------------------------- constructors
def _ctor_args(kwargs, default_dtype=None):
    dtype = kwargs.get("dtype") or default_dtype or torch.get_default_dtype()
    device = kwargs.get("device") or V.graph.current_node.meta["val"].device
    return dtype, torch.device(device)


@register(aten.full.default)
def full_(size, value, **kwargs):
    dtype, device = _ctor_args(kwargs, V.graph.current_node.meta["val"].dtype)
    return full(to_size(size), value, dtype, device)


@register(aten.scalar_tensor)
def scalar_tensor(value, **kwargs):
    dtype, device = _ctor_args(kwargs)
    return full([], value, dtype, device)


@register(aten.full_like, aten.zeros_like, aten.ones_like, with_op=True)
def full_like(op, x, *args, **kwargs):
    packet = op.overloadpacket
    value = args[0] if packet is aten.full_like else (0 if packet is aten.zeros_like else 1)
    meta = V.graph.current_node.meta["val"]
    return full(x.get_size(), value, meta.dtype, meta.device)


@register(aten.zeros.default, aten.ones.default, with_op=True)
def zeros_ones(op, size, **kwargs):
    meta = V.graph.current_node.meta["val"]
    value = 0 if op is aten.zeros.default else 1
    return full(to_size(size), value, meta.dtype, meta.device)


@register(aten.arange.start_step, aten.arange.default, aten.arange.start)
def arange(*args, **kwargs):
    meta = V.graph.current_node.meta["val"]
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        start, end, step = args[0], args[1], (args[2] if len(args) > 2 else 1)
    if any(isinstance(v, float) for v in (start, end, step)) or meta.dtype.is_floating_point:
        dtype = meta.dtype

        def scalar(v):  # a symbolic int bound (dynamic shapes) is an index expression
            return ops.constant(v, dtype) if isinstance(v, (int, float)) else ops.index_expr(sizevars.from_torch(v), dtype)
        return TensorBox(Pointwise(meta.device, dtype, lambda i: ops.add(
            scalar(start), ops.mul(ops.index_expr(i[0], dtype), scalar(step))), to_size(meta.shape)))
    dtype = meta.dtype
    return TensorBox(Pointwise(meta.device, dtype, lambda i: ops.index_expr(start + i[0] * step, dtype),
                               to_size(meta.shape)))


@register(prims.iota)
def iota(length, *, start, step, dtype, device, requires_grad):
    return TensorBox(Pointwise(torch.device(device), dtype,
                               lambda i: ops.index_expr(start + i[0] * step, dtype),
                               [sizevars.from_torch(length)]))


@register(aten.empty.memory_format, aten.empty_like, aten.empty_strided, aten.new_empty,
          aten.new_empty_strided)
def empty(*args, **kwargs):
    meta = V.graph.current_node.meta["val"]
    # Contents are unspecified; zeros keep results deterministic at the cost of one store.
    return full(to_size(meta.shape), 0, meta.dtype, meta.device)
