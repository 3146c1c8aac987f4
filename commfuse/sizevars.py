"""Symbolic sizes and index expressions (sympy).

Sizes are sympy integers or expressions over torch's shape symbols; loop indices
are our own non-negative integer symbols. Division and modulo of indices use
`FloorDiv` / `Mod`, which the printers in codegen turn into `//` and `%`.
"""
from __future__ import annotations

import functools
import math
from typing import Iterable, Sequence

import sympy
import torch

from .virtualized import V

Expr = sympy.Expr


class FloorDiv(sympy.Function):
    """Integer floor division (Python's //) by a positive divisor. Its numerator may be negative
    in a lane that a mask discards, or once constant multiples are split off: (w - 1) // 4."""
    is_integer = True

    def _eval_is_nonnegative(self):
        return self.args[0].is_nonnegative

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0 or b == 0:  # (an index into a dim of size 0: no element has one)
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if isinstance(a, Mod) and a.args[1].is_Integer and b.is_Integer and a.args[1] <= b:  # 0 <= x % m < b
            return sympy.Integer(0)
        if isinstance(a, FloorDiv):  # (a // b) // c == a // (b * c)
            return FloorDiv(a.args[0], a.args[1] * b)
        if isinstance(b, FloorDiv) and b.args[0] == a and Mod(a, b.args[1]) == 0:  # a // (a // k) == k
            return b.args[1]
        g = _common_factor(a, b)
        if g != 1 and None not in (q := (_quotient(a, g), _quotient(b, g))):  # (g a) // (g b) == a // b
            return FloorDiv(*q)
        # split off terms that are multiples of b: (q*b + r) // b == q + r // b only if r >= 0
        if a.is_Add:
            q, rest = [], []
            for t in a.args:
                c = _quotient(t, b)
                (rest if c is None else q).append(t if c is None else c)
            if q:
                return sympy.Add(*q) + FloorDiv(sympy.Add(*rest), b)
        return _quotient(a, b)


class Mod(sympy.Function):
    """Python's modulo by a positive divisor: never negative."""
    is_integer = True
    is_nonnegative = True

    @classmethod
    def eval(cls, a, b):
        if b == 1 or a == 0 or b == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        if a.is_Add:
            keep = [t for t in a.args if _quotient(t, b) is None]
            if len(keep) < len(a.args):
                return Mod(sympy.Add(*keep), b)
        terms = [t.as_coeff_Mul(rational=True) for t in sympy.Add.make_args(a)]
        inner = [c.is_Integer and isinstance(t, Mod) and t.args[1] == b for c, t in terms]  # y % b == y (mod b)
        if any(inner):
            return Mod(sympy.Add(*[c * (t.args[0] if i else t) for (c, t), i in zip(terms, inner)]), b)
        if _quotient(a, b) is not None:
            return sympy.Integer(0)


def _quotient(a, b):
    """a / b where that is integer-valued without division (a a multiple of b), else None. A
    monomial b (an integer, nearly every index; or a product of sizes) divides each term of a:
    no sympy polys, whose cancel costs milliseconds to a tenth of a second a call on a large
    graph's symbolic indices (minutes of a compile)."""
    if b == 0:  # (in the indices of an empty tensor)
        return None
    if a == 0:
        return sympy.Integer(0)
    terms = [t.as_coeff_Mul() for t in sympy.Add.make_args(a)]
    if (monomial := _monomial(b)) and not _sums_multiplied(terms, monomial):
        coeff, powers = monomial
        q = []
        for c, m in terms:
            if not c.is_Integer or int(c) % coeff or (powers and any(
                    m.as_powers_dict().get(x, 0) < k for x, k in powers.items())):
                return None
            q.append((int(c) // coeff) * m / sympy.Mul(*(x ** k for x, k in powers.items())))
        q = sympy.Add(*q)
        return q if _is_index_like(q) else None
    if _generators(b) - _generators(a) or (b.is_Add and not any(
            f.as_base_exp()[0].is_Add for f in sympy.Mul.make_args(a))):
        return None  # as polynomials, a lacks one of b's variables, or is a product of no sums over a sum
    q = sympy.cancel(a / b)
    return q if _is_index_like(q) else None


def _generators(e) -> set:
    """The variables of `e` as a polynomial, as sympy's cancel sees it: its symbols and the
    FloorDiv / Mod terms it adds and multiplies (not what those contain)."""
    if e.is_Number:
        return set()
    if e.is_Add or e.is_Mul:
        return set().union(*map(_generators, e.args))
    if e.is_Pow and e.exp.is_Integer and e.exp > 0:
        return _generators(e.base)
    return {e}


def _sums_multiplied(terms, monomial) -> bool:
    """Is a sum a factor of a term (x * (s0 + 1)), where b has sizes? Then a may be a multiple of b
    that its terms do not show: sympy, which expands it, decides."""
    return bool(monomial[1]) and any(f.is_Add for _, m in terms for f in m.as_powers_dict())


def _monomial(b):
    """(c, {size: power}) for b = c * the product of those powers, c a positive integer, else None."""
    c, m = b.as_coeff_Mul()
    powers = m.as_powers_dict() if m != 1 else {}
    if not c.is_Integer or c <= 0 or not all(x.is_Symbol and x.is_positive and k.is_Integer and k > 0
                                             for x, k in powers.items()):
        return None
    return int(c), powers


def _common_factor(a, b):
    """A positive factor common to `b` and every term of `a` (sizes, their products), else 1."""
    if b.is_Integer and b <= 0:
        return 1
    terms = [t.as_coeff_Mul() for t in sympy.Add.make_args(a)]
    if (monomial := _monomial(b)) and not _sums_multiplied(terms, monomial):
        coeff, powers = monomial  # gcds of the coefficients, least powers of b's sizes
        if not all(c.is_Integer for c, _ in terms):
            return 1
        g = sympy.Integer(math.gcd(coeff, *(int(c) for c, _ in terms)))
        for x, k in powers.items():
            g *= x ** min([k] + [m.as_powers_dict().get(x, 0) for _, m in terms])
        return g if g != 1 else 1
    try:
        g = sympy.gcd(a, b)
    except Exception:  # not a polynomial in its sizes (a FloorDiv's own Mod, say)
        return 1
    return g if g.is_positive and _is_index_like(g) else 1


def _is_index_like(e) -> bool:
    """An integer-valued expression without division (so it can be factored out)."""
    if e.is_Integer:
        return True
    if e.is_Rational:
        return False
    return bool(e.is_integer) and all(not (p.is_Rational and not p.is_Integer) for p in e.atoms(sympy.Rational))


def index_symbol(prefix: str, i: int) -> sympy.Symbol:
    return sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True)


XSYM, RSYM = index_symbol("x", 0), index_symbol("r", 0)  # a kernel's row index and its reduction (inner) index


def from_torch(value) -> Expr:
    """A python int, SymInt or torch sympy expression -> our sympy expression."""
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    if isinstance(value, (int, bool)):
        return sympy.Integer(int(value))
    if isinstance(value, sympy.Expr):
        return _convert_torch_functions(value)
    raise TypeError(f"not a size: {value!r}")


def _convert_torch_functions(e: Expr) -> Expr:
    if e.is_Atom:
        return e
    name = type(e).__name__
    args = [_convert_torch_functions(a) for a in e.args]
    if name in ("FloorDiv", "CleanDiv", "IntTrueDiv") and type(e) is not FloorDiv:
        return FloorDiv(*args)
    if name == "ModularIndexing":  # (a // b) % c
        return Mod(FloorDiv(args[0], args[1]), args[2])
    if name in ("PythonMod", "Mod") and type(e) is not Mod:
        return Mod(*args)
    if name == "CeilDiv":
        return FloorDiv(args[0] + args[1] - 1, args[1])
    if name in FLOAT_STEP_SIZES and V.graph is not None:
        return _derived_size(e)
    return e.func(*args)


FLOAT_STEP_SIZES = ("TruncToInt", "FloorToInt", "CeilToInt", "RoundToInt")  # int(2.0 * float(s0))


# A size torch computes through floats (interpolate by a scale factor) becomes a symbol of its own,
# which the wrapper computes on the host as torch does and kernels take as an argument: rational
# arithmetic on it would round differently from torch's floats.
def _derived_size(e: Expr) -> Expr:
    sym = V.graph.derived_sizes.get(e)
    if sym is None:
        sym = index_symbol("fs", len(V.graph.derived_sizes))
        V.graph.derived_sizes[e] = sym
        V.graph.size_hints[sym] = int(e.subs(V.graph.size_hints))
        defs = [V.graph.symbol_defs[s] for s in e.free_symbols if s in V.graph.symbol_defs]
        if defs:  # of a value read off an extern's result (`int(t.sum().item())`): known after it
            V.graph.symbol_defs[sym] = max(defs, key=list(V.graph.name_to_buffer).index)  # the last of them
    return sym


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def product(it: Iterable[Expr]) -> Expr:
    return functools.reduce(lambda a, b: a * b, it, sympy.Integer(1))


@functools.lru_cache(maxsize=1 << 16)  # a pure function of e, asked again for every access of a buffer
def simplify(e: Expr) -> Expr:
    """Expand, then fold `b*(x // b) + x % b` back into `x` (what view chains produce)."""
    e = sympy.expand(e)
    while True:
        folded = _fold_div_mod(e)
        if folded is None:
            return e
        e = sympy.expand(folded)


def _fold_div_mod(e: Expr):
    if not e.is_Add:
        return None
    terms = {}
    for t in e.args:
        coeff, rest = t.as_independent(FloorDiv, Mod, as_Add=False)
        terms[rest] = terms.get(rest, 0) + coeff
    for rest, coeff in terms.items():
        if not isinstance(rest, Mod):
            continue
        inner, b = rest.args
        if isinstance(inner, FloorDiv):  # c*b*((x//b) % n) + c*(x % b) -> c*(x % (b*n))
            x, d = inner.args
            low = Mod(x, d)
            if low in terms and sympy.expand(terms[low] * d - coeff) == 0:
                return e - coeff * rest - terms[low] * low + terms[low] * Mod(x, d * b)
        # c*b*(x // b) + c*(x % b) -> c*x; with x = y // d: c*b*(y // (d*b)) + c*((y // d) % b) -> c*(y // d)
        high = FloorDiv(inner, b)
        if high in terms and sympy.expand(terms[high] - coeff * b) == 0:
            return e - coeff * rest - terms[high] * high + coeff * inner
    for high, coeff in terms.items():  # c*x - c*b*(x // b) -> c*(x % b)
        if isinstance(high, FloorDiv):
            x, b = high.args
            c = _quotient(-coeff, b)
            if c is not None and set(sympy.Add.make_args(cx := sympy.expand(c * x))) <= set(e.args):
                return e - cx - coeff * high + c * Mod(x, b)
    return None


def simplify_with_ranges(e: Expr, ranges: dict) -> Expr:
    """`simplify`, knowing 0 <= s < ranges[s] for some symbols: a // d -> 0 and a % m -> a
    where a stays below d (resp. m) over those ranges, so that view chains that wrap an index
    in an identity (x % X, (x // C) % (X // C)) come out plain."""
    bounds = {s: int(n) - 1 for s, n in ranges.items() if sympy.sympify(n).is_Integer}

    def upper(a):  # largest value of a (>= 0), or None if unknown
        if a.is_Integer:
            return int(a)
        if a in bounds:
            return bounds[a]
        args = [upper(x) for x in a.args]
        if None in args:
            return None
        if isinstance(a, FloorDiv):
            return args[0] // args[1] if a.args[1].is_Integer and a.args[1] > 0 else None
        if isinstance(a, Mod):
            return min(args[0], args[1] - 1) if a.args[1].is_Integer else None
        if (a.is_Add or a.is_Mul) and a.is_nonnegative:
            return sum(args) if a.is_Add else math.prod(args)
        return None

    def small_part(a, b):
        """(g*y + r) // (g*k) -> y // k where 0 <= r < g, for the largest such g dividing b:
        12*x + y over 24 with y < 12 is x // 2 (heads split off a flattened dim)."""
        terms = sympy.Add.make_args(a)
        n = int(b)
        divisors = {d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)} - {1}
        for g in map(sympy.Integer, sorted(divisors, reverse=True)):
            rest = [t for t in terms if _quotient(t, g) is None]
            tops = [upper(t) if t.is_nonnegative else None for t in rest]
            if rest and len(rest) < len(terms) and None not in tops and sum(tops) < g:
                return FloorDiv(sympy.Add(*(_quotient(t, g) for t in terms if t not in rest)), n // g)
        return None

    def rewrite(a):
        if not a.args or not a.has(FloorDiv, Mod):
            return a
        inner = [rewrite(x) for x in a.args]
        if isinstance(a, (FloorDiv, Mod)) and inner[1].is_Integer:
            top = upper(inner[0])
            if top is not None and top < inner[1]:
                return sympy.Integer(0) if isinstance(a, FloorDiv) else inner[0]
            if isinstance(a, FloorDiv) and inner[0].is_Add and (split := small_part(inner[0], inner[1])) is not None:
                return split
        return a.func(*inner)
    return simplify(rewrite(simplify(e)))


def equal(a, b) -> bool:
    """Known equal: structurally (after expansion), or by a guard of Dynamo's that torch's shape env
    holds (`(n + 1) // 2 == n // 2` once `n % 2 == 0` is guarded: a broadcast fake tensors checked)."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    d = simplify(a - b)
    return d == 0 or (not d.is_number and hint(a) == hint(b) and _guarded_equal(a, b))


def _guarded_equal(a: Expr, b: Expr) -> bool:
    return known_true(sympy.Eq(a, b))


def known_true(relation) -> bool:
    """Does torch's shape env know `relation` of sizes to hold (from Dynamo's guards, or a
    `torch._check` on a size known only at run time)? False where it cannot tell."""
    from torch.utils._sympy.functions import FloorDiv as TorchFloorDiv, Mod as TorchMod  # sizes' Mod
    to_torch = lambda e: e.replace(FloorDiv, TorchFloorDiv).replace(Mod, TorchMod)  # noqa: E731
    try:  # no graph or shape env, or a symbol of ours (a derived size's) unknown to it: not known
        return bool(V.graph.shape_env._maybe_evaluate_static(to_torch(relation)))
    except Exception:
        return False


def is_static(e) -> bool:
    return sympy.sympify(e).is_Integer


def hint(e) -> int:
    """A concrete value for size heuristics: the graph being compiled gives its symbols the sizes of
    its example inputs (`V.graph.size_hints`, known before lowering starts)."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return int(e)
    val = e.subs(V.graph.size_hints) if V.graph is not None else e
    try:
        return int(val)
    except TypeError:
        return 8192  # unknown symbol: guess a large size; heuristics only


def contiguous_strides(sizes: Sequence[Expr]) -> list[Expr]:
    strides, acc = [], sympy.Integer(1)
    for s in reversed(sizes):
        strides.append(acc)
        acc = acc * s
    return list(reversed(strides))


def unravel(flat: Expr, sizes: Sequence[Expr]) -> list[Expr]:
    """Row-major index vector of `flat` over `sizes` (flat < their product: the outermost dim
    that is not 1 needs no Mod)."""
    outer = next((i for i, s in enumerate(sizes) if s != 1), 0)
    out, div = [], sympy.Integer(1)
    for i in range(len(sizes) - 1, -1, -1):
        s = sizes[i]
        if s == 1:
            out.append(sympy.Integer(0))
            continue
        v = FloorDiv(flat, div)
        out.append(v if i <= outer else Mod(v, s))
        div = div * s
    return list(reversed(out))


def _affine_terms(expr: Expr, vars: Sequence[sympy.Symbol]):
    """The common case of `affine_coefficients`, term by term without differentiating: a sum of
    terms each free of `vars` or a factor times one var. None when unsure (the general path
    decides)."""
    coeffs = {v: sympy.Integer(0) for v in vars}
    offset = sympy.Integer(0)
    for term in sympy.Add.make_args(expr):
        used = [v for v in vars if term.has(v)]
        if not used:
            offset += term
            continue
        if len(used) > 1:
            return None
        factor, rest = term.as_independent(used[0], as_Add=False)
        if rest != used[0]:
            return None
        coeffs[used[0]] += factor
    return [coeffs[v] for v in vars], offset


def walks_columns(index: Expr | None, x: sympy.Symbol, r: sympy.Symbol) -> bool:
    """Does an access move by 1 along the rows `x` but jump along the reduction `r` (a column)?
    An index that is not affine (a concatenation's rows, `Mod(x, n)`) is judged by its steps at
    the origin: where the first rows are, so are the rest, for coalescing."""
    steps = walk_steps(index, [x, r])
    return steps is not None and steps[0] == 1 and steps[1] not in (0, 1)


def walk_steps(index: Expr | None, vars: Sequence[sympy.Symbol]):
    """How far an access moves for a step along each var: an affine index's coefficients, else its
    steps at the origin (where the first rows are, so are the rest, for coalescing); None if unknown."""
    if index is None:
        return None
    aff = affine_coefficients(index, vars)
    return aff[0] if aff else _steps_at_origin(index, vars)


def _steps_at_origin(expr: Expr, vars: Sequence[sympy.Symbol]):
    """How far `expr` moves for a step of 1 along each var from 0 (the others at 0); None unless
    every step is a number."""
    origin = {v: 0 for v in vars}
    base = expr.subs(origin)
    steps = [simplify(expr.subs({**origin, v: 1}) - base) for v in vars]
    return steps if all(s.is_number for s in steps) else None


def ravel(index: Sequence[Expr], sizes: Sequence[Expr]) -> Expr:
    return sum((i * s for i, s in zip(index, contiguous_strides(sizes))), sympy.Integer(0))


def affine_coefficients(expr: Expr, vars: Sequence[sympy.Symbol]):
    """(coefficients, offset) if `expr` is affine in `vars`, else None."""
    expr = simplify(expr)
    fast = _affine_terms(expr, vars)
    if fast is not None:
        return fast
    if any(f.has(*vars) for f in expr.atoms(FloorDiv, Mod)):  # its derivative would keep them
        return None
    coeffs = []
    for v in vars:
        c = expr.diff(v) if expr.has(v) else sympy.Integer(0)
        if c.free_symbols & set(vars) or c.has(FloorDiv, Mod, sympy.Derivative):
            return None
        coeffs.append(c)
    offset = expr.subs({v: 0 for v in vars})
    if simplify(expr - sum(c * v for c, v in zip(coeffs, vars)) - offset) != 0:
        return None
    return coeffs, offset
