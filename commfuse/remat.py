"""Rematerialization across kernels. When two groups cannot fuse (each has its own reduction, say),
a pointwise value one writes and the other reads back can often be recomputed by the reader
from buffers it reads anyway: then it is neither written nor read again (NVIDIA/Fuser#2473).

For each kernel, the buffers it reads from other kernels, with what they are computed from, form
a graph: stored pointwise values over buffers that must be read (inputs, reductions, extern
outputs, values too costly to recompute). Each buffer costs its bytes if read. A minimum cut
between "in memory" and "needed by this kernel" chooses what to read; everything between the
cut and the kernel is recomputed in it.
"""
from __future__ import annotations

import networkx as nx

from . import ir
from .virtualized import V


def rematerialize(sched) -> list[dict]:
    """Rewrite each kernel of `sched` to recompute what is cheaper than reading it back; the
    decisions, with the bytes the kernel reads before and after."""
    recomputable = _recomputable(sched)
    log = []
    for group in sched.groups:
        if group.is_extern():
            continue
        plan = _plan(sched, group, recomputable)
        if plan is None:
            continue
        inline, reads, before, after = plan
        for node in group.nodes:
            if node.read_names & set(inline):
                node.inline({name: sched.graph.name_to_buffer[name] for name in inline})
        log.append({"kernel": group.names, "recomputes": sorted(inline), "reads": sorted(reads),
                    "bytes_before": before, "bytes_after": after})
    return log


def _recomputable(sched) -> set:
    """Buffers a kernel may recompute instead of reading: stored pointwise values, densely laid
    out, cheap to compute (choices.can_recompute), over buffers that are never overwritten
    (mutated in place, or comm buffers that an in-place collective reduces into)."""
    volatile = {m for n in sched.nodes for m in getattr(n.buf, "mutates", None) or ()}
    volatile |= {n.name for n in sched.nodes if isinstance(n.buf.layout, ir.CommLayout)}
    volatile |= {name for name, b in sched.graph.graph_inputs.items()
                 if isinstance(b, ir.Buffer) and isinstance(b.layout, ir.CommLayout)}
    out = set()
    for n in sched.nodes:
        buf = n.buf
        if isinstance(buf, ir.ComputedBuffer) and isinstance(buf.data, ir.Pointwise) \
                and not ({buf.name} | n.read_names) & volatile \
                and buf.layout.is_dense() and buf.layout.offset == 0 and V.choices.can_recompute(buf.data):
            out.add(buf.name)
    return out


def _plan(sched, group, recomputable):
    """(buffers to recompute, buffers read instead, bytes read before, after) or None."""
    produced = set(group.names)
    direct = {acc.name for n in group.nodes for acc in n.reads if acc.name not in produced}
    indirect = {acc.name for n in group.nodes for acc in n.reads if acc.indirect}
    if not any(name in recomputable and name not in indirect for name in direct):
        return None  # nothing to recompute: the cut is every read (most kernels; skips networkx)
    flow, seen = nx.DiGraph(), set()
    flow.add_nodes_from(["memory", "kernel"])

    def visit(name):
        if name in seen:
            return
        seen.add(name)
        flow.add_edge(("in", name), ("out", name), capacity=sched._bytes(name))
        if name in recomputable and name not in indirect:
            for src in sorted(sched.node_of[name].read_names):
                visit(src)
                flow.add_edge(("out", src), ("in", name))  # no capacity: infinite
        else:
            flow.add_edge("memory", ("in", name))

    for name in direct:
        visit(name)
        flow.add_edge(("out", name), "kernel")
    after, (in_memory, _) = nx.minimum_cut(flow, "memory", "kernel")
    before = sum(sched._bytes(name) for name in direct)
    if after >= before:
        return None
    inline = {name for name in seen if ("in", name) not in in_memory}
    reads = {name for name in seen if ("in", name) in in_memory and ("out", name) not in in_memory}
    return inline, reads, before, after


def cross_kernel_bytes(sched) -> int:
    """Bytes of buffers one kernel writes and others read: written once, read by each."""
    total = 0
    for name, readers in sched.readers.items():
        producer = sched.group_of.get(name)
        others = [g for g in readers if g is not producer]
        if producer is not None and others and name not in sched.internal:
            total += sched._bytes(name) * (1 + len(others))
    return total
