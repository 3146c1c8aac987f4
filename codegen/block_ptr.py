"""N-D block pointers: loads and stores whose index is an affine combination of divisions and
modulos of the kernel's flat indices (permuted N-D tensors, padded rows, broadcasts) address
one N-D box per program instead of XBLOCK (x RBLOCK) separate pointers.

Along each kernel axis (x; and r in 2-D kernels) the index's terms `stride * ((i // d) % m)`
split the axis into dims, and whatever the index skips are stride-0 (broadcast) dims. A
program's block of the axis is an N-D box when the inner size of every dim (the product of
the dims inside it) is a power of 2 or a multiple of the largest block; then each dim's block
extent is a power of 2 as well. Stride-0 dims are left out of the pointer and broadcast after
the load. Triton versions without `tl.make_block_ptr` get the same box as N-D pointer arithmetic.
"""
from __future__ import annotations

import dataclasses

import sympy

from commfuse import sizevars
from commfuse.compat import triton_has_block_ptr
from commfuse.sizevars import FloorDiv, Mod

from .common import texpr


@dataclasses.dataclass
class Axis:
    symbol: sympy.Symbol  # the kernel's index along this axis (x0 or r0)
    numel: int
    block: str            # its block size in the kernel: XBLOCK / RBLOCK
    offset: str           # first index of the program's block, e.g. xoffset
    largest: int          # the largest block the kernel is launched with


@dataclasses.dataclass
class Dim:
    size: int
    inner: int            # product of the sizes of the dims inside it, on its axis
    stride: sympy.Expr    # 0: a broadcast dim
    axis: Axis
    outermost: bool = False

    def block(self) -> str:
        """Its extent in the program's box (a constexpr expression of the block size)."""
        a = self.axis
        if self.inner % a.largest == 0:
            return "1"
        per = a.block if self.inner == 1 else f"(({a.block} + {self.inner - 1}) // {self.inner})"
        if self.outermost or self.size * self.inner >= a.largest:
            return per
        return f"({self.size} * ({self.size} <= {per}) + {per} * ({per} < {self.size}))"  # min

    def offset(self) -> str:
        o = self.axis.offset
        if o == "0":
            return "0"
        q = o if self.inner == 1 else f"({o} // {self.inner})"
        return q if self.outermost else f"({q} % {self.size})"


@dataclasses.dataclass
class BlockPtr:
    base: sympy.Expr      # constant part of the index
    dims: list            # outermost first; the x axis's dims, then the r axis's
    target: list          # the value's shape in the kernel, e.g. ["XBLOCK", "RBLOCK"]

    @property
    def kept(self) -> list:
        return [d for d in self.dims if d.stride != 0]

    def boundary(self) -> list:
        return [k for k, d in enumerate(self.kept) if d.outermost]

    def _box(self, ptr: str) -> tuple[str, str]:
        """(pointer, its masking arguments) addressing the kept dims' box."""
        kept, base = self.kept, f"{ptr} + ({texpr(self.base)})" if self.base != 0 else ptr
        if triton_has_block_ptr():
            order = sorted(range(len(kept)), key=lambda k: sizevars.hint(kept[k].stride))
            bp = (f"tl.make_block_ptr({base}, shape={[d.size for d in kept]}, "
                  f"strides=[{', '.join(texpr(d.stride) for d in kept)}], "
                  f"offsets=[{', '.join(d.offset() for d in kept)}], "
                  f"block_shape=[{', '.join(d.block() for d in kept)}], order={order})")
            return bp, f"boundary_check={self.boundary()}"
        n = len(kept)
        coords = [_arange(d) + _expand(k, n) for k, d in enumerate(kept)]
        ptrs = " + ".join([base] + [c if d.stride == 1 else f"{c} * {texpr(d.stride)}" for c, d in zip(coords, kept)])
        mask = " & ".join(f"({coords[k]} < {kept[k].size})" for k in self.boundary())
        return ptrs, f"mask={mask}" if mask else ""

    def load(self, ptr: str) -> str:
        box, check = self._box(ptr)
        pad = ", padding_option=\"zero\"" if triton_has_block_ptr() else ", other=0" if check else ""
        value = f"tl.load({box}{', ' + check if check else ''}{pad})"
        full = [d.block() for d in self.dims]
        if len(self.kept) < len(self.dims):  # broadcast along the stride-0 dims
            ones = [d.block() if d.stride != 0 else "1" for d in self.dims]
            value = f"tl.broadcast_to(tl.reshape({value}, [{', '.join(ones)}]), [{', '.join(full)}])"
        return value if full == self.target else f"tl.reshape({value}, [{', '.join(self.target)}])"

    def store(self, ptr: str, value: str) -> str:
        box, check = self._box(ptr)
        if len(self.target) > 1:  # a row value stored along a row
            value = f"tl.broadcast_to({value}, [{', '.join(self.target)}])"
        blocks = [d.block() for d in self.kept]
        if blocks != self.target:
            value = f"tl.reshape({value}, [{', '.join(blocks)}])"
        return f"tl.store({box}, {value}{', ' + check if check else ''})"


def _arange(d: Dim) -> str:
    offset = d.offset()
    return f"tl.arange(0, {d.block()})" if offset == "0" else f"({offset} + tl.arange(0, {d.block()}))"


def _expand(k: int, n: int) -> str:
    return "" if n == 1 else "[" + ", ".join(":" if j == k else "None" for j in range(n)) + "]"


def block_ptr(index: sympy.Expr, axes: list, target: list, store: bool = False) -> BlockPtr | None:
    """The N-D box `index` addresses in a kernel over `axes`, or None (plain pointers)."""
    if any(a.numel < 1 for a in axes):
        return None
    parts = {id(a): [] for a in axes}
    base = sympy.Integer(0)
    symbols = {a.symbol: a for a in axes}
    for term in sympy.Add.make_args(index):
        coeff, atom = term.as_independent(*symbols, as_Add=False)
        if atom == 1:
            base += term
            continue
        split = _digits(atom)
        if split is None or split[0] not in symbols:
            return None
        sym, d, m = split
        parts[id(symbols[sym])].append((d, m, coeff))
    dims = []
    for a in axes:
        axis_dims = _split_axis(a, parts[id(a)])
        if axis_dims is None:
            return None
        dims += axis_dims
    bp = BlockPtr(base, dims, target)
    if not bp.kept or store and len(bp.kept) < len(dims):
        return None
    if triton_has_block_ptr() and len(bp.kept) < len(dims) and len(target) == 1:
        # triton 3.6 fails to compile (make_ttir) a block-pointer load broadcast back into a 1-D
        # pointwise block (seen on H200); such loads keep plain pointers there
        return None
    return bp


def _digits(atom):
    """(symbol, d, m) for atom = (symbol // d) % m (m None: no modulo), else None."""
    m = None
    if isinstance(atom, Mod):
        atom, m = atom.args
        if not m.is_Integer:
            return None
        m = int(m)
    d = 1
    if isinstance(atom, FloorDiv):
        atom, d = atom.args
        if not d.is_Integer:
            return None
        d = int(d)
    return (atom, d, m) if isinstance(atom, sympy.Symbol) else None


def _split_axis(axis: Axis, parts: list) -> list | None:
    n = axis.numel
    by_digits = {}
    for d, m, coeff in parts:
        if m is None:
            if n % d:
                return None
            m = n // d
        by_digits[(d, m)] = by_digits.get((d, m), 0) + coeff
    dims, inner = [], 1
    for (d, m), stride in sorted(by_digits.items()):
        if d < inner or d % inner:
            return None  # overlapping digits
        if d > inner:
            dims.append(Dim(d // inner, inner, sympy.Integer(0), axis))
        dims.append(Dim(m, d, sympy.sympify(stride), axis))
        inner = d * m
    if inner > n or n % inner:
        return None
    if inner < n:
        dims.append(Dim(n // inner, inner, sympy.Integer(0), axis))
    dims = [d for d in dims if d.size != 1][::-1] or [Dim(1, 1, sympy.Integer(0), axis)]
    dims[0].outermost = True
    if any(not _pow2(d.inner) and d.inner % axis.largest for d in dims):
        return None
    return dims


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
