"""Loop ordering after fusion: two groups that share a buffer but walk it in different orders
cannot share its loads. Permuting the loops of the pointwise one (its accesses keep their
indices; only the iteration order changes) can make both walk it alike, so that they fuse and
the buffer is read once. Example: `x.sum(-1)` and `(x / 10).t().contiguous()`."""
from __future__ import annotations

import collections

import sympy

from . import sizevars
from .dependencies import index_vars


def sizes_key(sizes) -> tuple:
    """Loop sizes in one normalized form: a list and a tuple of equal sizes compare equal."""
    return tuple(sympy.sympify(s) for s in sizes)


def loop_dims(node, index) -> list | None:
    """(size, stride) of `index` along each loop of `node` (pointwise loops, then reduction
    loops), outermost first; None where the index is not affine in the loop variables."""
    vars = node.loop_vars() + index_vars("r", node.rranges)
    sizes = node.ranges + node.rranges
    symbols = [v for v in vars if isinstance(v, sympy.Symbol)]
    affine = sizevars.affine_coefficients(index, symbols)
    if affine is None:
        return None
    stride = dict(zip(symbols, affine[0]))
    return [(sympy.sympify(n), stride.get(v, sympy.Integer(0))) for v, n in zip(vars, sizes)]


def _access(group, name):
    for n in group.nodes:
        for acc in n.reads + n.writes:
            if acc.name == name and not acc.indirect:
                return n, acc.index
    return None, None


def matching_order(p, o, names) -> list | None:
    """A permutation of the loops of the pointwise group `p` under which `p` walks one of the
    buffers `names` as group `o` does; None if there is none or `p` walks it so already."""
    if p.is_reduction() or p.is_extern() or o.is_extern():
        return None
    if len({sizes_key(n.ranges) for n in p.nodes}) != 1:  # all nodes on the same loops
        return None
    for name in names:
        pn, pindex = _access(p, name)
        on, oindex = _access(o, name)
        if pn is None or on is None:
            continue
        pdims, odims = loop_dims(pn, pindex), loop_dims(on, oindex)
        if pdims is None or odims is None:
            continue
        odims = [d for d in odims if d[0] != 1]
        loops = [k for k, d in enumerate(pdims) if d[0] != 1]
        if any(s == 0 for _, s in odims) or \
                collections.Counter(odims) != collections.Counter(pdims[k] for k in loops):
            continue
        matched = []
        for dim in odims:
            matched.append(next(k for k in loops if pdims[k] == dim and k not in matched))
        if matched != loops:
            return [k for k, d in enumerate(pdims) if d[0] == 1] + matched  # size-1 loops: anywhere
    return None


def reorder(group, order) -> callable:
    """Permute the loops of every node of `group` by `order`; returns the undo."""
    saved = [(n, n.loop_order) for n in group.nodes]
    for n in group.nodes:
        n.reorder_loops([n.loop_order[k] for k in order])

    def undo():
        for n, old in saved:
            n.reorder_loops(old)
    return undo
