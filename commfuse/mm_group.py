"""Horizontal fusion of few-row matmuls: the `ir.MatmulTemplate`s that load the same `a` (q, k, v
of a decode step; gate and up) become one group, one launch whose programs run over the
concatenated column blocks of every member (codegen/matmul.py). No weight is concatenated: each
program picks its member's `b` and output. A pointwise consumer that reads several members
elementwise (SiLU(gate) * up) joins the group as an epilogue: one program computes those members'
column block for each of them and stores the consumer's value; a member only it reads is never
stored. Run by the scheduler after fusion, on groups of one matmul each (externs never fuse)."""
from __future__ import annotations

import collections

import sympy

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
    for g in [g for g in sched.groups if isinstance(g.nodes[0].buf, ir.MatmulTemplate) and len(g.nodes) > 1]:
        for c in sorted(sched.groups, key=lambda c: c.order):
            members = _epilogue_members(sched, g, c)
            if members and V.choices.mm_epilogue(len(members)):
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


def _epilogue_members(sched, g, c) -> list:
    """The members of matmul group `g` that group `c` can take as an epilogue: `c` is one pointwise
    node that reads them, all of N columns, at the element it computes ([m, n] of its M x N
    elements), and whose output is an ordinary buffer; nothing else `c` reads depends on `g`.
    [] where it cannot."""
    if len(c.nodes) != 1 or c.is_extern() or c.is_reduction() or c.reads_peers():
        return []
    if type((node := c.nodes[0]).buf.layout) not in (ir.FixedLayout, ir.FlexibleLayout):
        return []
    free = {n.name: n.buf for n in g.nodes if isinstance(n.buf, ir.MatmulTemplate) and n.buf.out_view is None
            and type(n.buf.layout) is ir.FixedLayout}
    taken = {name for n in g.nodes if not n.is_extern() for name in n.read_names}
    members = [free[r] for r in sorted(node.read_names) if r in free and r not in taken]
    if not members or len({int(b.layout.size[1]) for b in members}) != 1:
        return []
    m, n = (int(s) for s in members[0].layout.size)
    if node.kernel_index_map(m, n) is None or sched._path_between(g, c):
        return []
    names = {b.name: b.layout.index([XSYM, RSYM]) for b in members}
    for _, kind, name, index in type(g)([node], m, n, c.order).kernel_accesses(set(names)):
        if kind == "read" and name in names and (index is None or not sizevars.equal(index, names[name])):
            return []
    return members
