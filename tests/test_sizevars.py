"""Symbolic sizes: their hints (the concrete sizes behind them, each graph its own, taken from its
example inputs before lowering starts), index arithmetic, and lowerings that take symbolic bounds
(slices, views, arange) under dynamic shapes."""
from __future__ import annotations

import pytest
import torch

from tests.common import DEVICE, compile_and_run


def sliced_mm(x, z, w):
    y = x.exp()                   # not stored yet
    return y[: z.shape[0]] @ w    # an extern reads a slice of it


def test_hints_are_this_graphs_while_lowering(tmp_path):
    """Lowering decides by hints whether an extern's operand, a slice of a value not stored yet,
    is copied out (its rows) or read from the whole value stored (when the slice is most of it).
    The hints were a global set after lowering, so this decision saw the previous graph's sizes
    (or none): here the whole 64 x 8 value was stored to pass 5 of its rows."""
    w = torch.randn(8, 3, device=DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    compile_and_run(sliced_mm, x, torch.randn(4, device=DEVICE), w, tmp_path=tmp_path / "a", dynamic=True)
    x = torch.randn(64, 8, device=DEVICE)
    z = torch.randn(5, device=DEVICE)
    out, dumps = compile_and_run(sliced_mm, x, z, w, tmp_path=tmp_path / "b", dynamic=True)
    torch.testing.assert_close(out, sliced_mm(x, z, w))
    summary, code = dumps.only()
    stored = [b["bytes"] for b in summary["buffers"]]
    assert 64 * 8 * 4 not in stored, (stored, code)  # the whole exp(x) is never stored
    assert 5 * 8 * 4 in stored, (stored, code)       # its 5 rows are


def test_split_and_merged_dims_fold_back():
    """An index through a view that splits a dim and one that merges it back: `x // b`, `x % b`
    and their combinations fold to the index they started from (one division per element where
    a [32, V] gradient was viewed as [2, 16, V]: three before)."""
    import sympy
    from commfuse.sizevars import FloorDiv, Mod, simplify
    x = sympy.Symbol("x", integer=True, nonnegative=True)
    v = 50257
    assert simplify(16 * FloorDiv(x, 16 * v) + Mod(FloorDiv(x, v), 16)) == FloorDiv(x, v)
    assert simplify(16 * 50260 * FloorDiv(x, 16 * v) + Mod(x, v) + 50260 * Mod(FloorDiv(x, v), 16)) \
        == 50260 * FloorDiv(x, v) + Mod(x, v)  # a padded row stride
    assert simplify(4 * Mod(FloorDiv(x, 4), 3) + Mod(x, 4)) == Mod(x, 12)
    assert simplify(3 * FloorDiv(x, 3) + Mod(x, 3)) == x
    assert simplify(2 * FloorDiv(x, 16 * v) + Mod(FloorDiv(x, v), 16)) != FloorDiv(x, v)  # not a merge


def test_division_of_a_maybe_negative_numerator_is_floor_in_triton():
    """Index expressions mean Python's // and %; Triton's truncate toward zero. A numerator that
    may be negative ((w - 1) // 4, once a constant multiple is split off) is printed through the
    floor helpers, and its quotient is not assumed non-negative (a Mod around it would drop the
    helper)."""
    import sympy
    from codegen.common import texpr
    from commfuse.sizevars import FloorDiv, Mod
    w, h = (sympy.Symbol(s, integer=True, nonnegative=True) for s in "wh")
    assert texpr(FloorDiv(w + 3, 4)) == "((w + 3) // (4))"
    assert texpr(Mod(w, 4)) == "((w) % (4))"
    assert "div_floor" in texpr(FloorDiv(w - 1, 4))
    assert FloorDiv(w - 1, 4).is_nonnegative is not True
    assert texpr(Mod(FloorDiv(w - 1, 4) + h, 4)).startswith("triton_helpers.remainder(")


def test_a_negative_symbolic_slice_start_counts_from_the_end():
    """`full[:, -w + 1:]` with w symbolic (dynamic=True; HF's sliding-window cache slices so):
    torch wraps the start by the dim's size, as the hint says it is negative (Dynamo guards it).
    The start was taken as it is: the view's offset was negative, and a kernel reading the slice
    made it 11 rows long instead of 3."""
    def view(a, b, w):
        full = torch.cat([a, b], dim=1)
        return full, full[:, -w + 1:]

    def read(a, b, w):
        full = torch.cat([a, b], dim=1)
        return full[:, -w + 1:] * 2, full.select(1, -w)
    for fn in (view, read):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="commfuse", dynamic=True)
        for w in (4, 5):
            a, b = torch.randn(2, 7, 3, device=DEVICE), torch.randn(2, 1, 3, device=DEVICE)
            for got, want in zip(compiled(a, b, w), fn(a, b, w)):
                assert got.shape == want.shape and torch.equal(got, want), (fn.__name__, w)


def test_an_empty_symbolic_slice_is_empty():
    """`x[:, a:b]` with a > b, both symbolic: torch takes it as empty (guarded). Its length was
    b - a, negative: an allocation failed, and a `cat` with it read garbage, silently."""
    def fn(x, y, a, b):
        return torch.cat([x[:, a:b], y], 1) * 2, x[:, a:b] + 1
    compiled = torch.compile(fn, backend="commfuse", dynamic=True)
    for a, b, n in ((2, 5, 8), (5, 2, 8), (7, 3, 10)):
        x, y = torch.randn(3, n, device=DEVICE), torch.ones(3, 2, device=DEVICE)
        for got, want in zip(compiled(x, y, a, b), fn(x, y, a, b)):
            assert got.shape == want.shape and torch.equal(got, want), (a, b)


def test_abs_of_a_symbolic_size_prints():
    """`abs()` of a SymInt in a size reached the host code as sympy's `Abs`, an undefined name."""
    def fn(x, s):
        return x.narrow(0, s, x.shape[0] - abs(s)).sum(0)
    compiled = torch.compile(fn, backend="commfuse", dynamic=True)
    for n, s in ((8, 2), (10, 3)):
        x = torch.arange(3.0 * n, device=DEVICE).reshape(n, 3)
        torch.testing.assert_close(compiled(x, s), fn(x, s))


def test_a_view_inferring_a_dim_from_a_symbolic_one_compiles(tmp_path):
    """`x.view(-1, w)` with w symbolic: the inferred dim is numel // w, an exact division. It was
    numel / w, which no kernel or host code can print: the whole graph fell back to aten."""
    def fn(x, w):
        return x.view(-1, w) * 2
    for i, (shape, w) in enumerate((((4, 6), 3), ((3, 10), 5))):
        x = torch.arange(float(shape[0] * shape[1]), device=DEVICE).reshape(shape)
        out, dumps = compile_and_run(fn, x, w, tmp_path=tmp_path / str(i), dynamic=True)
        torch.testing.assert_close(out, fn(x, w))
        assert all(dumps.summary(g)["compiled"] for g in dumps.graphs())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_float_arange_with_symbolic_bounds_compiles(tmp_path, dtype):
    """`torch.arange(-a, n - a, dtype=float)` and `arange(0, n * w, w)` with a, w symbolic: a float
    arange took its start and step as literals, which a symbol is not: the graph fell back whole."""
    def fn(x, a, w):
        n = x.shape[0]
        return x[:, None] * torch.arange(-a, n - a, dtype=dtype, device=x.device) + \
            torch.arange(0, n * w, w, dtype=dtype, device=x.device)[:, None]
    for i, (n, a, w) in enumerate(((4, 2, 3), (5, 3, 2))):
        x = torch.arange(float(n), dtype=dtype, device=DEVICE)
        out, dumps = compile_and_run(fn, x, a, w, tmp_path=tmp_path / str(i), dynamic=True)
        torch.testing.assert_close(out, fn(x, a, w))
        assert all(dumps.summary(g)["compiled"] for g in dumps.graphs())


def test_a_broadcast_of_sizes_equal_by_a_guard_lowers(tmp_path):
    """`x[::2] * x[1::2]` under a guarded `n % 2 == 0` (torch's generic associative_scan, which HF
    Mamba runs, halves a sequence so): its sizes (n + 1) // 2 and n // 2 are equal by Dynamo's guard,
    which fake tensors checked, not by their form. The mul ran through aten ("cannot prove broadcast
    sizes equal"); sizes are now also equal where torch's shape env proves it from its guards."""
    def fn(x):
        if x.shape[0] % 2 == 0:
            return x[::2] * x[1::2] + 1
        return x
    x = torch.randn(8, 3, device=DEVICE)
    torch._dynamo.mark_dynamic(x, 0)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    summary, code = dumps.only()
    assert summary["fallback_ops"] == [], summary["fallback_reasons"]


def test_a_reshape_into_chunks_of_a_padded_length_lowers(tmp_path):
    """HF Mamba2 pads a sequence to a multiple of 4, `(4 - n % 4) % 4`, then views it in chunks of
    4. The padded length n + (-n) % 4 is a multiple of 4 by arithmetic (no guard says so), which
    the view needs: it ran through aten ("needs a size relation we cannot prove")."""
    def fn(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, (4 - x.shape[1] % 4) % 4))
        return x.reshape(x.shape[0], -1, 4, x.shape[2]) * 2
    x = torch.randn(2, 6, 16, device=DEVICE)
    torch._dynamo.mark_dynamic(x, 1)
    out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    torch.testing.assert_close(out, fn(x))
    summary, _ = dumps.only()
    assert summary["fallback_ops"] == [], summary["fallback_reasons"]


def test_modular_identities():
    """What that needs: y % b is y modulo b inside a sum taken modulo b; x - b * (x // b) is
    x % b; a positive common factor divides out of a floor division; a multiple a of k over
    a // k is k."""
    import sympy
    from commfuse.sizevars import FloorDiv, Mod, equal, simplify
    n, t = sympy.symbols("n t", integer=True, positive=True)
    assert Mod(-Mod(n, 4), 4) == Mod(-n, 4) and Mod(n + Mod(-n, 4), 4) == 0
    assert FloorDiv(32 * n + 64 * t, 128) == FloorDiv(n + 2 * t, 4) and FloorDiv(4 * t * n, 16 * t) == FloorDiv(n, 4)
    padded = n + Mod(-n, 4)  # a multiple of 4: padded // (padded // 4) is 4 (a reshape's inferred -1)
    assert FloorDiv(padded, FloorDiv(padded, 4)) == 4 and FloorDiv(n, FloorDiv(n, 4)) != 4
    assert simplify(2 * n - 8 * FloorDiv(n, 4) + 1) == 2 * Mod(n, 4) + 1
    assert equal(4 * FloorDiv(n + Mod(-n, 4), 4), n + Mod(-n, 4)) and not equal(4 * FloorDiv(n, 4), n)
    for v in range(-9, 10):  # the rewritten forms agree with Python's // and % (negative values too)
        assert Mod(-n, 4).subs(n, v) == (-(v % 4)) % 4
        assert FloorDiv(n + 2 * t, 4).subs({n: v, t: 1}) == (32 * v + 64) // 128
        assert (2 * Mod(n, 4) + 1).subs(n, v) == 2 * v - 8 * (v // 4) + 1
        if v > 0:
            assert (v + (-v) % 4) // ((v + (-v) % 4) // 4) == 4


def test_division_by_an_integer_agrees_with_python():
    """FloorDiv and Mod by an integer (the fast path without sympy's polys: each term's integer
    coefficient divided) equal Python's // and % at every point, for sums of scaled indices,
    nested divisions and common factors."""
    import random

    import sympy
    from commfuse.sizevars import FloorDiv, Mod, index_symbol
    xs = [index_symbol("x", i) for i in range(3)]
    rng = random.Random(0)
    for _ in range(200):
        coeffs = [rng.choice([1, 2, 3, 4, 8, 12, 64, 96, 4096]) for _ in xs]
        e = sum(c * x for c, x in zip(coeffs, xs)) + rng.choice([0, 1, 6, 64])
        d, m = rng.choice([2, 3, 4, 8, 12, 64, 4096]), rng.choice([2, 4, 5, 16])
        exprs = (FloorDiv(e, d), Mod(e, d), Mod(FloorDiv(e, d), m), FloorDiv(Mod(e, d * m), d))
        for _ in range(5):
            point = {x: rng.randrange(0, 50) for x in xs}
            v = int(e.subs(point))
            want = (v // d, v % d, (v // d) % m, (v % (d * m)) // d)
            assert [int(x.subs(point)) for x in exprs] == list(want), (e, d, m, exprs)
    assert FloorDiv(8 * xs[0] + 4, 12) == FloorDiv(2 * xs[0] + 1, 3) and Mod(64 * xs[0] + xs[1], 64) == Mod(xs[1], 64)
    assert FloorDiv(sympy.Integer(9) * xs[0], 3) == 3 * xs[0]
    y = xs[0] + xs[1]  # x % m is below m: floor-divided by m or more, 0 (else a view's index keeps a 0 term)
    assert FloorDiv(Mod(y, 24), 24) == 0 and FloorDiv(Mod(y, 12), 24) == 0 and FloorDiv(Mod(y, 48), 24) != 0
    # an empty tensor's indices divide by its empty dim: no element has one, so 0 (a zero-size
    # reduction's output raised ZeroDivisionError at compile time, substituted at the origin)
    assert Mod(4 * xs[0], 0) == 0 and FloorDiv(4 * xs[0], 0) == 0 and FloorDiv(sympy.Integer(3), 0) == 0


def test_division_by_a_product_of_sizes_agrees_with_sympy_and_python():
    """A divisor that is a product of sizes (s0 * 64) divides each term of an index, as an integer
    divisor does, without sympy's cancel and gcd (a tenth of a second a call on a large graph with
    symbolic sizes: Funnel's dynamic recompile took minutes on a GPU). The quotient and common
    factor equal sympy's, and FloorDiv / Mod equal Python's // and % at every point."""
    import random

    import sympy
    from commfuse.sizevars import FloorDiv, Mod, _common_factor, _quotient, index_symbol
    s = sympy.symbols("s0 s1", integer=True, positive=True)
    xs = [index_symbol("x", i) for i in range(2)]
    rng = random.Random(0)
    sums = [s[0] + 1, s[1] - 2, FloorDiv(s[0] - 1, 2) + 1]  # divisors that are not monomials: sympy's cancel
    monomials = [s[0], s[1], s[0] * s[1], s[0] ** 2, 1, xs[0], xs[0] * s[0], xs[1] * s[0] * s[1], *sums,
                 xs[0] * sums[0], (sums[1] * xs[1]).expand(), sums[2] ** 2]
    for _ in range(400):
        a = sympy.Add(*[rng.choice([1, 2, 3, 4, 8, 64]) * rng.choice(monomials) for _ in range(rng.randrange(1, 4))])
        b = rng.choice([1, 2, 4, 64]) * rng.choice([s[0], s[1], s[0] * s[1], s[0] ** 2, *sums])
        want, got = sympy.cancel(a / b), _quotient(a, b)
        gens = [*s, *xs, FloorDiv(s[0] - 1, 2)]
        exact = want.is_polynomial(*gens) and all(c.is_Integer for c in sympy.Poly(want, *gens).coeffs())
        assert (got is not None) == exact and (got is None or sympy.expand(got - want) == 0), (a, b, got, want)
        g = sympy.Integer(1) * _common_factor(a, b)  # over a monomial b, sympy's gcd up to an integer
        assert _quotient(a, g) is not None and _quotient(b, g) is not None
        assert b.is_Add or b.func is FloorDiv or sympy.cancel(sympy.gcd(a, b) / g).is_Integer, (a, b, g)
        point = {**{x: rng.randrange(3, 9) for x in s}, **{x: rng.randrange(0, 50) for x in xs}}
        v, d = int(a.subs(point)), int(b.subs(point))
        assert (int(FloorDiv(a, b).subs(point)), int(Mod(a, b).subs(point))) == (v // d, v % d), (a, b, point)
    x = xs[0]  # a product of sums hides a multiple from its terms: sympy's cancel, which expands it
    assert _quotient((s[0] + 1) * x - x, s[0]) == x and FloorDiv((s[0] + 1) * x - x, s[0]) == x
