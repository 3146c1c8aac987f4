"""Op-correctness cases for tests/test_ops.py: one `C(...)` row per case.

A row names the aten op it exercises (`op`, an exact overload such as "aten.add.Tensor"),
the function to compile (`fn`), an input maker (`inputs`), the dtypes to run and which
input *variants* to run. `inputs(dtype)` returns {variant: args}; an args tuple may end
with a `K(...)` of static keyword arguments (dims, flags), which are baked into the
compiled function as constants rather than passed as inputs.

Parametrization (see `params()`): the first dtype runs every selected variant; each
further dtype runs the first selected variant only. So `dtypes=(f32, f16), v=("contig",
"t")` gives contig-float32, t-float32, contig-float16.

Variant names used by the shared makers:
  contig   contiguous, odd sizes (masking)       t        transposed (non-contiguous) view
  strided  slicing with steps                    bcast    broadcasting, e.g. (4,1,6) with (5,6)
  0d       0-d tensor(s)                         empty    numel-0 tensor(s)
  big      > 1024 elements (several blocks)      long     reduction rows of 5000 elements
Inputs are drawn on the host from a generator that the test seeds per parametrized case,
moved to DEVICE, and only then viewed (transposed, sliced), so their strides survive.

Adding a case: one `C(...)` row, reusing a maker (`un`, `bi`, `rd`, ...) or an inline
`lambda dt: {"variant": (args...)}`. Keep inputs small (the Triton interpreter is slow),
keep the function pure (no in-place ops on its inputs), and avoid inputs whose result
sits on a discontinuity. `op` must be the exact overload that make_fx records for `fn`
(test_declared_ops_are_exercised checks this) unless it is CompositeImplicitAutograd.
`aten=` / `aten_bw=` name the ops that commfuse runs through aten rather than lowering, in the
forward and the backward graph (the default, none: everything lowered); test_ops checks the
dumps' summaries against them, so a new lowering or a new fallback shows as a test to update.
Every parametrized case costs a compile (two with grad), so add dtypes/variants sparingly.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

DEVICE = os.environ.get("COMMFUSE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
i32, i64, b8 = torch.int32, torch.int64, torch.bool
NAN, INF = float("nan"), float("inf")


class K(dict):
    """Static keyword arguments of one variant (constants in the compiled graph)."""


@dataclass
class OpCase:
    name: str                      # id stem: "add", "gelu", "div-floor", ...
    op: str                        # aten overload exercised: "aten.add.Tensor"
    fn: Callable[..., Any]
    inputs: Callable[[torch.dtype], dict[str, tuple]]
    dtypes: tuple = (f32,)
    v: tuple | None = None         # variants to run (None: the maker's first one)
    grad: bool | tuple = False     # True: every float tensor arg; tuple: those arg positions
    atol: float | None = None      # loosened tolerances (max'ed with the dtype defaults)
    rtol: float | None = None
    check: str = "close"           # "meta": compare shape/dtype only (uninitialised memory)
    fullgraph: bool = True         # False only where dynamo must graph-break (data-dependent)
    # What commfuse runs through aten (a per-op fallback: summary.json's fallback_reasons) in the
    # forward graph and in the backward graph; () means every op is lowered. A dict gives it by
    # the first key it has of: the variant, the device type ("cpu", "cuda"), the torch version
    # ("torch 2.11": its decompositions differ), "*"; else ().
    aten: tuple | dict = ()
    aten_bw: tuple | dict = ()

    def variants(self, dtype):
        made = self.inputs(dtype)
        return made if self.v is None else {k: made[k] for k in self.v}

    def through_aten(self, variant, backward=False) -> set[str]:
        want = self.aten_bw if backward else self.aten
        if isinstance(want, dict):
            keys = (variant, torch.device(DEVICE).type, "torch " + ".".join(torch.__version__.split(".")[:2]), "*")
            want = next((want[k] for k in keys if k in want), ())
        return set(want)


C = OpCase

# ----------------------------------------------------------------------------- inputs

_gen = torch.Generator().manual_seed(0)


def seed(n: int) -> None:
    _gen.manual_seed(n)


def _dev(x: torch.Tensor) -> torch.Tensor:
    return x.to(DEVICE)


def R(*shape, dt=f32, lo=-3.0, hi=3.0, nz=False, ints=False, p=0.5):
    """Seeded random tensor on DEVICE. Floats: uniform in [lo, hi) (integer-valued with
    ints=True; magnitude >= 0.25 with nz=True). Integers: in [ceil(lo), ceil(hi)), never 0
    with nz=True. Bool: True with probability p."""
    if dt == b8:
        return _dev(torch.rand(shape, generator=_gen) < p)
    if dt.is_floating_point and not ints:
        x = torch.rand(shape, generator=_gen, dtype=f64) * (hi - lo) + lo
        if nz:
            x = torch.where(x.abs() < 0.25, torch.where(x < 0, x - 0.25, x + 0.25), x)
        return _dev(x.to(dt))
    ilo = math.ceil(lo)
    ihi = max(math.ceil(hi), ilo + 1)
    x = torch.randint(ilo, ihi, shape, generator=_gen, dtype=i64)
    if nz:
        x = torch.where(x == 0, torch.ones_like(x), x)
    return _dev(x.to(dt))


def S(*shape, dt=f32):
    """Random values with about a third replaced by nan, +-inf, 0.0 and -0.0."""
    x = torch.rand(shape, generator=_gen, dtype=f64) * 6 - 3
    pick = torch.randint(0, 12, shape, generator=_gen)
    specials = torch.tensor([NAN, INF, -INF, 0.0, -0.0], dtype=f64)
    x = torch.where(pick < 5, specials[pick.clamp(max=4)], x)
    return _dev(x.to(dt))


def I(hi, *shape, lo=0):
    """int64 indices in [lo, hi)."""
    return _dev(torch.randint(lo, hi, shape, generator=_gen))


def U(n, rows, k):
    """(rows, k) int64 indices, distinct within each row, from range(n)."""
    return _dev(torch.rand(rows, n, generator=_gen).argsort(1)[:, :k])


def P(*shape, dt=f32):
    """Distinct values (a scaled random permutation): no ties for sort/topk/argmax."""
    n = math.prod(shape)
    perm = torch.randperm(n, generator=_gen).reshape(shape)
    if not dt.is_floating_point:
        return _dev((perm - n // 2).to(dt))
    return _dev((perm.to(f64) * (6.0 / max(n, 1)) - 3).to(dt))


def un(lo=-3.0, hi=3.0, **kw):
    """Unary inputs."""
    def make(dt):
        r = lambda *s: R(*s, dt=dt, lo=lo, hi=hi, **kw)
        return {"contig": (r(5, 37),), "t": (r(37, 6).t(),), "strided": (r(9, 50)[::2, 1::3],),
                "0d": (r(),), "empty": (r(0, 7),), "big": (r(3000),)}
    return make


def sp():
    """Unary inputs containing nan/inf/+-0."""
    def make(dt):
        if not dt.is_floating_point:
            return un()(dt)
        return {"contig": (S(5, 37, dt=dt),), "t": (S(37, 6, dt=dt).t(),), "0d": (S(dt=dt),)}
    return make


def bi(lo=-3.0, hi=3.0, lo2=None, hi2=None, dt2=None, **kw2):
    """Binary inputs; the second operand may have its own range/dtype/nz."""
    lo2 = lo if lo2 is None else lo2
    hi2 = hi if hi2 is None else hi2

    def make(dt):
        a = lambda *s: R(*s, dt=dt, lo=lo, hi=hi, ints=kw2.get("ints", False))
        b = lambda *s: R(*s, dt=dt2 or dt, lo=lo2, hi=hi2, **kw2)
        return {"contig": (a(5, 37), b(5, 37)), "bcast": (a(4, 1, 6), b(5, 6)),
                "t": (a(37, 6).t(), b(6, 37)), "strided": (a(10, 40)[::2, ::3], b(14, 5).t()),
                "0d": (a(4, 9), b()), "empty": (a(0, 6), b(1, 6))}
    return make


def cmp_():
    """Binary inputs with many equal elements (integer-valued floats)."""
    return bi(-2, 3, ints=True)


def lg():
    """Operands for logical ops: floats from {-1, 0, 1}, or bools."""
    return bi(-1, 2, ints=True)


def tern(lo=-3.0, hi=3.0, lo3=None, hi3=None, nz3=False):
    """Three operands (addcmul, addcdiv, lerp)."""
    lo3 = lo if lo3 is None else lo3
    hi3 = hi if hi3 is None else hi3

    def make(dt):
        r = lambda *s: R(*s, dt=dt, lo=lo, hi=hi)
        r3 = lambda *s: R(*s, dt=dt, lo=lo3, hi=hi3, nz=nz3)
        return {"contig": (r(5, 37), r(5, 37), r3(5, 37)), "bcast": (r(4, 1, 6), r(5, 6), r3(6)),
                "t": (r(37, 6).t(), r(6, 37), r3(37, 6).t())}
    return make


def whr():
    """where(cond, a, b) operands."""
    def make(dt):
        return {"bcast": (R(4, 1, 6, dt=b8), R(5, 6, dt=dt), R(4, 5, 1, dt=dt)),
                "t": (R(6, 9, dt=b8).t(), R(9, 6, dt=dt), R(6, 9, dt=dt).t()),
                "0d": (R(dt=b8), R(3, 4, dt=dt), R(dt=dt))}
    return make


def mk(**shapes):
    """Named variants of a single random tensor: mk(contig=(4, 6), t=((6, 4), "t"))."""
    def make(dt):
        out = {}
        for name, spec in shapes.items():
            if isinstance(spec, tuple) and len(spec) == 2 and spec[1] == "t":
                out[name] = (R(*spec[0], dt=dt).transpose(-1, -2),)
            else:
                out[name] = (R(*spec, dt=dt),)
        return out
    return make


def rd(lo=-3.0, hi=3.0, p=0.5, ints=False, irange=None):
    """Reduction inputs: each variant is (x, K(dim=..., keepdim=...)). Integer dtypes draw
    from `irange` when given."""
    def make(dt):
        l, h = irange if irange and not dt.is_floating_point else (lo, hi)
        r = lambda *s: R(*s, dt=dt, lo=l, hi=h, p=p, ints=ints)
        x = r(4, 6, 9)
        nanx = torch.where(R(4, 6, 9, p=0.1, dt=b8), NAN, x) if dt.is_floating_point else x
        return {"all": (x, K(dim=None)), "d0": (x, K(dim=0)), "last_keep": (x, K(dim=-1, keepdim=True)),
                "multi": (x, K(dim=(0, 2))), "neg": (x, K(dim=-2)), "long": (r(2, 5000), K(dim=1)),
                "t": (r(9, 6).t(), K(dim=1)), "0d": (r(), K(dim=0)), "empty": (r(0, 5), K(dim=1)),
                "empty0": (r(0, 5), K(dim=0)), "nan": (nanx, K(dim=-1))}
    return make


def full_dims(x, dim):
    return tuple(range(x.dim())) if dim is None else dim


def smx(lo=-3.0, hi=3.0):
    """Softmax-like inputs: each variant is (x, K(dim=...))."""
    def make(dt):
        r = lambda *s: R(*s, dt=dt, lo=lo, hi=hi)
        return {"last": (r(4, 7, 33), K(dim=-1)), "d0": (r(4, 7, 33), K(dim=0)),
                "long": (r(2, 5000), K(dim=-1)), "t": (r(33, 5).t(), K(dim=1)), "0d": (r(), K(dim=0))}
    return make


def mm_(*shapes, lo=-1.0, hi=1.0, tr=()):
    """Matmul operands, contig plus a variant with the operands at positions `tr` transposed."""
    def make(dt):
        out = {"contig": tuple(R(*s, dt=dt, lo=lo, hi=hi) for s in shapes)}
        if tr:
            out["t"] = tuple(R(*s[:-2], s[-1], s[-2], dt=dt, lo=lo, hi=hi).transpose(-1, -2) if i in tr
                             else R(*s, dt=dt, lo=lo, hi=hi) for i, s in enumerate(shapes))
        return out
    return make


# ----------------------------------------------------------------------------- cases

def _round_halves(dt):
    return {"halves": (_dev((torch.arange(-12, 13, dtype=f64) * 0.5).to(dt)),), "contig": un(-20, 20)(dt)["contig"]}


def _round_dec(dt):
    # values k/1000 + 3e-4: x*100 stays >= 0.03 away from a .5 rounding boundary
    return {"contig": (_dev((torch.randint(-3000, 3000, (5, 37), generator=_gen, dtype=f64) / 1000 + 3e-4).to(dt)),)}


def _cast_src(dt):
    # integer-valued and fractional values in (-100, 100) with zeros, for float->int/bool casts
    x = R(6, 35, dt=f64, lo=-100, hi=100)
    x = torch.where(R(6, 35, dt=b8, p=0.2), 0.0, x)
    x = torch.where(R(6, 35, dt=b8, p=0.2), x.round(), x)
    if dt == b8:
        return {"contig": (x != 0,), "t": ((x != 0).t(),), "0d": (x[0, 0] != 0,), "empty": (x[:0] != 0,)}
    if not dt.is_floating_point:
        x = x.trunc()
    x = x.to(dt)
    return {"contig": (x,), "t": (x.t(),), "0d": (x[0, 0].clone(),), "empty": (x[:0],)}


def _xlogy(dt):
    x = torch.where(R(5, 37, dt=b8, p=0.2), 0.0, R(5, 37, lo=-2, hi=3)).to(dt)
    return {"contig": (x, R(5, 37, dt=dt, lo=0.1, hi=4)), "bcast": (R(4, 1, 6, dt=dt), R(5, 6, dt=dt, lo=0.1, hi=4))}


def _mask2(dt):
    return {"bcast": (R(5, 6, dt=dt), R(4, 1, 6, dt=b8)), "t": (R(9, 5, dt=dt).t(), R(5, 9, dt=b8)),
            "contig": (R(5, 37, dt=dt), R(5, 37, dt=b8))}


def _clamp_t(dt):
    lo_ = R(5, 1, dt=dt, lo=-2, hi=0)
    return {"bcast": (R(5, 6, dt=dt), lo_, R(6, dt=dt, lo=0.5, hi=2)),
            "t": (R(6, 5, dt=dt).t(), R(5, 6, dt=dt, lo=-2, hi=0), R(6, 5, dt=dt, lo=0.5, hi=2).t())}


def _shift(dt):
    return {"contig": (R(5, 37, dt=dt, lo=-100, hi=100), R(5, 37, dt=dt, lo=0, hi=8)),
            "bcast": (R(4, 1, 6, dt=dt, lo=-100, hi=100), R(5, 6, dt=dt, lo=0, hi=8))}


def _promo(dt):
    # dt is the dtype of the first operand; the second one has another dtype
    return {"i32_f32": (R(5, 7, dt=i32), R(5, 7, dt=f32)), "f16_0d_f32": (R(5, 7, dt=f16), R(dt=f32)),
            "bool_i64": (R(5, 7, dt=b8), R(5, 7, dt=i64)), "bf16_f16": (R(5, 7, dt=bf16), R(5, 7, dt=f16)),
            "i64_0d_f16": (R(5, 7, dt=i64), R(dt=f16))}


def _norm_in(dt):
    x = R(4, 7, 33, dt=dt)
    return {"contig": (x, R(33, dt=dt, lo=0.5, hi=1.5), R(33, dt=dt)),
            "long": (R(2, 5000, dt=dt), R(5000, dt=dt, lo=0.5, hi=1.5), R(5000, dt=dt)),
            "t": (R(33, 4, dt=dt).t(), R(33, dt=dt, lo=0.5, hi=1.5), R(33, dt=dt))}


def _bn(dt):
    return {"contig": (R(4, 6, 5, dt=dt), R(6, dt=dt), R(6, dt=dt, lo=0.5, hi=2), R(6, dt=dt, lo=0.5, hi=1.5), R(6, dt=dt)),
            "4d": (R(2, 6, 3, 4, dt=dt), R(6, dt=dt), R(6, dt=dt, lo=0.5, hi=2), R(6, dt=dt, lo=0.5, hi=1.5), R(6, dt=dt))}


def _gn(dt):
    return {"contig": (R(2, 6, 5, 4, dt=dt), R(6, dt=dt, lo=0.5, hi=1.5), R(6, dt=dt)),
            "3d": (R(3, 6, 7, dt=dt), R(6, dt=dt, lo=0.5, hi=1.5), R(6, dt=dt))}


def _views(dt):
    return {"contig": (R(4, 6, 5, dt=dt),), "t": (R(5, 6, 4, dt=dt).permute(2, 1, 0),)}


def _cat(dt):
    return {"d1": (R(4, 3, dt=dt), R(4, 5, dt=dt), K(dim=1)),
            "d0_t": (R(3, 4, dt=dt).t(), R(6, 3, dt=dt), K(dim=0)),
            "empty": (R(0, 5, dt=dt), R(4, 5, dt=dt), K(dim=0)),
            "promo": (R(4, 3, dt=dt), R(4, 2, dt=i32), K(dim=-1))}


def _stack(dt):
    return {"d0": (R(4, 5, dt=dt), R(4, 5, dt=dt), K(dim=0)), "dlast": (R(4, 5, dt=dt), R(5, 4, dt=dt).t(), K(dim=-1))}


def _idx(dt):
    x = R(7, 5, 6, dt=dt)
    return {"1d": (x, I(7, 4)), "neg": (x, I(7, 2, 3, lo=-7)), "t": (R(6, 7, dt=dt).t(), I(6, 5))}


def _scatter_src(dt):
    return {"d1": (R(4, 10, dt=dt), U(10, 4, 5), R(4, 5, dt=dt), K(dim=1)),
            "d0": (R(10, 4, dt=dt), U(10, 4, 5).t(), R(5, 4, dt=dt), K(dim=0))}


def _scatter_row(dt):
    """One index per row along dim (cross entropy's one-hot): lowered pointwise."""
    return {"d1": (R(6, 10, dt=dt), I(10, 6, 1), R(6, 1, dt=dt), K(dim=1)),
            "d0": (R(10, 6, dt=dt), I(10, 1, 6), R(1, 6, dt=dt), K(dim=0))}


def _scatter_dup(dt):
    return {"d1": (R(4, 10, dt=dt), I(10, 4, 8), R(4, 8, dt=dt), K(dim=1)),
            "d0": (R(6, 5, dt=dt), I(6, 9, 5), R(9, 5, dt=dt), K(dim=0))}


def _index_add(dt):
    return {"d0": (R(8, 6, dt=dt), I(8, 11), R(11, 6, dt=dt), K(dim=0)),
            "d1": (R(5, 8, dt=dt), I(8, 3), R(5, 3, dt=dt), K(dim=1))}


def _put(dt):
    return {"unique": (R(8, 6, dt=dt), U(8, 1, 5)[0], R(5, 6, dt=dt)),
            "bcast": (R(8, 6, dt=dt), U(8, 1, 3)[0], R(6, dt=dt))}


def _put_acc(dt):
    return {"dup": (R(8, 6, dt=dt), I(8, 12), R(12, 6, dt=dt)),
            "bcast": (R(8, 6, dt=dt), I(8, 5), R(6, dt=dt))}


def _conv1d(dt):
    return {"contig": (R(2, 4, 20, dt=dt), R(6, 4, 3, dt=dt, lo=-0.5, hi=0.5), R(6, dt=dt))}


def _conv2d(dt):
    return {"contig": (R(2, 3, 10, 9, dt=dt), R(4, 3, 3, 3, dt=dt, lo=-0.5, hi=0.5), R(4, dt=dt))}


def _pool(dt):
    return {"contig": (R(2, 3, 10, 9, dt=dt),), "t": (R(2, 3, 9, 10, dt=dt).transpose(-1, -2),)}


def _ce(dt):
    return {"contig": (R(6, 10, dt=dt), I(10, 6)), "nd": (R(2, 5, 4, 3, dt=dt), I(5, 2, 4, 3))}


def _nll(dt):
    return {"contig": (torch.log_softmax(R(6, 10, dt=dt), -1), I(10, 6), R(10, dt=dt, lo=0.2, hi=2))}


# Shorthand for common lambdas.
def red(f):
    """sum-style reduction taking (x, dim, keepdim)."""
    return lambda x, dim, keepdim=False: f(x, dim, keepdim=keepdim)


FL = (f32,)

CASES: list[OpCase] = [
    # ---- unary math --------------------------------------------------------------------------
    C("abs", "aten.abs.default", torch.abs, un(), (f32, i32), v=("contig", "0d"), grad=True),
    C("neg", "aten.neg.default", torch.neg, un(), (f32, i64), v=("strided",), grad=True),
    C("exp", "aten.exp.default", torch.exp, un(), (f32, f16), v=("big",), grad=True),
    C("exp2", "aten.exp2.default", torch.exp2, un(), FL, grad=True),
    C("expm1", "aten.expm1.default", torch.expm1, un(), FL, grad=True),
    C("log", "aten.log.default", torch.log, un(0.05, 5), (f32, f16), v=("t",), grad=True),
    C("log2", "aten.log2.default", torch.log2, un(0.05, 5), FL, grad=True),
    C("log10", "aten.log10.default", torch.log10, un(0.05, 5), FL, grad=True),
    C("log1p", "aten.log1p.default", torch.log1p, un(-0.9, 3), FL, v=("contig", "empty"), grad=True),
    C("sqrt", "aten.sqrt.default", torch.sqrt, un(0.05, 5), (f32, i64), grad=True),
    C("rsqrt", "aten.rsqrt.default", torch.rsqrt, un(0.1, 5), FL, grad=True),
    C("sin", "aten.sin.default", torch.sin, un(-6, 6), (f32, f16), v=("t",), grad=True),
    C("cos", "aten.cos.default", torch.cos, un(-6, 6), FL, grad=True),
    C("tan", "aten.tan.default", torch.tan, un(-1.3, 1.3), FL, grad=True),
    C("asin", "aten.asin.default", torch.asin, un(-0.95, 0.95), FL, grad=True),
    C("acos", "aten.acos.default", torch.acos, un(-0.95, 0.95), FL, grad=True),
    C("atan", "aten.atan.default", torch.atan, un(-5, 5), FL, v=("strided",), grad=True),
    C("sinh", "aten.sinh.default", torch.sinh, un(), FL, grad=True),
    C("cosh", "aten.cosh.default", torch.cosh, un(), FL, grad=True),
    C("tanh", "aten.tanh.default", torch.tanh, un(), (f32, bf16), v=("strided",), grad=True),
    C("asinh", "aten.asinh.default", torch.asinh, un(-5, 5), FL, grad=True),
    C("acosh", "aten.acosh.default", torch.acosh, un(1.05, 5), FL, grad=True),
    C("atanh", "aten.atanh.default", torch.atanh, un(-0.9, 0.9), FL, grad=True, aten_bw=("aten.empty_permuted.default",)),
    C("sigmoid", "aten.sigmoid.default", torch.sigmoid, un(-8, 8), (f32, bf16), v=("contig", "empty"), grad=True),
    C("erf", "aten.erf.default", torch.erf, un(), (f32, f16), grad=True),
    C("erfc", "aten.erfc.default", torch.erfc, un(), FL, grad=True),
    C("erfinv", "aten.erfinv.default", torch.erfinv, un(-0.95, 0.95), FL, grad=True, aten=("aten.erfinv.default",), aten_bw=("aten.erfinv.default",)),
    C("lgamma", "aten.lgamma.default", torch.lgamma, un(0.1, 6), FL, grad=True, aten=("aten.lgamma.default",), aten_bw=("aten.digamma.default",)),
    C("floor", "aten.floor.default", torch.floor, un(-20, 20), (f32, i32)),
    C("ceil", "aten.ceil.default", torch.ceil, un(-20, 20), FL),
    C("round", "aten.round.default", torch.round, _round_halves, (f32, f16), v=("halves",)),
    C("round-decimals", "aten.round.decimals", lambda x: torch.round(x, decimals=2), _round_dec, aten=("aten.round.decimals",)),
    C("trunc", "aten.trunc.default", torch.trunc, un(-20, 20), FL),
    C("frac", "aten.frac.default", torch.frac, un(-20, 20), FL, grad=True),
    C("sign", "aten.sign.default", torch.sign, sp(), (f32, i32)),
    C("sgn", "aten.sgn.default", torch.sgn, un(ints=True), FL),
    C("reciprocal", "aten.reciprocal.default", torch.reciprocal, un(nz=True), (f32, i32), grad=True),
    C("square", "aten.square.default", torch.square, un(), FL, grad=True),
    C("relu", "aten.relu.default", torch.relu, un(), (f32, f16), v=("t",), grad=True),
    C("gelu", "aten.gelu.default", lambda x: (F.gelu(x), F.gelu(x, approximate="tanh")), un(-5, 5), (f32, bf16), grad=True),
    C("silu", "aten.silu.default", F.silu, un(-6, 6), (f32, bf16), grad=True),
    C("mish", "aten.mish.default", F.mish, un(-6, 6), FL, grad=True),
    C("softplus", "aten.softplus.default", lambda x: F.softplus(x, beta=2, threshold=4), un(), FL, v=("t",), grad=True),
    C("hardtanh", "aten.hardtanh.default", lambda x: F.hardtanh(x, -1.5, 2.0), un(), FL, grad=True),
    C("hardsigmoid", "aten.hardsigmoid.default", F.hardsigmoid, un(-5, 5), FL, grad=True),
    C("hardswish", "aten.hardswish.default", F.hardswish, un(-5, 5), FL, grad=True),
    C("leaky_relu", "aten.leaky_relu.default", lambda x: F.leaky_relu(x, 0.1), un(), FL, grad=True),
    C("elu", "aten.elu.default", lambda x: F.elu(x, alpha=1.5), un(), FL, grad=True),
    C("celu", "aten.celu.default", lambda x: F.celu(x, alpha=0.7), un(), FL, grad=True),
    C("selu", "aten.selu.default", F.selu, un(), FL, grad=True),
    C("logit", "aten.logit.default", torch.logit, un(0.02, 0.98), FL, grad=True),
    C("log_sigmoid", "aten.log_sigmoid_forward.default", F.logsigmoid, un(-8, 8), FL, grad=True),
    C("threshold", "aten.threshold.default", lambda x: F.threshold(x, 0.5, -2.0), un(), FL, grad=True),
    C("nan_to_num", "aten.nan_to_num.default", lambda x: (torch.nan_to_num(x), torch.nan_to_num(x, nan=0.5, posinf=10.0, neginf=-10.0)), sp(), (f32, f16), v=("contig",)),
    C("isnan", "aten.isnan.default", torch.isnan, sp(), (f32, i32), v=("t",)),
    C("isinf", "aten.isinf.default", torch.isinf, sp(), (bf16,)),
    C("isfinite", "aten.isfinite.default", torch.isfinite, sp(), FL),
    C("signbit", "aten.signbit.default", torch.signbit, sp(), FL),
    C("bitwise_not", "aten.bitwise_not.default", torch.bitwise_not, un(-50, 50), (i32, b8), v=("t",)),
    C("logical_not", "aten.logical_not.default", torch.logical_not, un(-1, 2, ints=True), (f32, b8)),

    # ---- binary / scalar arithmetic ------------------------------------------------------------
    C("add", "aten.add.Tensor", torch.add, bi(), (f32, f16, i64), v=("bcast", "t", "0d"), grad=True),
    C("add-alpha", "aten.add.Tensor", lambda a, b: torch.add(a, b, alpha=2), bi(), (i32,), v=("strided",), grad=True),
    C("add-scalar", "aten.add.Tensor", lambda x: x + 2.5, un(), (f32, i64), v=("0d",), grad=True),
    C("add-promo", "aten.add.Tensor", torch.add, _promo, v=("i32_f32", "f16_0d_f32", "bool_i64", "i64_0d_f16")),
    C("sub", "aten.sub.Tensor", lambda a, b: torch.sub(a, b, alpha=2), bi(), (f32, bf16), v=("contig",), grad=True),
    C("rsub", "aten.rsub.Scalar", lambda x: 5 - x, un(), FL, grad=True),
    C("mul", "aten.mul.Tensor", torch.mul, bi(), (f32, b8), v=("bcast", "empty"), grad=True),
    C("mul-scalar", "aten.mul.Tensor", lambda x: x * 1.5, un(), (f32, i32), grad=True),
    C("div", "aten.div.Tensor", torch.div, bi(nz=True), (f32, i64), v=("bcast", "0d"), grad=True),
    C("div-scalar", "aten.div.Tensor", lambda x: x / 3, un(), (i32,)),
    C("div-floor", "aten.div.Tensor_mode", lambda a, b: torch.div(a, b, rounding_mode="floor"), bi(-20, 20, nz=True), (f32, i64), v=("bcast",)),
    C("div-trunc", "aten.div.Tensor_mode", lambda a, b: torch.div(a, b, rounding_mode="trunc"), bi(-20, 20, nz=True), (f32, i32), v=("t",)),
    C("remainder", "aten.remainder.Tensor", torch.remainder, bi(-20, 20, nz=True), (f32, i64), v=("bcast",)),
    C("fmod", "aten.fmod.Tensor", torch.fmod, bi(-20, 20, nz=True), (f32, i32), v=("contig",)),
    C("pow", "aten.pow.Tensor_Tensor", torch.pow, bi(0.1, 3, -2, 2), (f32, f16), v=("bcast",), grad=True),
    C("pow-int", "aten.pow.Tensor_Tensor", torch.pow, bi(-3, 4, 0, 5), (i64,), aten=("aten.pow.Tensor_Tensor",)),
    C("pow-sq", "aten.pow.Tensor_Scalar", lambda x: x ** 2, un(), (f32, i32), grad=True),
    C("pow-frac", "aten.pow.Tensor_Scalar", lambda x: x ** 0.5 + x ** -1.5 + x ** 3, un(0.2, 3), FL, v=("t",), grad=True),
    # small integral exponents: multiplications (a reciprocal for negative ones), as eager on nan/inf/-0
    C("pow-small-int", "aten.pow.Tensor_Scalar", lambda x: (x ** 3.0, x ** -2, x ** 4, x ** -1, x ** 0, x ** 1),
      sp(), (f32, bf16), v=("contig", "t"), grad=True),
    C("pow-int-exact", "aten.pow.Tensor_Scalar", lambda x: (x ** 3, x ** 0, x ** 5, x ** 2.0), un(-9, 10), (i64, i32)),
    C("pow-scalar-base", "aten.pow.Scalar", lambda x: 2.0 ** x, un(), FL, grad=True),
    C("atan2", "aten.atan2.default", torch.atan2, bi(), FL, v=("bcast",), grad=True),
    C("maximum", "aten.maximum.default", torch.maximum, bi(), (f32, i32), v=("bcast",), grad=True),
    C("maximum-nan", "aten.maximum.default", torch.maximum, lambda dt: {"contig": (S(5, 37, dt=dt), S(5, 37, dt=dt))}, FL),
    C("minimum", "aten.minimum.default", torch.minimum, bi(), (f32, i64), v=("t",), grad=True),
    C("fmax", "aten.fmax.default", torch.fmax, lambda dt: {"contig": (S(5, 37, dt=dt), S(5, 37, dt=dt))}, FL),
    C("fmin", "aten.fmin.default", torch.fmin, lambda dt: {"bcast": (S(4, 1, 6, dt=dt), S(5, 6, dt=dt))}, (f32,)),
    C("hypot", "aten.hypot.default", torch.hypot, bi(), FL, v=("bcast",), grad=True),
    C("copysign", "aten.copysign.Tensor", torch.copysign, lambda dt: {"contig": (R(5, 37, dt=dt), S(5, 37, dt=dt))}, FL, grad=(0,)),
    C("floor_divide", "aten.floor_divide.default", torch.floor_divide, bi(-20, 20, nz=True), FL),
    C("eq", "aten.eq.Tensor", torch.eq, cmp_(), (f32, i64, b8), v=("bcast",)),
    C("ne", "aten.ne.Tensor", torch.ne, cmp_(), (f32, bf16), v=("t",)),
    C("lt", "aten.lt.Tensor", torch.lt, cmp_(), FL, v=("contig",)),
    C("le", "aten.le.Tensor", torch.le, cmp_(), FL),
    C("gt", "aten.gt.Tensor", torch.gt, cmp_(), FL, v=("bcast",)),
    C("ge", "aten.ge.Tensor", torch.ge, cmp_(), (f32, b8), v=("strided",)),
    C("eq-scalar", "aten.eq.Scalar", lambda x: x == 1, un(-2, 3, ints=True), (f32, i32)),
    C("gt-scalar", "aten.gt.Scalar", lambda x: x > 0.5, un(), FL),
    C("logical_and", "aten.logical_and.default", torch.logical_and, lg(), (b8, f32), v=("bcast",)),
    C("logical_or", "aten.logical_or.default", torch.logical_or, lg(), (b8,)),
    C("logical_xor", "aten.logical_xor.default", torch.logical_xor, lg(), (f32,), v=("bcast",)),
    C("bitwise_and", "aten.bitwise_and.Tensor", torch.bitwise_and, bi(-100, 100), (i32, b8), v=("bcast",)),
    C("bitwise_or", "aten.bitwise_or.Tensor", torch.bitwise_or, bi(-100, 100), (i64,)),
    C("bitwise_xor", "aten.bitwise_xor.Tensor", torch.bitwise_xor, bi(-100, 100), (b8,), v=("t",)),
    C("left_shift", "aten.bitwise_left_shift.Tensor", torch.bitwise_left_shift, _shift, (i32, i64), v=("bcast",)),
    C("right_shift", "aten.bitwise_right_shift.Tensor", torch.bitwise_right_shift, _shift, (i32, i64)),
    C("lerp", "aten.lerp.Scalar", lambda a, b: torch.lerp(a, b, 0.3), bi(), (f32, bf16), v=("bcast",), grad=True),
    C("lerp-tensor", "aten.lerp.Tensor", torch.lerp, tern(lo3=0, hi3=1), FL, v=("bcast",), grad=True, aten_bw=("aten.empty_permuted.default",)),
    C("xlogy", "aten.xlogy.Tensor", torch.xlogy, _xlogy, FL, v=("contig",), grad=True),
    C("addcmul", "aten.addcmul.default", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), tern(), FL, v=("bcast",), grad=True),
    C("addcdiv", "aten.addcdiv.default", lambda a, b, c: torch.addcdiv(a, b, c, value=-2), tern(nz3=True), FL, v=("t",), grad=True),
    C("where", "aten.where.self", torch.where, whr(), (f32, i64), v=("bcast", "t", "0d"), grad=(1, 2)),
    C("where-scalar", "aten.where.self", lambda c, x: torch.where(c, x, 0.0), lambda dt: {"bcast": (R(4, 1, 6, dt=b8), R(5, 6, dt=dt))}, (f32, i32), grad=(1,)),
    C("clamp", "aten.clamp.default", lambda x: torch.clamp(x, -1, 2), un(), (f32, i32), v=("contig",), grad=True),
    C("clamp-tensor", "aten.clamp.Tensor", torch.clamp, _clamp_t, FL, v=("bcast",), grad=True),
    C("clamp_min", "aten.clamp_min.default", lambda x: torch.clamp_min(x, 0.5), un(), (f32, i64), grad=True),
    C("clamp_max", "aten.clamp_max.default", lambda x: torch.clamp_max(x, -0.5), un(), FL, grad=True),
    C("clamp_min-tensor", "aten.clamp_min.Tensor", torch.clamp_min, bi(), FL, v=("bcast",), grad=True),
    C("masked_fill", "aten.masked_fill.Scalar", lambda x, m: x.masked_fill(m, -1.5), _mask2, (f32, bf16), v=("bcast",), grad=(0,)),
    C("masked_fill-tensor", "aten.masked_fill.Tensor", lambda x, m, v: x.masked_fill(m, v), lambda dt: {"contig": (R(5, 37, dt=dt), R(5, 37, dt=b8), R(dt=dt))}, FL, grad=(0, 2)),

    # ---- casts ---------------------------------------------------------------------------------
    C("to_int32", "aten._to_copy.default", lambda x: x.to(i32), _cast_src, (f32, f16, i64), v=("t",)),
    C("to_int64", "aten._to_copy.default", lambda x: x.long(), _cast_src, (f32, b8)),
    C("to_float16", "aten._to_copy.default", lambda x: x.half(), _cast_src, (f32, i32), v=("0d",)),
    C("to_bfloat16", "aten._to_copy.default", lambda x: x.to(bf16), _cast_src, (f32, f16)),
    C("to_float32", "aten._to_copy.default", lambda x: x.float(), _cast_src, (i64, b8, bf16), v=("contig", "empty")),
    C("to_bool", "aten._to_copy.default", lambda x: x.bool(), _cast_src, (f32, i32), v=("t",)),
    C("to_float32-grad", "aten._to_copy.default", lambda x: x.float() * 2, _cast_src, (bf16,), grad=True),

    # ---- creation ------------------------------------------------------------------------------
    C("full", "aten.full.default", lambda x: (torch.full((3, 5), 3, dtype=x.dtype, device=x.device), x + torch.full((37,), 2, dtype=x.dtype, device=x.device)), un(), (f32, b8)),
    C("zeros", "aten.zeros.default", lambda x: (torch.zeros(4, 3, dtype=x.dtype, device=x.device), torch.zeros((), device=x.device) + x), un(), FL),
    C("ones", "aten.ones.default", lambda x: (torch.ones(2, 7, dtype=x.dtype, device=x.device), x - torch.ones(x.shape[-1], device=x.device)), un(), FL),
    C("arange", "aten.arange.default", lambda x: torch.arange(37, device=x.device) * x, un(), (f32, i64)),
    C("arange-step", "aten.arange.start_step",
      lambda x: (torch.arange(2, 40, 3, device=x.device), torch.arange(-1.0, 1.0, 0.125, device=x.device, dtype=x.dtype),
                 torch.arange(5, 0, -1, dtype=i32, device=x.device)), un(), FL),
    C("full_like", "aten.full_like.default", lambda x: torch.full_like(x, 7) + torch.full_like(x, 0.5, dtype=f32), un(), FL, v=("t",)),
    C("zeros_like", "aten.zeros_like.default", lambda x: (torch.zeros_like(x), torch.zeros_like(x, dtype=b8)), un(), FL, v=("t",)),
    C("ones_like", "aten.ones_like.default", lambda x: torch.ones_like(x) + x, un(), FL),
    C("empty_like", "aten.empty_like.default", lambda x: (torch.empty_like(x), torch.empty_like(x, dtype=i32)), un(), FL, v=("t",), check="meta", aten=("aten.empty_permuted.default",)),
    C("empty", "aten.empty.memory_format", lambda x: torch.empty(3, 4, dtype=x.dtype, device=x.device), un(), FL, check="meta"),
    C("new_zeros", "aten.new_zeros.default", lambda x: (x.new_zeros(3, 2), x.new_ones(4) + 1), un(), FL),
    C("new_full", "aten.new_full.default", lambda x: x.new_full((2, 3), 4) * x[0, :3], un(), FL),
    C("scalar_tensor", "aten.scalar_tensor.default", lambda x: torch.where(x > 0, x, torch.scalar_tensor(-2.0, device=x.device)), un(), FL),
    C("eye", "aten.eye.m", lambda x: torch.eye(5, 7, dtype=x.dtype, device=x.device) + x[:5, :7], un(), FL),
    C("linspace", "aten.linspace.default", lambda x: torch.linspace(-2, 3, 37, device=x.device) * x, un(), FL),

    # ---- reductions ----------------------------------------------------------------------------
    C("sum", "aten.sum.dim_IntList", red(torch.sum), rd(), (f32, bf16, i32, b8), v=("all", "multi", "long", "t", "empty0"), grad=True, atol=1e-4, rtol=1e-4),
    C("sum-default", "aten.sum.default", lambda x: x.sum(), un(), (f32, i64), v=("big",), grad=True, atol=1e-4, rtol=1e-4),
    C("mean", "aten.mean.dim", red(torch.mean), rd(), (f32, bf16), v=("all", "long"), grad=True, atol=1e-4, rtol=1e-4),
    C("nansum", "aten.nansum.default", red(torch.nansum), rd(), FL, v=("nan",), atol=1e-4, rtol=1e-4),
    C("prod", "aten.prod.dim_int", red(torch.prod), rd(0.5, 1.5, irange=(-2, 3)), (f32, i64), v=("last_keep", "empty0"), grad=True, atol=1e-4, rtol=1e-4, aten_bw={"last_keep": ("aten.cumprod.default",)}),
    C("prod-all", "aten.prod.default", torch.prod, lambda dt: {"contig": (R(5, 7, dt=dt, lo=0.7, hi=1.3) if dt.is_floating_point else R(3, 4, dt=dt, lo=-2, hi=3, nz=True),)}, (f32, i32), grad=True, atol=1e-4, rtol=1e-4, aten_bw=("aten.cumprod.default",)),
    C("amax", "aten.amax.default", lambda x, dim, keepdim=False: torch.amax(x, () if dim is None else dim, keepdim), rd(), (f32, i32), v=("multi", "long", "nan"), grad=True),
    C("amin", "aten.amin.default", lambda x, dim, keepdim=False: torch.amin(x, () if dim is None else dim, keepdim), rd(), FL, v=("last_keep", "empty"), grad=True),
    C("max-dim", "aten.max.dim", red(torch.max), rd(), (f32, i32), v=("d0", "long", "t"), grad=True),
    C("min-dim", "aten.min.dim", red(torch.min), rd(), (f32, bf16), v=("neg",), grad=True),
    C("max-all", "aten.max.default", lambda x: x.max(), un(), FL, v=("big",)),
    C("min-all", "aten.min.default", lambda x: x.min(), sp(), FL),
    C("argmax", "aten.argmax.default", red(torch.argmax), rd(), (f32, i32), v=("all", "long", "nan")),
    C("argmin", "aten.argmin.default", red(torch.argmin), rd(), FL, v=("neg",)),
    C("aminmax", "aten.aminmax.default", lambda x, dim, keepdim=False: torch.aminmax(x, dim=dim, keepdim=keepdim), rd(), FL, v=("d0",)),
    C("var", "aten.var.correction", lambda x, dim, keepdim=False: (torch.var(x, dim, keepdim=keepdim), torch.var(x, dim, correction=0, keepdim=keepdim)), rd(), FL, v=("all", "long", "t"), grad=True, atol=1e-4, rtol=1e-4),
    C("std", "aten.std.correction", lambda x, dim, keepdim=False: (torch.std(x, dim, keepdim=keepdim), torch.std(x, dim, correction=0, keepdim=keepdim)), rd(), (f32, f16), v=("multi", "long"), grad=True, atol=1e-4, rtol=1e-4),
    C("var_mean-c0", "aten.var_mean.correction", lambda x, dim, keepdim=False: torch.var_mean(x, dim, correction=0, keepdim=keepdim), rd(), FL, v=("last_keep",), grad=True, atol=1e-4, rtol=1e-4),
    C("std_mean-c1", "aten.std_mean.correction", red(torch.std_mean), rd(), FL, v=("all",), grad=True, atol=1e-4, rtol=1e-4),
    C("any", "aten.any.dims", red(torch.any), rd(-1, 2, p=0.05, ints=True), (b8, f32), v=("multi", "empty0")),
    C("any-dim", "aten.any.dim", red(torch.any), rd(p=0.05), (b8,), v=("long",)),
    C("all", "aten.all.dims", red(torch.all), rd(0, 4, p=0.95, ints=True), (b8,), v=("all", "empty0")),
    C("all-dim", "aten.all.dim", red(torch.all), rd(0, 4, p=0.95, ints=True), (b8,), v=("t",)),
    C("logsumexp", "aten.logsumexp.default", lambda x, dim, keepdim=False: torch.logsumexp(x, full_dims(x, dim), keepdim), rd(), (f32, bf16), v=("last_keep", "long"), grad=True, atol=1e-4, rtol=1e-4),
    C("vector_norm", "aten.linalg_vector_norm.default", lambda x, dim, keepdim=False: torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim), rd(), (f32, bf16), v=("all", "long"), grad=True, atol=1e-4, rtol=1e-4),
    C("vector_norm-ord", "aten.linalg_vector_norm.default",
      lambda x, dim, keepdim=False: tuple(torch.linalg.vector_norm(x, o, dim, keepdim) for o in (1, float("inf"), 3)),
      rd(), FL, v=("multi",), grad=True, atol=1e-4, rtol=1e-4),
    C("count_nonzero", "aten.count_nonzero.dim_IntList", lambda x, dim, keepdim=False: torch.count_nonzero(x, dim), rd(-1, 2, ints=True), FL, v=("multi",)),
    C("cumsum", "aten.cumsum.default", lambda x, dim: torch.cumsum(x, dim), rd(), (f32, i32), v=("neg", "long", "t"), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.cumsum.default",), aten_bw=("aten.cumsum.default",)),
    C("cumprod", "aten.cumprod.default", lambda x, dim: torch.cumprod(x, dim), rd(0.5, 1.5, irange=(-2, 3)), FL, v=("d0",), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.cumprod.default",), aten_bw={"*": ("aten.cumprod.default", "aten.cumsum.default"), "torch 2.11": ("aten.cumprod.default",)}),
    C("cummax", "aten.cummax.default", lambda x, dim: torch.cummax(x, dim), rd(), (f32,), v=("neg",), grad=True, aten=("aten.cummax.default",), aten_bw=("aten.scatter_add.default",)),

    # ---- normalization, softmax ------------------------------------------------------------------
    C("softmax", "aten._softmax.default", lambda x, dim: torch.softmax(x, dim), smx(), (f32, bf16), v=("last", "d0", "long"), grad=True, atol=1e-5, rtol=1e-4),
    C("softmax-upcast", "aten._softmax.default", lambda x, dim: torch.softmax(x, dim, dtype=f32), smx(), (f16,), v=("last",), grad=True, atol=1e-5, rtol=1e-4),
    C("log_softmax", "aten._log_softmax.default", lambda x, dim: F.log_softmax(x, dim), smx(), FL, v=("last", "long"), grad=True, atol=1e-4, rtol=1e-4),
    C("layer_norm", "aten.native_layer_norm.default", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), _norm_in, (f32, bf16), v=("contig", "long", "t"), grad=True, atol=1e-4, rtol=1e-4),
    C("layer_norm-2d", "aten.native_layer_norm.default", lambda x: F.layer_norm(x, x.shape[-2:], eps=1e-3), lambda dt: {"contig": (R(3, 7, 33, dt=dt),)}, FL, grad=True, atol=1e-4, rtol=1e-4),
    C("rms_norm", "aten.rms_norm.default", lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, eps=1e-6) + b, _norm_in, (f32, bf16), v=("contig",), grad=True, atol=1e-4, rtol=1e-4),
    C("group_norm", "aten.native_group_norm.default", lambda x, w, b: F.group_norm(x, 3, w, b), _gn, FL, v=("contig", "3d"), grad=True, atol=1e-4, rtol=1e-4),
    C("batch_norm-eval", "aten.native_batch_norm.default", lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b, training=False), _bn, FL, v=("contig", "4d"), grad=(0, 3, 4), atol=1e-4, rtol=1e-4),

    # ---- views -----------------------------------------------------------------------------------
    C("view", "aten.view.default", lambda x: (x.view(24, 5), x.view(-1) * 2), lambda dt: {"contig": (R(4, 6, 5, dt=dt),)}, FL, grad=True),
    C("reshape", "aten.reshape.default", lambda x: (x.reshape(-1, 4) + 1, x.reshape(5, 24)), _views, FL, v=("t",), grad=True),
    C("permute", "aten.permute.default", lambda x: (x.permute(2, 0, 1), x.permute(1, 2, 0) + 1), _views, FL, v=("t",), grad=True),
    C("transpose", "aten.transpose.int", lambda x: x.transpose(0, 2) * x.transpose(0, 2), _views, FL, v=("t",), grad=True),
    C("t", "aten.t.default", lambda x: (x.t(), x.t() - 1), mk(contig=(5, 7), t=((7, 5), "t")), FL, v=("t",), grad=True),
    C("expand", "aten.expand.default", lambda x: (x.expand(4, 5, 6), x.expand(2, 4, 5, 6) * 2), lambda dt: {"contig": (R(4, 1, 6, dt=dt),), "0d": (R(dt=dt),)}, FL, v=("contig", "0d"), grad=True),
    C("squeeze", "aten.squeeze.dim", lambda x: (x.squeeze(1), x.squeeze(-1) + 1), lambda dt: {"contig": (R(4, 1, 6, 1, dt=dt),)}, FL, grad=True),
    C("unsqueeze", "aten.unsqueeze.default", lambda x: (x.unsqueeze(0), x.unsqueeze(-1) * x.unsqueeze(1)), mk(contig=(5, 7), t=((7, 5), "t")), FL, v=("t",), grad=True),
    C("flatten", "aten.flatten.using_ints", lambda x: (x.flatten(1), x.flatten() + 1), _views, (f32,), v=("t",), grad=True),
    C("unflatten", "aten.unflatten.int", lambda x: x.unflatten(1, (2, 3)) * 2, _views, FL, v=("t",), grad=True),
    C("narrow", "aten.narrow.default", lambda x: (x.narrow(1, 2, 3), x.narrow(-1, 1, 3) + 1), _views, FL, v=("t",), grad=True),
    C("slice-step", "aten.slice.Tensor", lambda x: (x[1:, ::2, 1::3], x[:, 1:-1:2] * 2, x[..., -3:]), _views, (f32, bf16), v=("t",), grad=True),
    C("select", "aten.select.int", lambda x: (x[:, 2], x[-1] + 1, x[1, :, 3]), _views, FL, v=("t",), grad=True),
    C("select_scatter", "aten.select_scatter.default", lambda x, y: (torch.select_scatter(x, y, 1, -2), torch.select_scatter(x, y.exp(), 1, 0) * 2),
      lambda dt: {"t": (R(5, 6, 4, dt=dt).permute(2, 1, 0), R(4, 5, dt=dt))}, FL, v=("t",), grad=True),
    C("slice_scatter", "aten.slice_scatter.default", lambda x, y: (torch.slice_scatter(x, y, 1, 1, 6, 2), torch.slice_scatter(x, y.exp(), 1, -3) * 2),
      lambda dt: {"t": (R(5, 6, 4, dt=dt).permute(2, 1, 0), R(4, 3, 5, dt=dt))}, FL, v=("t",), grad=True),
    C("unbind", "aten.unbind.int", lambda x: [t * (i + 1) for i, t in enumerate(x.unbind(1))], _views, FL, v=("t",), grad=True),
    C("split", "aten.split.Tensor", lambda x: [t + 1 for t in x.split(2, dim=1)], _views, FL, v=("t",), grad=True),
    C("split_with_sizes", "aten.split_with_sizes.default", lambda x: x.split([1, 3, 2], dim=1), _views, FL, grad=True),
    C("chunk", "aten.chunk.default", lambda x: [t * 2 for t in x.chunk(3, dim=-1)], _views, FL, v=("t",), grad=True),
    C("as_strided", "aten.as_strided.default", lambda x: (x.as_strided((3, 4), (5, 2), 1) + 1, x.as_strided((2, 2, 3), (30, 1, 10))), lambda dt: {"contig": (R(4, 6, 5, dt=dt),)}, FL, grad=True),
    C("diagonal", "aten.diagonal.default", lambda x: (x.diagonal(), x.diagonal(1, 0, 2) * 2, x.diagonal(-1, -2, -1)), _views, FL, v=("t",), grad=True, aten_bw=("aten.diagonal_scatter.default",)),
    C("movedim", "aten.movedim.int", lambda x: x.movedim(0, -1) + 1, _views, FL, v=("t",), grad=True),
    C("contiguous", "aten.clone.default", lambda x: x.t().contiguous(), mk(contig=(5, 7), t=((7, 5), "t")), (f32, b8), v=("contig",), grad=True),
    C("unfold", "aten.unfold.default", lambda x: (x.unfold(-1, 3, 2) * 2, x.unfold(1, 2, 2).sum(-1)), _views, FL, v=("t",), grad=True),

    # ---- in-place on fresh tensors (functionalized by the compiler) -------------------------------
    C("inplace", "aten.mul_.Tensor", lambda x: x.clone().mul_(2).add_(1).clamp_(-3, 5), un(), (f32, i32), v=("t",), grad=True),
    C("slice-assign", "aten.copy_.default", lambda x, y: (lambda z: (z[:, 1:4].copy_(y), z)[1])(x.clone()),
      lambda dt: {"bcast": (R(5, 7, dt=dt), R(3, dt=dt))}, FL, grad=True),
    # forward only: y's gradient is an fp16 sum, which eager rounds to fp16 and a fused kernel
    # keeps in fp32 until its explicit cast (as Inductor does)
    C("slice-assign-cast", "aten.copy_.default", lambda x, y: (lambda z: (z[:, 1:4].copy_(y.half()), z)[1])(x.clone()),
      lambda dt: {"bcast": (R(5, 7, dt=dt), R(3, dt=dt))}, (f32,)),

    # ---- cat / stack / pad -----------------------------------------------------------------------
    C("cat", "aten.cat.default", lambda a, b, dim: torch.cat([a, b], dim), _cat, (f32, b8), v=("d0_t", "empty", "promo"), grad=True),
    C("stack", "aten.stack.default", lambda a, b, dim: torch.stack([a, b], dim), _stack, FL, v=("dlast",), grad=True),
    C("pad", "aten.constant_pad_nd.default", lambda x: F.pad(x, (1, 2, 0, 3)), _views, (f32, i64), v=("t",), grad=True),
    C("pad-neg", "aten.constant_pad_nd.default", lambda x: F.pad(x, (-1, 2, -2, 0), value=1.5), _views, FL, v=("t",), grad=True),
    C("pad-reflect", "aten.reflection_pad1d.default", lambda x: F.pad(x, (2, 3), mode="reflect"), _views, FL, v=("t",), grad=True),
    C("pad-replicate", "aten.replication_pad2d.default", lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"), _views, FL, grad=True, aten_bw=("aten.replication_pad2d_backward.default",)),

    # ---- indexing, gather/scatter -------------------------------------------------------------------
    C("index", "aten.index.Tensor", lambda x, i: x[i], _idx, FL, v=("neg", "t"), grad=(0,)),
    C("index-multi", "aten.index.Tensor", lambda x, i, j: (x[i, j], x[:, j[:3]] * 2, x[i, :, j]), lambda dt: {"contig": (R(7, 5, 6, dt=dt), I(7, 4), I(5, 4))}, FL, grad=(0,)),
    C("index-bcast", "aten.index.Tensor", lambda x, i, j: x[i[:, None], j], lambda dt: {"contig": (R(7, 6, dt=dt), I(7, 3), I(6, 4, lo=-6))}, FL, grad=(0,)),
    C("index-bool", "aten.index.Tensor", lambda x, m: x[m] * 2, lambda dt: {"contig": (R(5, 7, dt=dt), R(5, 7, dt=b8))}, FL, grad=(0,), fullgraph=False),
    C("gather", "aten.gather.default", lambda x, i, dim: torch.gather(x, dim, i),
      lambda dt: {"d0": (R(7, 5, dt=dt), I(7, 3, 5), K(dim=0)), "t": (R(9, 4, dt=dt).t(), I(9, 4, 3), K(dim=1)),
                  # aten allows a 0-d input with a 1-d index, and an empty index of any rank
                  "0d": (R(dt=dt), I(1, 1), K(dim=0)), "empty": (R(5, dt=dt), I(5, 2, 0), K(dim=0))},
      (f32, i64), v=("d0", "t", "0d", "empty"), grad=(0,), aten={"empty": ("aten.gather.default",)}, aten_bw=("aten.scatter_add.default",)),
    C("embedding", "aten.embedding.default", F.embedding, lambda dt: {"contig": (I(10, 4, 5), R(10, 8, dt=dt))}, FL, grad=(1,)),
    C("index_select", "aten.index_select.default", lambda x, i, dim: torch.index_select(x, dim, i), lambda dt: {"d0": (R(7, 5, dt=dt), I(7, 9), K(dim=0)), "d1": (R(5, 7, dt=dt), I(7, 3), K(dim=1))}, FL, v=("d1",), grad=(0,)),
    C("take_along_dim", "aten.take_along_dim.default", lambda x: torch.take_along_dim(x, x.argsort(dim=1), dim=1), lambda dt: {"contig": (P(4, 9, dt=dt),)}, FL, grad=True, aten=("aten.sort.default",), aten_bw=("aten.scatter_add.default",)),
    C("take", "aten.take.default", torch.take, lambda dt: {"contig": (R(5, 6, dt=dt), I(30, 3, 4, lo=-30)), "t": (R(6, 5, dt=dt).t(), I(30, 7))}, FL, v=("t",), grad=(0,), aten_bw=("aten.put.default",)),
    C("index_put", "aten.index_put.default", lambda x, i, v: torch.index_put(x, (i,), v), _put, FL, v=("unique", "bcast"), grad=(0, 2)),
    C("index_put-acc", "aten.index_put.default", lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True), _put_acc, (f32, i64), v=("dup",), grad=(0, 2), atol=1e-5, rtol=1e-5),
    C("index_put-multi", "aten.index_put.default", lambda x, i, j, v: torch.index_put(x, (i, j), v, accumulate=True), lambda dt: {"contig": (R(6, 5, dt=dt), I(6, 9), I(5, 9), R(9, dt=dt))}, FL, grad=(0, 3)),
    C("setitem", "aten.index_put_.default", lambda x, i, v: (lambda y: (y.__setitem__(i, v), y)[1])(x.clone()), _put, FL, v=("unique",), grad=(0, 2)),
    C("scatter", "aten.scatter.src", lambda x, i, s, dim: torch.scatter(x, dim, i, s), _scatter_src, FL, v=("d0",), grad=(0, 2)),
    C("scatter-value", "aten.scatter.value", lambda x, i, s, dim: torch.scatter(x, dim, i, 2.5), _scatter_src, FL, v=("d1",), grad=(0,)),
    C("scatter-row", "aten.scatter.src", lambda x, i, s, dim: torch.scatter(x, dim, i, s), _scatter_row, (f32, i64), v=("d1", "d0"), grad=(0, 2)),
    C("scatter-row-value", "aten.scatter.value", lambda x, i, s, dim: torch.scatter(x, dim, i, -1.0), _scatter_row, FL, v=("d1",), grad=(0,)),
    C("scatter_add", "aten.scatter_add.default", lambda x, i, s, dim: torch.scatter_add(x, dim, i, s), _scatter_dup, (f32, i64), v=("d0",), grad=(0, 2), aten=("aten.scatter_add.default",)),
    C("scatter_reduce", "aten.scatter_reduce.two",
      lambda x, i, s, dim: (torch.scatter_reduce(x, dim, i, s, "prod", include_self=False), torch.scatter_reduce(x, dim, i, s, "amax"),
                            torch.scatter_reduce(x, dim, i, s, "amin", include_self=False), torch.scatter_reduce(x, dim, i, s, "mean")),
      _scatter_dup, (f32, i32), v=("d0",), aten=("aten.scatter_reduce.two",)),
    C("scatter_reduce-sum", "aten.scatter_reduce.two", lambda x, i, s, dim: torch.scatter_reduce(x, dim, i, s, "sum"), _scatter_dup, FL, v=("d1",), grad=(0, 2), aten=("aten.scatter_reduce.two",)),
    C("index_add", "aten.index_add.default", lambda x, i, s, dim: torch.index_add(x, dim, i, s, alpha=2), _index_add, FL, v=("d1",), grad=(0, 2)),
    C("index_copy", "aten.index_copy.default", lambda x, i, s: torch.index_copy(x, 0, i, s), lambda dt: {"contig": (R(8, 6, dt=dt), U(8, 1, 5)[0], R(5, 6, dt=dt))}, FL, grad=(0, 2)),
    C("index_fill", "aten.index_fill.int_Scalar", lambda x, i: torch.index_fill(x, 1, i, -1.0), lambda dt: {"contig": (R(5, 7, dt=dt), I(7, 3))}, FL, grad=(0,)),
    C("masked_scatter", "aten.masked_scatter.default", lambda x, m, s: x.masked_scatter(m, s),
      lambda dt: {"bcast": (R(4, 6, dt=dt), R(6, dt=b8), R(30, dt=dt))}, FL, grad=(0, 2), aten=("aten.masked_scatter.default",), aten_bw=("aten.masked_scatter_backward.default",)),

    # ---- structural --------------------------------------------------------------------------------
    C("tril", "aten.tril.default", lambda x: (torch.tril(x), torch.tril(x, -1)), mk(contig=(6, 7), batch=(2, 5, 5)), FL, v=("batch",), grad=True),
    C("triu", "aten.triu.default", lambda x: torch.triu(x, 1) * 2, mk(contig=(6, 7), t=((7, 6), "t")), (f32, b8), v=("t",), grad=True),
    C("flip", "aten.flip.default", lambda x: (torch.flip(x, (0, 2)), torch.flip(x, (-2,)) + 1), _views, FL, v=("t",), grad=True),
    C("roll", "aten.roll.default", lambda x: (torch.roll(x, (2, -1), (0, 1)), torch.roll(x, 5)), _views, FL, v=("t",), grad=True),
    C("repeat", "aten.repeat.default", lambda x: x.repeat(2, 1, 3), _views, FL, v=("t",), grad=True),
    C("tile", "aten.tile.default", lambda x: torch.tile(x, (2, 2)) + 1, mk(contig=(3, 4)), FL, grad=True),
    C("repeat_interleave", "aten.repeat_interleave.self_int", lambda x: torch.repeat_interleave(x, 2, dim=1), _views, FL, grad=True),
    C("sort", "aten.sort.default", lambda x: (torch.sort(x, dim=-1), torch.sort(x, dim=0, descending=True)), lambda dt: {"contig": (P(9, 33, dt=dt),), "t": (P(33, 9, dt=dt).t(),)}, (f32, i64), v=("t",), grad=True, aten=("aten.sort.default",), aten_bw=("aten.scatter.src",)),
    C("sort-stable", "aten.sort.stable", lambda x: torch.sort(x, dim=-1, stable=True), un(-3, 3, ints=True), (i32,), aten=("aten.sort.stable",)),
    C("argsort", "aten.argsort.default", lambda x: torch.argsort(x, dim=1), lambda dt: {"contig": (P(5, 12, dt=dt),)}, FL, aten=("aten.sort.default",)),
    C("topk", "aten.topk.default", lambda x: (torch.topk(x, 5), torch.topk(x, 3, dim=0, largest=False)), lambda dt: {"contig": (P(9, 33, dt=dt),), "t": (P(33, 9, dt=dt).t(),)}, (f32, bf16), v=("t",), grad=True, aten=("aten.topk.default",)),
    C("one_hot", "aten.one_hot.default", lambda i: F.one_hot(i, 7), lambda dt: {"contig": (I(7, 4, 5),)}, (i64,), aten={"cpu": ("aten._assert_async.msg",)}),  # CUDA checks no values
    C("dropout-eval", "aten.dropout.default", lambda x: F.dropout(x, 0.5, training=False) * 2, un(), FL, grad=True),

    # ---- matmul / conv / pooling -------------------------------------------------------------------
    C("mm", "aten.mm.default", torch.mm, mm_((8, 16), (16, 12), tr=(0, 1)), (f32, f16, bf16), v=("t",), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.mm.default",), aten_bw=("aten.mm.default",)),
    C("bmm", "aten.bmm.default", torch.bmm, mm_((2, 8, 16), (2, 16, 12), tr=(1,)), FL, v=("t",), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.bmm.default",), aten_bw=("aten.bmm.default",)),
    C("addmm", "aten.addmm.default", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2), mm_((12,), (8, 16), (16, 12), tr=(1,)), FL, v=("t",), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.addmm.default",), aten_bw=("aten.mm.default",)),
    C("baddbmm", "aten.baddbmm.default", lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2), mm_((2, 8, 12), (2, 8, 16), (2, 16, 12)), FL, grad=True, atol=1e-4, rtol=1e-4, aten=("aten.bmm.default",), aten_bw=("aten.bmm.default",)),
    C("matmul-3d2d", "aten.matmul.default", torch.matmul, mm_((3, 5, 8), (8, 4), tr=(0,)), FL, v=("t",), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.mm.default",), aten_bw=("aten.mm.default",)),
    C("matmul-1d-bcast", "aten.matmul.default", lambda v, m, w, a, b: (v @ m, m @ w, a @ b), mm_((8,), (8, 6), (6,), (2, 1, 5, 8), (3, 8, 4)), FL, grad=True, atol=1e-4, rtol=1e-4, aten=("aten.bmm.default", "aten.mm.default"), aten_bw=("aten.bmm.default", "aten.mm.default")),
    C("linear", "aten.linear.default", F.linear, mm_((6, 16), (12, 16), (12,), tr=(1,)), (f32, bf16), v=("t",), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.addmm.default",), aten_bw=("aten.mm.default",)),
    C("einsum", "aten.einsum.default", lambda a, b: (torch.einsum("bij,bjk->bik", a, b), torch.einsum("bij->bj", a), torch.einsum("bij,bjk->", a, b)), mm_((2, 5, 8), (2, 8, 3)), FL, grad=True, atol=1e-4, rtol=1e-4, aten=("aten.bmm.default",), aten_bw=("aten.bmm.default",)),
    C("mv", "aten.mv.default", torch.mv, mm_((8, 16), (16,)), FL, grad=True, atol=1e-4, rtol=1e-4),
    C("dot", "aten.dot.default", torch.dot, mm_((16,), (16,)), FL, grad=True, atol=1e-4, rtol=1e-4),
    C("outer", "aten.outer.default", torch.outer, mm_((7,), (5,)), FL, grad=True),
    C("conv1d", "aten.convolution.default", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1), _conv1d, (f32, bf16), grad=True, atol=1e-4, rtol=1e-4, aten=("aten.convolution.default",), aten_bw=("aten.convolution_backward.default",)),
    C("conv2d", "aten.convolution.default", lambda x, w, b: F.conv2d(x, w, b, padding=1), _conv2d, FL, grad=True, atol=1e-4, rtol=1e-4, aten=("aten.convolution.default",), aten_bw=("aten.convolution_backward.default",)),
    C("conv2d-groups", "aten.convolution.default", lambda x, w: F.conv2d(x, w, stride=(2, 1), dilation=(1, 2), groups=2),
      lambda dt: {"contig": (R(2, 4, 9, 10, dt=dt), R(6, 2, 3, 2, dt=dt, lo=-0.5, hi=0.5))}, FL, grad=True, atol=1e-4, rtol=1e-4, aten=("aten.convolution.default",), aten_bw=("aten.convolution_backward.default",)),
    C("max_pool2d", "aten.max_pool2d_with_indices.default", lambda x: (F.max_pool2d(x, 2), F.max_pool2d(x, 3, stride=2, padding=1)), _pool, FL, v=("t",), grad=True),
    C("avg_pool2d", "aten.avg_pool2d.default", lambda x: (F.avg_pool2d(x, 2), F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False), F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
                                                         F.avg_pool2d(x, (2, 3), stride=(2, 1), padding=(1, 0), ceil_mode=True, count_include_pad=False), F.avg_pool2d(x, 3, stride=2, ceil_mode=True, divisor_override=5)), _pool, (f32, bf16), v=("contig", "t"), grad=True),
    C("adaptive_avg_pool2d", "aten._adaptive_avg_pool2d.default", lambda x: F.adaptive_avg_pool2d(x, (3, 2)), _pool, FL, grad=True, aten=("aten._adaptive_avg_pool2d.default",), aten_bw=("aten._adaptive_avg_pool2d_backward.default",)),
    C("upsample_nearest", "aten.upsample_nearest2d.vec", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), _pool, FL, grad=True),
    C("upsample_bilinear", "aten.upsample_bilinear2d.vec", lambda x: F.interpolate(x, size=(7, 13), mode="bilinear", align_corners=False), _pool, FL, grad=True, atol=1e-5, rtol=1e-5),

    # ---- losses --------------------------------------------------------------------------------------
    C("mse_loss", "aten.mse_loss.default", lambda a, b: (F.mse_loss(a, b), F.mse_loss(a, b, reduction="none"), F.mse_loss(a, b, reduction="sum")), bi(), (f32, bf16), v=("t",), grad=True, atol=1e-4, rtol=1e-4),
    C("l1_loss", "aten.l1_loss.default", F.l1_loss, bi(), FL, grad=True, atol=1e-4, rtol=1e-4),
    C("smooth_l1_loss", "aten.smooth_l1_loss.default", lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), bi(), FL, grad=True, atol=1e-4, rtol=1e-4),
    C("huber_loss", "aten.huber_loss.default", lambda a, b: F.huber_loss(a, b, delta=1.5, reduction="sum"), bi(), FL, grad=True, atol=1e-4, rtol=1e-4),
    C("cross_entropy", "aten.cross_entropy_loss.default", F.cross_entropy, _ce, (f32, bf16), v=("nd",), grad=(0,), atol=1e-4, rtol=1e-4),
    C("cross_entropy-smooth", "aten.cross_entropy_loss.default", lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1, reduction="sum"), _ce, FL, grad=(0,), atol=1e-4, rtol=1e-4),
    C("cross_entropy-probs", "aten.cross_entropy_loss.default", lambda x, t: F.cross_entropy(x, t.softmax(-1)), lambda dt: {"contig": (R(6, 10, dt=dt), R(6, 10, dt=dt))}, FL, grad=True, atol=1e-4, rtol=1e-4),
    C("nll_loss", "aten.nll_loss_forward.default", lambda x, t, w: (F.nll_loss(x, t), F.nll_loss(x, t, w, ignore_index=3, reduction="sum")), _nll, FL, grad=(0,), atol=1e-4, rtol=1e-4),
    C("bce_with_logits", "aten.binary_cross_entropy_with_logits.default",
      lambda x, y, pw: F.binary_cross_entropy_with_logits(x, y, pos_weight=pw),
      lambda dt: {"contig": (R(6, 10, dt=dt), R(6, 10, dt=dt, lo=0, hi=1), R(10, dt=dt, lo=0.5, hi=2))}, FL, grad=(0, 1), atol=1e-4, rtol=1e-4),
    C("bce", "aten.binary_cross_entropy.default", lambda x, y: F.binary_cross_entropy(x, y, reduction="none"),
      lambda dt: {"contig": (R(6, 10, dt=dt, lo=0.05, hi=0.95), R(6, 10, dt=dt, lo=0, hi=1))}, FL, grad=True, atol=1e-4, rtol=1e-4),
]


def params():
    """[(case, variant, dtype)] as described in the module docstring."""
    out = []
    for case in CASES:
        names = list(case.v or [next(iter(case.inputs(case.dtypes[0])))])
        for k, dt in enumerate(case.dtypes):
            for variant in (names if k == 0 else names[:1]):
                out.append((case, variant, dt))
    return out


def declared_ops() -> set[str]:
    return {c.op for c in CASES}
