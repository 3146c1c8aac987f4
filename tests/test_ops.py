"""Op correctness: every case of tests/op_cases.py, compiled vs eager, forward and backward.

Backend: $COMMFUSE_TEST_BACKEND (default "commfuse"; "aot_eager" or "inductor" to check
the harness itself). Device: $COMMFUSE_TEST_DEVICE (default cuda when available, else cpu).
With the commfuse backend, its `fallback_on_error` option is switched off here so that a
graph it cannot compile fails the test instead of silently running eagerly, unless
COMMFUSE_FALLBACK_ON_ERROR is set in the environment (then that setting stands).
COMMFUSE_TEST_GRAD=0 skips the backward checks (forward only). With commfuse, each case also
checks from the dumps' summaries that every graph compiled and that what ran through aten (per-op
fallbacks) is what the case declares (`aten=`, `aten_bw=`; none: every op lowered).

Each parametrized id reads `<case>-<variant>-<dtype>`, e.g. `add-bcast-float32`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import zlib

import pytest
import torch
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import op_cases  # noqa: E402
from op_cases import CASES, K, params  # noqa: E402
from tests.common import DEVICE, Dumps  # noqa: E402

BACKEND = os.environ.get("COMMFUSE_TEST_BACKEND", "commfuse")
CHECK_GRAD = os.environ.get("COMMFUSE_TEST_GRAD", "1") != "0"

# Default (atol, rtol) by dtype of the compared tensor; cases may only loosen them.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

_DT_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
            torch.float64: "float64", torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"}


def _id(case, variant, dtype):
    return f"{case.name}-{variant}-{_DT_NAME[dtype]}"


PARAMS = params()
IDS = [_id(*p) for p in PARAMS]
assert len(set(IDS)) == len(IDS), "duplicate test ids"
assert len({c.name for c in CASES}) == len(CASES), "duplicate case names"


@contextlib.contextmanager
def _strict_backend():
    """With commfuse, make a graph that fails to compile fail the test (unless the
    environment chose a fallback policy explicitly)."""
    if BACKEND != "commfuse" or "COMMFUSE_FALLBACK_ON_ERROR" in os.environ:
        yield
        return
    try:
        from commfuse import config
        patch = config.patch(fallback_on_error=False)
    except (ImportError, AttributeError, ValueError):
        patch = contextlib.nullcontext()
    with patch:
        yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with _strict_backend():
        yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- helpers

def _split_kwargs(args):
    if args and isinstance(args[-1], K):
        return tuple(args[:-1]), dict(args[-1])
    return tuple(args), {}


def _grad_positions(case, args):
    if not case.grad or not CHECK_GRAD:
        return ()
    floats = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if case.grad is True:
        return tuple(floats)
    return tuple(i for i in case.grad if i in floats)


def _leaves(args, positions):
    """Fresh autograd leaves (same storage and strides) at `positions`."""
    out = list(args)
    for i in positions:
        out[i] = args[i].detach().requires_grad_()
    return out


def _tol(case, dtype, scale=1.0):
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0, 0.0
    atol, rtol = TOL[dtype]
    return max(atol, case.atol or 0.0) * scale, max(rtol, case.rtol or 0.0) * scale


def _compare(case, actual, expected, what):
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    assert len(a_leaves) == len(e_leaves), f"{what}: {len(a_leaves)} outputs, eager has {len(e_leaves)}"
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"{what}[{k}]"
        if not isinstance(e, torch.Tensor):
            assert a == e or (a != a and e != e), f"{where}: {a!r} != eager {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{where}: got {type(a).__name__}, eager gives a tensor"
        if case.check == "meta" and what == "output":
            assert (a.shape, a.dtype, a.device) == (e.shape, e.dtype, e.device), \
                f"{where}: {a.shape}/{a.dtype}/{a.device} vs eager {e.shape}/{e.dtype}/{e.device}"
            continue
        atol, rtol = _tol(case, e.dtype, 2.0 if what == "grad" else 1.0)
        torch.testing.assert_close(a.detach(), e.detach(), atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m: f"{where} ({case.op}): {m}")


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _no_further_than_eager(actual, expected, reference):
    for k, (a, e, r) in enumerate(zip(*(tree_flatten(x)[0] for x in (actual, expected, reference)), strict=True)):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            continue
        assert torch.equal(a.isfinite(), e.isfinite()) and torch.equal(a.isnan(), e.isnan()) and \
            torch.equal(a[a.isinf()], e[e.isinf()]), f"result {k}: not finite where eager is, or the other way"
        finite = e.isfinite() & r.isfinite()
        err_a, err_e = (torch.cat([(x.detach().double() - r.detach().double())[finite].abs().flatten(),
                                   torch.zeros(1, dtype=torch.float64, device=x.device)]).max().item() for x in (a, e))
        assert err_a <= 2 * err_e + TOL[e.dtype][0], \
            f"result {k}: {err_a:.3g} from an fp32 run where eager is {err_e:.3g} from it"


def _grad_outputs(outs, seed, dtype=None):
    """Random grad_outputs, rounded to `dtype` (default: each output's own)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(o.shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype or o.dtype).to(o.dtype)
            .to(o.device) for o in outs]


@contextlib.contextmanager
def _dumps(dump_dir):
    if BACKEND != "commfuse":
        yield
        return
    from commfuse import config
    with config.patch(dump_dir=str(dump_dir)):
        yield


def _check_lowered(case, variant, dumps):
    """Every graph compiled, and the ops run through aten are the ones the case declares."""
    summaries = [(os.path.basename(g).split("_")[1], dumps.summary(g)) for g in dumps.graphs()]
    assert summaries, "commfuse compiled no graph"
    for kind, s in summaries:
        assert s["compiled"], f"the {kind} graph ran through aten whole: {s['fallback_reason']}"
    kinds = {"forward", "inference"} & {kind for kind, _ in summaries}, {"backward"} & {kind for kind, _ in summaries}
    for backward, graphs in enumerate(kinds):
        if not graphs:
            continue
        reasons = {op: why for kind, s in summaries if kind in graphs for op, why in s["fallback_reasons"].items()}
        want = case.through_aten(variant, backward=bool(backward))
        assert set(reasons) == want, f"{'/'.join(sorted(graphs))} ops run through aten: {reasons}; " \
            f"the case declares {sorted(want)}"


def _run(fn, args, positions, seed, grad_dtype=None):
    """Forward, and with grad positions, input gradients for a fixed random grad_output."""
    args = _leaves(args, positions)
    out = fn(*args)
    if not positions:
        return out, None
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    assert outs, "grad case whose outputs do not require grad"
    inputs = [args[i] for i in positions]
    grads = torch.autograd.grad(outs, inputs, _grad_outputs(outs, seed, grad_dtype), allow_unused=True)
    return out, list(grads)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("case,variant,dtype", PARAMS, ids=IDS)
def test_op(case, variant, dtype, tmp_path):
    seed = zlib.crc32(_id(case, variant, dtype).encode())
    op_cases.seed(seed)
    args, kwargs = _split_kwargs(case.variants(dtype)[variant])
    fn = case.fn

    def f(*a):
        return fn(*a, **kwargs)

    positions = _grad_positions(case, args)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    expected, expected_grads = _run(f, args, positions, seed)
    compiled = torch.compile(f, backend=BACKEND, dynamic=False, fullgraph=case.fullgraph)
    with _dumps(tmp_path):
        actual, actual_grads = _run(compiled, args, positions, seed)

    try:
        _compare(case, actual, expected, "output")
        if positions:
            _compare(case, actual_grads, expected_grads, "grad")
    except AssertionError:
        if dtype not in LOW_PRECISION:
            raise
        # eager rounds after every op, a fused kernel keeps fp32 between them: off from eager is
        # fine where no further than eager from the same function computed in fp32
        up = [a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args]
        reference = _run(f, up, positions, seed, grad_dtype=dtype)
        _no_further_than_eager((actual, actual_grads), (expected, expected_grads), reference)
    for k, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True,
                                       msg=lambda m: f"input {k} was modified: {m}")
    if BACKEND == "commfuse":
        _check_lowered(case, variant, Dumps(tmp_path))


def _resolve(name):
    ns, packet, overload = name.split(".")
    assert ns == "aten", name
    return getattr(getattr(torch.ops.aten, packet), overload)


def test_op_coverage():
    """At least 120 distinct aten ops are declared, and each declaration is a real overload."""
    ops = op_cases.declared_ops()
    bad = []
    for name in sorted(ops):
        try:
            _resolve(name)
        except (AttributeError, AssertionError, ValueError):
            bad.append(name)
    assert not bad, f"not aten overloads: {bad}"
    assert len(ops) >= 120, f"only {len(ops)} distinct aten ops declared"


def test_declared_ops_are_exercised():
    """Each case's declared op shows up when its function is traced to aten (make_fx), unless
    the op is CompositeImplicitAutograd (then its decomposition is what backends receive)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    missing = []
    for case in CASES:
        op = _resolve(case.op)
        if op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
            continue
        seen = set()
        for c, variant, dtype in PARAMS:
            if c is not case:
                continue
            op_cases.seed(0)
            args, kwargs = _split_kwargs(case.variants(dtype)[variant])
            try:
                gm = make_fx(lambda *a: case.fn(*a, **kwargs))(*args)
            except Exception as e:  # noqa: BLE001  (reported below, with the other cases)
                missing.append(f"{case.name}-{variant}: make_fx failed: {type(e).__name__}: {e}")
                break
            seen |= {n.target for n in gm.graph.nodes if n.op == "call_function"}
            if op in seen:
                break
        else:
            missing.append(f"{case.name}: {case.op} not in {sorted(str(t) for t in seen)}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("op", [torch.fmod, torch.remainder])
def test_float_remainders_are_exact(op):
    """fmod and remainder of floats are exact in IEEE arithmetic. As a - b * trunc(a / b) they lost
    up to the whole divisor: fmod(1.0, 0.1) gave 0.0 for 0.0999..., and the error grew with a / b."""
    a = torch.tensor([1.0, -5.5, 1e12, -2.0999999999999996, 7.25, -1e9 - 0.3], dtype=torch.float64)
    b = torch.tensor([0.1, 2.0, 0.7, 0.7, -0.5, 0.7], dtype=torch.float64)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(op, backend="commfuse")(a, b), op(a, b), rtol=0, atol=0)


def test_integer_overflow_wraps_as_in_eager():
    """An int32 hash (x * 1000003 + 7) wraps in eager. Under Triton's interpreter, the debug mode
    our bounds asserts need also checked every integer op for overflow, and raised."""
    x = torch.tensor([2**30, 123456789, -5, 2**31 - 1], dtype=torch.int32)
    fn = lambda t: t * 1000003 + 7  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="commfuse")(x), fn(x), rtol=0, atol=0)


def test_integer_constants_wrap_as_in_eager():
    """A Python int out of a tensor's integer range wraps as eager casts it: uint8 > -1 compares
    with 255. The kernel built tl.full(-1, tl.uint8), which raised."""
    a = torch.tensor([0, 1, 200, 255], dtype=torch.uint8)
    b = torch.tensor([-128, 5, 127], dtype=torch.int8)
    fn = lambda a, b: (a > -1, a + 300, a == -1, b + 200)  # noqa: E731
    torch._dynamo.reset()
    for got, want in zip(torch.compile(fn, backend="commfuse")(a, b), fn(a, b)):
        assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_signed_zeros_and_inverse_trig_are_exact(dtype):
    """copysign, signbit and atan2 keep the sign of zero (fp64's bits were read as 32-bit words,
    and raised); atan, asin, acos, atan2 and erfc are exact to the dtype (on CPU the fp32-accurate
    forms of Triton's interpreter leave fp64, and erfc, to aten)."""
    z = torch.tensor([-0.0, 0.0, -1.0, 2.0, 0.5], dtype=dtype)
    w = torch.tensor([1.0, -2.0, 0.5, -0.0, -0.0], dtype=dtype)
    x = torch.linspace(-0.99, 0.99, 101, dtype=dtype)
    fn = lambda z, w, x: (torch.copysign(z, w), torch.signbit(z * w), torch.atan2(z, w), torch.atan2(-0.0 * w, w.abs()),  # noqa: E731
                          torch.atan(x * 5), torch.asin(x), torch.acos(x), torch.erfc(x * 6))
    torch._dynamo.reset()
    got, want = torch.compile(fn, backend="commfuse")(z, w, x), fn(z, w, x)
    for g, e in zip(got, want):
        assert torch.equal(g.signbit(), e.signbit()), (g, e)
        torch.testing.assert_close(g, e, rtol=4 * torch.finfo(dtype).eps, atol=0)


def test_special_values_as_in_eager():
    """Infinities, huge and tiny magnitudes and signed zeros: hypot squared its operands (1e20
    overflowed, 1e-25 underflowed), acosh(-1e30) was inf, (-inf) ** 2.5 nan, atan2 of two
    infinities and erfc(inf) nan, tanh, asinh, atanh and round lost the sign of zero, and round
    moved odd integers from 2**23 to the next even one. Float floor division floored a rounded
    quotient (3.0 // 0.3 gave 10, for 9; inf // 0.3 inf, for nan). On GPUs (Triton 3.6) -x of +0.0
    was +0.0, so 1 / -(x * 0) was +inf."""
    inf = float("inf")
    a = torch.tensor([1e20, 1e30, 3e-30, 1e-25, inf, inf, -inf, -0.0, 0.0, 3.0], device=DEVICE)
    b = torch.tensor([1.0, 1e30, 4e-30, 0.0, float("nan"), -inf, -inf, -1.0, -0.0, 4.0], device=DEVICE)
    x = torch.tensor([-1e30, -3.0, -inf, inf, -0.0, -0.5, -1e-30, 0.0, 8388609.0, -8388611.0, 2.5, 0.7, 3.0, 88.8],
                     device=DEVICE)
    fn = lambda a, b, x: (torch.hypot(a, b), torch.atan2(a, b), torch.acosh(x), x.pow(2.5), x.pow(torch.full_like(x, 3.0)),  # noqa: E731
                          x.pow(-1.5), torch.tanh(x), torch.asinh(x), torch.atanh(x.clamp(-0.9, 0.9)), torch.round(x),
                          torch.erfc(x), x // 0.3, torch.floor_divide(a, b), x.double() // 0.3,
                          1.0 / -(x * 0.0), torch.copysign(a * 0.0, b))
    torch._dynamo.reset()
    for k, (g, e) in enumerate(zip(torch.compile(fn, backend="commfuse")(a, b, x), fn(a, b, x))):
        torch.testing.assert_close(g, e, rtol=4e-6, atol=0, equal_nan=True, msg=lambda m: f"output {k}: {m}")
        assert torch.equal(g.signbit() | g.isnan(), e.signbit() | e.isnan()), (k, g, e)  # zeros' signs; any NaN's


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tanh_expm1_sinh_atanh_keep_relative_precision_near_zero(dtype):
    """Gemma-2's final logit softcapping, 30 * tanh(logits / 30), takes tanh of small values: its
    1 - e^-2|x| cancelled digits (tanh(0.01) 340 ulps off in fp32; the logits 1.7e-6 from eager's),
    as e^x - 1, e^x - e^-x and log((1 + x) / (1 - x)) did. log1p(inf) and atanh(1) were nan."""
    m = torch.logspace(-6, 0.5, 400, dtype=dtype)
    x, edge = torch.cat([m, -m]), torch.tensor([float("inf"), 1.0, -1.0], dtype=dtype)
    fn = lambda x, e: (torch.tanh(x), 30 * torch.tanh(x / 30), torch.expm1(x), torch.sinh(x),  # noqa: E731
                       torch.atanh(x.clamp(-0.99, 0.99)), torch.log1p(e), torch.atanh(e[1:]))
    torch._dynamo.reset()
    for g, e in zip(torch.compile(fn, backend="commfuse")(x, edge), fn(x, edge)):
        torch.testing.assert_close(g, e, rtol=6 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_asinh_acosh_sinh_cosh_keep_relative_precision(dtype):
    """asinh near 0 (log(a + sqrt(a² + 1)) lost digits: 4.5e3 ulps at 1e-3 in fp32), acosh near 1
    (x² - 1 cancelled: 1e5 ulps in fp64), sinh and cosh up to their own overflow (in fp32, e^|x|
    overflowed first: inf for 88.7 < |x| < 89.4, as eager's vectorized fp32 sinh on CPU does: the
    reference is fp64)."""
    m, big = (t.to(DEVICE) for t in (torch.logspace(-6, 2, 400, dtype=dtype), torch.linspace(80, 89.4, 60, dtype=dtype)))
    args = (torch.cat([m, -m]), 1 + m, m * 1e8, torch.cat([big, -big]), big, m)
    fn = lambda *a: (a[0].asinh(), a[1].acosh(), a[2].acosh(), a[3].sinh(), a[4].cosh(), a[5].cosh())  # noqa: E731
    torch._dynamo.reset()
    for g, e in zip(torch.compile(fn, backend="commfuse")(*args), fn(*(a.double() for a in args))):
        torch.testing.assert_close(g, e.to(dtype), rtol=8 * torch.finfo(dtype).eps, atol=0)


def test_max_over_no_elements_raises_as_in_eager():
    """max(0) of a (0, 4) tensor has no value: eager raises, and so must the compiled function
    (it returned -inf and index 2**31 - 1)."""
    torch._dynamo.reset()
    with pytest.raises(IndexError, match="non-zero size"):
        torch.compile(lambda x: x.max(0), backend="commfuse")(torch.randn(0, 4))


@pytest.mark.parametrize("fn", [lambda x: x.sum(), lambda x: x.abs().sum(-1), lambda x: x.norm(), lambda x: x.prod(),
                                lambda x: (x > 0).any(), lambda x: (x > 0).all(1)],
                         ids=["sum", "sum_last", "norm", "prod", "any", "all"])
def test_reductions_over_no_elements_are_their_identity(fn, tmp_path):
    """A reduction over a zero-size dim is its identity (sum 0, prod 1, any False, all True), compiled
    with the rest of the graph: its loop over nothing divided by the empty dim's size."""
    from commfuse import config
    x = torch.randn(3, 0, device=DEVICE)
    with config.patch(fallback_on_error=False, dump_dir=str(tmp_path)):
        torch._dynamo.reset()
        got = torch.compile(fn, backend="commfuse")(x)
    torch.testing.assert_close(got, fn(x))
    assert not Dumps(tmp_path).only()[0]["extern_calls"]


@pytest.mark.parametrize("op", [torch.floor_divide, torch.remainder, torch.fmod,
                                lambda a, b: torch.div(a, b, rounding_mode="trunc")],
                         ids=["floor_divide", "remainder", "fmod", "trunc_div"])
def test_integer_division_by_zero_raises_on_a_cpu_as_in_eager(op):
    """Eager's CPU kernels raise, as Inductor's C++ ones do; the interpreted kernel returned 0 and
    -1. A divisor made safe with where() runs."""
    a, b = torch.tensor([7, -7, 5]), torch.tensor([2, 0, 3])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        op(a, b)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="ZeroDivisionError"):
        torch.compile(op, backend="commfuse")(a, b)
    safe = lambda a, b: op(a, torch.where(b != 0, b, 1))  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(safe, backend="commfuse")(a, b), safe(a, b), rtol=0, atol=0)


def test_a_reduction_with_no_output_elements_compiles():
    """sum(0) of a (2, 4, 0) tensor, the backward of an expand of an empty tensor: its (4, 0)
    output has no element, and the index math divided by the empty dim (ZeroDivisionError at
    compile time, a whole-graph fallback)."""
    strict = {"fallback_on_error": False}
    torch._dynamo.reset()
    assert torch.compile(lambda g: g.sum(0), backend="commfuse", options=strict)(torch.randn(2, 4, 0)).shape == (4, 0)
    x = torch.randn(0, 4, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(lambda x: (x.t().expand(2, 4, 0) + 1).sum(), backend="commfuse", options=strict)(x).backward()
    assert x.grad.shape == (0, 4)


def test_an_arange_with_an_int64_step_past_int32():
    """`torch.arange(0, 2**40, 2**36)` and `arange(2**35, 2**35 + 16)`: the kernel computes the
    values from its indices in int64 (Triton refused the constant against an int32 index, and the
    whole graph ran through aten)."""
    fn = lambda x: (torch.arange(0, 2**40, 2**36, device=DEVICE) + x,  # noqa: E731
                    torch.arange(2**35, 2**35 + 16, device=DEVICE) * x)
    x = torch.arange(16, device=DEVICE)
    torch._dynamo.reset()
    for got, want in zip(torch.compile(fn, backend="commfuse")(x), fn(x)):
        assert torch.equal(got, want)
