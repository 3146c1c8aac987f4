"""Horizontal fusion of few-row matmuls: the `ir.MatmulTemplate`s that load the same `a` (q, k, v
of a decode step; gate and up) become one group, one launch whose programs run over the
concatenated column blocks of every member (codegen/matmul.py). No weight is concatenated: each
program picks its member's `b` and output. A pointwise consumer of members (SiLU(gate) * up; a
rotary embedding of q or k, stored into the KV cache; a lone matmul's bias) joins the group (of
one matmul or several) as an epilogue: one program
computes those members' column block for each of them and stores the consumer's value; a member
only it reads is never stored. The consumer reads each member at the element it computes, or at
the other half of an aligned block of columns (rotate_half within a head), under masks that keep
that read inside the block: the program swaps its tile's halves in registers. Run by the
scheduler after fusion, on groups of one matmul each (externs never fuse)."""
from __future__ import annotations

import collections

import numpy as np
import sympy
from sympy.logic.boolalg import Boolean

from . import ir, sizevars
from .dependencies import trace_body
from .sizevars import RSYM, XSYM
from .virtualized import V


def _a_key(buf: ir.MatmulTemplate) -> tuple:
    """What `a` the loader computes: its traced body (loads and ops) over a's [M, K]."""
    body = trace_body(ir.Pointwise(buf.get_device(), buf.get_dtype(), buf.a_loader, list(buf.a_size)))
    return str(buf.get_device()), buf.get_dtype(), tuple(map(str, buf.a_size)), body.text


def group_matmuls(sched) -> None:
    """Merge matmul groups of one `a` (greedily, in program order, as policy allows), then take
    their pointwise epilogues."""
    sched._succ = None
    by_a = collections.defaultdict(list)
    for g in sorted(sched.groups, key=lambda g: g.order):
        if len(g.nodes) == 1 and isinstance(g.nodes[0].buf, ir.MatmulTemplate):
            by_a[_a_key(g.nodes[0].buf)].append(g)
    for groups in by_a.values():
        while len(groups) > 1:
            merged, rest = groups[0], []
            for g in groups[1:]:
                if V.choices.mm_group_member(len(merged.nodes)) and _independent(sched, merged, g):
                    merged = _replace(sched, [merged, g], merged.nodes + g.nodes)
                else:
                    rest.append(g)
            groups = rest
    for g in [g for g in sched.groups if isinstance(g.nodes[0].buf, ir.MatmulTemplate)]:
        for c in sorted(sched.groups, key=lambda c: c.order):
            members, swaps = _epilogue_members(sched, g, c)
            if members and V.choices.mm_epilogue(len(members), _shape(g), tile_width(swaps.values())):
                for node in c.nodes:
                    node.half_swaps = swaps[node.name]
                g = _replace(sched, [g, c], g.nodes + c.nodes)


def _independent(sched, a, b) -> bool:
    """Neither needs the other, directly or through some other group."""
    return not (id(a) in sched.group_deps(b) or id(b) in sched.group_deps(a)
                or sched._path_between(a, b) or sched._path_between(b, a))


def _replace(sched, old: list, nodes: list):
    group = type(old[0])(nodes, sympy.Integer(0), sympy.Integer(1), min(g.order for g in old))
    sched.groups = [g for g in sched.groups if all(g is not o for o in old)] + [group]
    for n in nodes:
        sched.group_of[n.name] = group
    sched._succ = None
    return group


def _shape(g) -> tuple:
    """(M, N of all members, K, device) of matmul group `g`: what its blocks are chosen for."""
    members = [n.buf for n in g.nodes if isinstance(n.buf, ir.MatmulTemplate)]
    m, k = (int(s) for s in members[0].a_size)
    return m, sum(int(b.layout.size[1]) for b in members), k, members[0].get_device()


def member_index(buf: ir.MatmulTemplate, m: int):
    """Where an epilogue reads member `buf` at its own element, in the epilogue's (x, r) kernel of
    `m` rows: of one row, no x (the node's placement drops an index over one element, as here)."""
    return buf.layout.index([XSYM if m > 1 else sympy.Integer(0), RSYM])


def tile_width(swaps) -> int:
    """The columns a program's tile spans at least: 16 (tl.dot's least), or the widest block whose
    halves an epilogue swaps (`swaps`: epilogue_shifts' results)."""
    return max([16, *(b for s in swaps for b in s.values())])


def _epilogue_members(sched, g, c) -> tuple[list, dict]:
    """The members of matmul group `g` that group `c` can take as an epilogue, and each node's
    `epilogue_shifts`: each node of `c` is pointwise, reads its own members (all of N columns) at
    the element it computes or at a column `epilogue_shifts` allows, and stores an ordinary or
    scattered buffer; nothing else `c` reads depends on `g`. ([], {}) where it cannot."""
    if c.is_extern() or c.is_reduction() or c.reads_peers():
        return [], {}
    free = {n.name: n.buf for n in g.nodes if isinstance(n.buf, ir.MatmulTemplate) and n.buf.out_view is None
            and type(n.buf.layout) is ir.FixedLayout}
    taken = {name for n in g.nodes if not n.is_extern() for name in n.read_names}
    out, swaps = [], {}
    for node in c.nodes:
        if type(node.buf.layout) not in (ir.FixedLayout, ir.FlexibleLayout, ir.ScatterLayout):
            return [], {}
        members = [free[r] for r in sorted(node.read_names) if r in free and r not in taken]
        if not members or len({int(b.layout.size[1]) for b in members}) != 1 or set(members) & set(out):
            return [], {}
        m, n = (int(s) for s in members[0].layout.size)
        if node.kernel_index_map(m, n) is None or (shifts := epilogue_shifts(node, members, m, n)) is None:
            return [], {}
        out, swaps[node.name] = out + members, shifts
    return ([], {}) if sched._path_between(g, c) else (out, swaps)


MIN_HALF = 8  # blocks of 16 columns and up (heads): the swap's narrower reshapes have not run on a GPU


def epilogue_shifts(node, members: list, m: int, n: int) -> dict | None:
    """{member name: B} for the members pointwise `node` reads, wherever its masks let it read, at
    the column of the other half of each aligned block of B columns, B a power of two (column
    c ^ B/2: a rotary embedding's rotate_half within a head, GPT-J's within a pair); {} where it
    reads them all in place; None where it reads one otherwise."""
    own = {b.name: member_index(b, m) for b in members}
    handler = _MaskedLoads()
    with V.set_ops(handler):
        node.run_body(node.body_index(node.kernel_index_map(m, n)))
    cols, out, modules = np.arange(n), {}, [{"FloorDiv": np.floor_divide, "Mod": np.mod}, "numpy"]
    for name, index, where in handler.loads:
        if name not in own or sizevars.equal(index, own[name]):
            continue
        shift = sizevars.simplify(index - own[name])  # columns off the element's own, per column
        if (shift.free_symbols | where.free_symbols) - {RSYM}:
            return None
        try:
            kept = np.broadcast_to(sympy.lambdify(RSYM, where, modules)(cols), n)
            to = cols + np.broadcast_to(sympy.lambdify(RSYM, shift, modules)(cols), n)
        except Exception:  # what numpy cannot evaluate is not proven: not fused
            return None
        half = int(abs(to - cols)[kept].max(initial=0))
        block = out.get(name, 2 * half)
        if half < MIN_HALF or block != 2 * half or half & (half - 1) or not np.all((to == cols ^ half)[kept]):
            return None
        out[name] = block
    return out


class _MaskedLoads:
    """An ops handler that records each load with the index conditions of the `ops.masked` around
    it (a concatenation's halves), as one sympy condition; other values are opaque (None)."""
    _RELATIONS = {"lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge, "eq": sympy.Eq, "ne": sympy.Ne}

    def __init__(self):
        self.loads, self._masks = [], []

    def index_expr(self, expr, dtype):
        return sympy.sympify(expr)

    def logical_and(self, a, b):  # an opaque side widens the condition: what is checked is a superset
        return sympy.And(*[v for v in (a, b) if isinstance(v, Boolean)])

    def masked(self, mask, body, other):
        self._masks.append(mask if isinstance(mask, Boolean) else sympy.true)
        try:
            body()
        finally:
            self._masks.pop()

    def load(self, name, index):
        self.loads.append((name, index, sympy.And(*self._masks)))

    def indirect_indexing(self, value, size, check=True, wrap=True):
        return sympy.Dummy("indirect", integer=True)  # an index that depends on data: no shift

    def __getattr__(self, op):
        rel = self._RELATIONS.get(op)
        return (lambda a, b: rel(a, b) if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr) else None) \
            if rel else (lambda *args, **kwargs: None)
