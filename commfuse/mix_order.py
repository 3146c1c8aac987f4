"""Mixed-order reductions: a column sum joins the row kernel that reads the same rows.

A norm's backward reads the output gradient and the input twice: the input gradient needs sums
along each row, the weight gradient sums along each column. Lowering splits a column sum in two
(lowering/reduction.py): partial sums over parts of the rows, then the parts' total. Here the
first stage joins a row kernel over the same rows and columns: its programs stride over blocks
of rows, each keeping a partial sum per column in registers and storing it once at its end, and
the second stage totals one partial per program. The rows are read once instead of twice.
"""
from __future__ import annotations

import dataclasses

import sympy

from . import sizevars
from .sizevars import RSYM, XSYM, FloorDiv, Mod
from .virtualized import V


def fuse_mixed_orders(sched) -> list[list[str]]:
    """Join each column sum's first stage to a row kernel beside it; the kernels made, by nodes."""
    made = []
    for b in list(sched.groups):
        parts = _column_parts(b)
        if parts is None:
            continue
        for a in list(sched.groups):
            if _row_kernel(a, b, parts) and (merged := _mix(sched, a, b, parts)) is not None:
                made.append(merged.names)
                break
    return made


def _column_parts(g):
    """(parts, rows, columns) of a group made only of column sums' first stages split alike."""
    found = {(getattr(getattr(n.buf, "data", None), "column_parts", ()), sizevars.product(n.ranges[1:]))
             for n in g.nodes}
    ((parts, cols),) = found if len(found) == 1 else (((), None),)
    return (*parts, cols) if parts else None


def _row_kernel(a, b, parts) -> bool:
    """Is `a` a row reduction over the same rows and columns, reading something `b` reads?"""
    _, rows, cols = parts
    return a is not b and not a.is_extern() and a.is_reduction() and not a.mixed_programs and \
        sizevars.is_static(a.X) and sizevars.is_static(a.R) and sizevars.equal(a.X, rows) and \
        sizevars.equal(a.R, cols) and _column_parts(a) is None and not a.reads_peers() and \
        not a.walked_transposed() and bool((a.read_names | a.write_names) & b.read_names)


def _mix(sched, a, b, parts):
    split, rows, cols = parts
    programs = V.choices.mix_order_programs(int(rows), int(cols), a.device)
    totals = _totals(sched, b, split)
    sched._succ = None
    if not programs or totals is None or sched._path_between(a, b) or sched._path_between(b, a):
        return None
    shape = (a.X, a.R)
    for n in b.nodes:  # row x, column r: part x % split, row x // split of that part (dealt out)
        ivars = n.loop_vars()
        m = {ivars[0]: Mod(XSYM, split), RSYM: FloorDiv(XSYM, split),
             **dict(zip(ivars[1:], sizevars.unravel(RSYM, n.ranges[1:])))}
        n.place(shape, {k: v for k, v in m.items() if isinstance(k, sympy.Symbol)})
    nodes = list(a.nodes)
    for n in b.nodes:  # after what it reads from the row kernel, before what may overwrite its inputs
        nodes.insert(1 + max((i for i, m in enumerate(nodes) if m.name in n.read_names), default=-1), n)
    merged = dataclasses.replace(a, nodes=nodes, order=min(a.order, b.order), mixed_programs=programs)
    if not sched._indices_agree(merged):
        for n in b.nodes:
            n.place(shape, None)
        return None
    for n in b.nodes:  # one partial per program
        n.column_partial = True
        n.buf.layout.size = [sympy.Integer(programs)] + list(n.buf.layout.size[1:])
    for g in totals:
        for n in g.nodes:
            if n.is_reduction():
                n.buf.data.reduction_ranges = n.rranges = [sympy.Integer(programs)]
                n.place((g.X, g.R), None)
        g.R = sympy.Integer(programs)
    sched.groups = [g for g in sched.groups if g is not a and g is not b] + [merged]
    for n in merged.nodes:
        sched.group_of[n.name] = merged
    sched._succ = None
    return merged


def _totals(sched, b, split):
    """The groups of the second stages that total `b`'s parts, if nothing else reads them and
    those groups reduce nothing else (their reductions are resized to one part per program)."""
    names = set(b.names)
    readers = [n for n in sched.nodes if n.read_names & names]
    if not readers or any(not n.is_reduction() or not sizevars.equal(n.rranges[0], split) for n in readers):
        return None
    groups = {id(sched.group_of[n.name]): sched.group_of[n.name] for n in readers}
    ok = all(not n.is_reduction() or n in readers for g in groups.values() for n in g.nodes)
    return list(groups.values()) if ok else None
