"""The `ops` handler that writes Triton: each `ops` call becomes a line of the kernel
(through `TritonKernel.newvar`, which eliminates common subexpressions)."""
from __future__ import annotations

import dataclasses

import sympy
import torch

from commfuse import config
from commfuse.runtime.loader import interpreting
from commfuse.virtualized import V

from .common import compute_dtype, literal, texpr, triton_dtype


@dataclasses.dataclass
class Var:
    name: str
    dtype: torch.dtype   # logical dtype; low-precision floats are held as fp32

    def __str__(self):
        return self.name


def round_bf16(x: str, src: torch.dtype) -> str:
    """Float `x` rounded to bfloat16, to nearest even, held as fp32. Done on the bits: Triton's
    interpreter truncates in `.to(tl.bfloat16)` (and mangles fp64 there), and on an H100 a
    `.to(tl.bfloat16).to(tl.float32)` round trip did not round (x*3+1 off by an ulp from eager)."""
    if src != torch.float32:  # fp64 and ints through fp32, as torch converts them
        x = f"{x}.to(tl.float32)"
    bits = f"{x}.to(tl.int32, bitcast=True)"
    rounded = f"(({bits} + (0x7FFF + (({bits} >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)"
    return f"tl.where({x} != {x}, {x}, {rounded})"  # NaN: its bits must not carry into the sign


def narrowed(x: str, src: torch.dtype, dtype: torch.dtype) -> str:
    """Float `x` rounded to the low-precision float `dtype`, held as fp32."""
    return round_bf16(x, src) if dtype == torch.bfloat16 else f"{x}.to({triton_dtype(dtype)}).to(tl.float32)"


def store_text(x: str, src: torch.dtype, dtype: torch.dtype) -> str:
    """Value `x` of logical dtype `src` as stored into a buffer of `dtype`."""
    if dtype == torch.bfloat16:
        # a GPU's store cast rounds to nearest even; under the interpreter it would truncate
        return f"{round_bf16(x, compute_dtype(src))}.to(tl.bfloat16)" if interpreting() else f"{x}.to(tl.bfloat16)"
    if dtype != src or compute_dtype(dtype) != dtype:
        return f"{x}.to({triton_dtype(dtype)})"
    return x


class TritonOps:
    """The `ops` handler that writes Triton."""

    def __init__(self, kernel):
        self.k = kernel

    # memory
    def load(self, name, index):
        return self.k.load(name, index)

    def store(self, name, index, value, mode=None):
        return self.k.store(name, index, value)

    def reduction(self, dtype, src_dtype, rtype, value):
        out = self.k.reduction(dtype, src_dtype, rtype, value)
        if config.emulate_precision_casts and compute_dtype(dtype) != dtype and rtype in ("sum", "prod") \
                and not self.k.partial:  # eager rounds a low-precision sum before anyone uses it
            self.k._finish(self.k.cur, f"{out} = {narrowed(out.name, torch.float32, dtype)}")
        return out

    def store_reduction(self, name, index, value):
        return self.k.store_reduction(name, index, value)

    def peer_reduce(self, name, index, reduce_op, shard=0):
        out = self.k.peer_reduce(name, index, reduce_op, shard)
        if config.emulate_precision_casts and compute_dtype(out.dtype) != out.dtype:  # as c10d's bf16 result
            return self.k.newvar(narrowed(out.name, torch.float32, out.dtype), out.dtype)
        return out

    def peer_load(self, name, index, peer):
        return self.k.peer_load(name, index, peer)

    # values
    def constant(self, value, dtype):
        cd = compute_dtype(dtype)
        return self.k.newvar(f"tl.full({self.k.shape()}, {literal(value, cd)}, {triton_dtype(cd)})", dtype)

    def index_expr(self, expr, dtype):
        cd, expr = compute_dtype(dtype), sympy.sympify(expr)
        if expr.free_symbols & V.graph.float_scalars:  # in fp64, as the wrapper computed it (broadcast
            text = texpr(self.k.simplify_index(expr))    # over int zeros, Triton would make it fp32)
            return self.k.newvar(f"(tl.full({self.k.shape()}, 0, tl.float64) + ({text})).to({triton_dtype(cd)})", dtype)
        if cd == torch.int64 and self.k.past_int32(expr):
            self.k.int64 = True  # the kernel's indices in int64: `2**36 * x` (an arange's step) computed in it
        return self.k.newvar(f"({self.k.index_str(expr)}).to({triton_dtype(cd)})", dtype)

    def to_dtype(self, x, dtype, explicit=False):
        """`explicit`: a cast the program wrote (`.to(bf16)`), rounded as eager rounds it. The
        casts type promotion adds after each op of a low-precision float are not rounded unless
        config.emulate_precision_casts: the fused kernel keeps fp32 between its ops (as Inductor
        does), more accurate than eager and without a rounding per op."""
        if x.dtype == dtype:
            return x
        if dtype == torch.bool:
            return self.k.newvar(f"({x} != 0)", dtype)
        cd = compute_dtype(dtype)
        if cd != dtype and compute_dtype(x.dtype) == cd and not (explicit or config.emulate_precision_casts):
            return Var(x.name, dtype)
        text = f"{x}.to({triton_dtype(dtype)})"
        if cd != dtype:  # round to the narrow type, keep computing in fp32
            text = narrowed(x.name, compute_dtype(x.dtype), dtype)
        elif compute_dtype(x.dtype) == cd:
            return Var(x.name, dtype)
        return self.k.newvar(text, dtype)

    def indirect_indexing(self, value, size, check=True, wrap=True):
        """An index loaded from the device, negative ones from the end (`wrap`: Python's, and
        `x[idx]`'s; gather and scatter take none), asserted in bounds where `check`."""
        k = self.k
        size_s = k.index_str(sympy.sympify(size)) if not sympy.sympify(size).is_number else str(size)
        wrapped = k.newvar(f"tl.where({value} < 0, {value} + {size_s}, {value})", value.dtype) if wrap else value
        if check:
            k.uses_assert = True
            k.cur.body.writeline(f"tl.device_assert((({wrapped} >= 0) & ({wrapped} < {size_s})) | ~({k.mask()}), "
                                 f"\"index out of bounds: 0 <= index < {size}\")")
        k.mask_stack.append(f"({wrapped} >= 0) & ({wrapped} < {size_s})")
        return sympy.Symbol(wrapped.name, integer=True)

    def masked(self, mask, body, other):
        k = self.k
        depth = len(k.mask_stack)
        k.mask_stack.append(str(mask))
        saved = dict(k.cur.cache)
        try:
            result = body()
        finally:
            del k.mask_stack[depth:]  # the body's indirect loads push bounds masks of their own
            k.cur.cache.clear()
            k.cur.cache.update(saved)
        other_v = self.constant(other, result.dtype)
        return k.newvar(f"tl.where({mask}, {result}, {other_v})", result.dtype, cache=False)

    def random(self, key, counter, normal: bool):
        """A uniform [0, 1) or standard normal fp32 draw: Philox keyed by `key` at `counter`."""
        fn = "tl.randn" if normal else "tl.rand"
        return self.k.newvar(f"{fn}({key}, ({counter}).to(tl.uint32))", torch.float32)

    def where(self, c, a, b):
        return self._op(f"tl.where({c}, {a}, {b})", _promote(a, b))

    # arithmetic
    def _op(self, text, dtype):
        return self.k.newvar(text, dtype)

    def _bin(self, fmt, a, b, dtype=None):
        return self._op(fmt.format(a=a, b=b), dtype or _promote(a, b))

    def add(self, a, b): return self._bin("{a} | {b}" if _promote(a, b) == torch.bool else "{a} + {b}", a, b)
    def sub(self, a, b): return self._bin("{a} - {b}", a, b)
    def mul(self, a, b): return self._bin("{a} & {b}" if _promote(a, b) == torch.bool else "{a} * {b}", a, b)
    def truediv(self, a, b): return self._bin("{a} / {b}", a, b)
    def neg(self, a): return self._op(f"({a} * -1.0)" if a.dtype.is_floating_point else f"-{a}", a.dtype)  # (triton_helpers: NEGATE)
    def abs(self, a): return self._op(f"tl.abs({a})", a.dtype) if a.dtype != torch.bool else a
    def square(self, a): return self.mul(a, a)

    def _nonzero_divisor(self, a, b):
        """An integer division by zero raises on a CPU, as eager's kernels and Inductor's C++ ones
        do (the interpreter returned 0 or -1); on a GPU eager returns whatever the hardware gives."""
        if interpreting() and (dtype := _promote(a, b)) != torch.bool and not dtype.is_floating_point:
            self.k.uses_assert = True
            self.k.cur.body.writeline(f'tl.device_assert(({b} != 0) | ~({self.k.mask()}), "ZeroDivisionError")')

    def floordiv(self, a, b):
        self._nonzero_divisor(a, b)
        floating = any(isinstance(v, Var) and v.dtype.is_floating_point for v in (a, b))
        return self._bin(f"triton_helpers.div_floor{'_float' if floating else ''}({{a}}, {{b}})", a, b)

    def truncdiv(self, a, b):
        self._nonzero_divisor(a, b)
        return self._bin("{a} // {b}", a, b)

    # Triton's % is C's fmod, exact for floats too (a - b * trunc(a / b) lost up to all of b:
    # fmod(1.0, 0.1) gave 0.0 for 0.0999...)
    def remainder(self, a, b):
        self._nonzero_divisor(a, b)
        return self._bin("triton_helpers.remainder({a}, {b})", a, b)

    def fmod(self, a, b):
        self._nonzero_divisor(a, b)
        return self._bin("{a} % {b}", a, b)

    def pow(self, a, b):
        return self._bin("triton_helpers.pow_float({a}, {b})", a, b)

    def maximum(self, a, b):
        if _promote(a, b).is_floating_point:
            return self._bin("triton_helpers.max_nan({a}, {b})", a, b)
        return self._bin("tl.maximum({a}, {b})", a, b)

    def minimum(self, a, b):
        if _promote(a, b).is_floating_point:
            return self._bin("triton_helpers.min_nan({a}, {b})", a, b)
        return self._bin("tl.minimum({a}, {b})", a, b)

    def fmax(self, a, b):
        return self._bin("tl.where(({a} >= {b}) | ({b} != {b}), {a}, {b})", a, b)

    def fmin(self, a, b):
        return self._bin("tl.where(({a} <= {b}) | ({b} != {b}), {a}, {b})", a, b)

    def relu(self, a):
        if a.dtype == torch.bool:
            return a
        return self._op(f"tl.where({a} < 0, 0, {a})", a.dtype)

    def sign(self, a):
        if a.dtype == torch.bool:
            return a
        return self._op(f"(({a} > 0).to({triton_dtype(compute_dtype(a.dtype))}) - ({a} < 0).to({triton_dtype(compute_dtype(a.dtype))}))", a.dtype)

    def copysign(self, a, b):
        return self._bin("tl.where(triton_helpers.signbit({b}), tl.abs({a}) * -1.0, tl.abs({a}))", a, b)

    def signbit(self, a):
        if not a.dtype.is_floating_point:
            return self._op(f"{a} < 0", torch.bool)
        return self._op(f"triton_helpers.signbit({a})", torch.bool)

    def hypot(self, a, b): return self._bin("triton_helpers.hypot({a}, {b})", a, b)
    def atan2(self, a, b): return self._bin("triton_helpers.atan2({a}, {b})", a, b)

    # comparisons and logic
    def eq(self, a, b): return self._bin("{a} == {b}", a, b, torch.bool)
    def ne(self, a, b): return self._bin("{a} != {b}", a, b, torch.bool)
    def lt(self, a, b): return self._bin("{a} < {b}", a, b, torch.bool)
    def le(self, a, b): return self._bin("{a} <= {b}", a, b, torch.bool)
    def gt(self, a, b): return self._bin("{a} > {b}", a, b, torch.bool)
    def ge(self, a, b): return self._bin("{a} >= {b}", a, b, torch.bool)
    def logical_and(self, a, b): return self._bin("({a} != 0) & ({b} != 0)", a, b, torch.bool)
    def logical_or(self, a, b): return self._bin("({a} != 0) | ({b} != 0)", a, b, torch.bool)
    def logical_xor(self, a, b): return self._bin("({a} != 0) ^ ({b} != 0)", a, b, torch.bool)
    def logical_not(self, a): return self._op(f"{a} == 0", torch.bool)
    def bitwise_and(self, a, b): return self._bin("{a} & {b}", a, b)
    def bitwise_or(self, a, b): return self._bin("{a} | {b}", a, b)
    def bitwise_xor(self, a, b): return self._bin("{a} ^ {b}", a, b)
    def bitwise_not(self, a):
        return self._op(f"{a} == 0" if a.dtype == torch.bool else f"~{a}", a.dtype)
    def bitwise_left_shift(self, a, b): return self._bin("{a} << {b}", a, b)
    def bitwise_right_shift(self, a, b): return self._bin("{a} >> {b}", a, b)
    def isnan(self, a): return self._op(f"{a} != {a}", torch.bool)
    def isinf(self, a):
        if not a.dtype.is_floating_point:
            return self._op(f"{a} != {a}", torch.bool)
        return self._op(f"tl.abs({a}) == float(\"inf\")", torch.bool)

    # math
    def _f(self, fn, a):
        return self._op(f"{fn}({a})", a.dtype)

    def exp(self, a): return self._f("tl.exp", a)
    def exp2(self, a): return self._f("tl.exp2", a)
    def log(self, a): return self._f("tl.log", a)
    def log2(self, a): return self._f("tl.log2", a)
    def log10(self, a): return self._op(f"tl.log({a}) * 0.4342944819032518", a.dtype)
    def sqrt(self, a): return self._f("tl.sqrt", a)
    def rsqrt(self, a): return self._f("tl.rsqrt", a)
    def sin(self, a): return self._f("tl.sin", a)
    def cos(self, a): return self._f("tl.cos", a)
    def tan(self, a): return self._op(f"tl.sin({a}) / tl.cos({a})", a.dtype)
    def erf(self, a): return self._f("tl.erf", a)
    def floor(self, a): return self._f("tl.floor", a) if a.dtype.is_floating_point else a
    def ceil(self, a): return self._f("tl.ceil", a) if a.dtype.is_floating_point else a
    def reciprocal(self, a): return self._op(f"1.0 / {a}", a.dtype)
    def sigmoid(self, a): return self._f("tl.sigmoid", a)
    def tanh(self, a): return self._f("triton_helpers.tanh", a)
    def expm1(self, a): return self._f("triton_helpers.expm1", a)
    def log1p(self, a): return self._f("triton_helpers.log1p", a)
    def atan(self, a): return self._f("triton_helpers.atan", a)
    def asin(self, a): return self._f("triton_helpers.asin", a)
    def acos(self, a): return self._f("triton_helpers.acos", a)
    def sinh(self, a): return self._f("triton_helpers.sinh", a)
    def cosh(self, a): return self._f("triton_helpers.cosh", a)
    def asinh(self, a): return self._f("triton_helpers.asinh", a)
    def acosh(self, a): return self._f("triton_helpers.acosh", a)
    def atanh(self, a): return self._f("triton_helpers.atanh", a)
    def erfc(self, a): return self._f("triton_helpers.erfc", a)
    def trunc(self, a): return self._f("triton_helpers.trunc", a) if a.dtype.is_floating_point else a
    def round(self, a): return self._f("triton_helpers.round_half_even", a) if a.dtype.is_floating_point else a


def _promote(a, b) -> torch.dtype:
    da = a.dtype if isinstance(a, Var) else torch.float32
    db = b.dtype if isinstance(b, Var) else torch.float32
    return torch.promote_types(da, db)
