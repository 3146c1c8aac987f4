"""Collectives (`_c10d_functional` ops).

An eligible all-reduce (commfuse/choices.py: `comm_choice`) runs over symmetric memory: one-shot
and two-shot as a loop body that reads the peers' copies (`ops.peer_reduce`), so its consumers
fuse into it (codegen/triton.py picks the loads by `graph.comm_algorithms`); in-place and torch's
kernel as a CommKernel. Its input is made a comm buffer here, at lowering time, so the kernel
that produces it (a fused Triton kernel, or an extern mm through `out=`)
writes straight into the persistent pool: no copy in, also through views that only reshape it
(a row-parallel linear's 2-D mm output viewed back to (batch, seq, hidden)). Values we do not
produce (graph inputs, other views) get one copy kernel, fused with the pointwise op before it.
Everything else — other collectives, ineligible all-reduces — runs the c10d op
asynchronously, waited on where the graph waits.
"""
from __future__ import annotations

import logging

import torch

from commfuse import choices, ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.virtualized import V, ops

from . import register

log = logging.getLogger("commfuse")
c10d = torch.ops._c10d_functional


def _placeable(d) -> bool:
    """A producer of ours whose output we may place: a fused kernel's buffer whose strides are
    still ours to choose, or a contiguous out= extern (mm)."""
    return (isinstance(d, ir.ComputedBuffer) and isinstance(d.layout, ir.FlexibleLayout) or
            isinstance(d, ir.ExternKernel) and d.out_variant and d.layout.is_contiguous()) \
        and d.name not in V.graph.comm_buffers


def _reshaped(x: TensorBox):
    """The placeable producer that views of `x` only reshape (each element once, in order), else None."""
    root = ir.view_root(x)
    d = root.data
    if root is x or not _placeable(d) or not sizevars.equal(sizevars.product(x.get_size()), sizevars.product(d.get_size())):
        return None
    affine = ir._view_affine(x, ir.contiguous_layout(d.get_device(), d.get_dtype(), d.get_size()))
    if affine is None:
        return None
    strides, offset = affine
    size = x.get_size()
    return d if sizevars.equal(offset, 0) and all(
        sizevars.equal(a, b) for n, a, b in zip(size, strides, sizevars.contiguous_strides(size)) if n != 1) else None


def make_comm_buffer(x: TensorBox, group_name: str, kind: str, through_views: bool = False) -> ir.Buffer:
    """Store `x` in a comm buffer of `group_name`, written by its producer where we own it. With
    `through_views`, the buffer may be the producer under reshaping views of `x` (its size is then
    the producer's, its contiguous storage element for element `x`'s)."""
    producer = _reshaped(x) if through_views else None
    d = x.data if producer is None else producer
    size = list(d.get_size() if producer is not None else x.get_size())
    graph = V.graph
    layout = ir.CommLayout(x.get_device(), x.get_dtype(), size, sizevars.contiguous_strides(size),
                           group=group_name, kind=kind)
    if _placeable(d):
        d.layout = layout  # the producer writes into the pool
        buf = d
    else:
        loader = x.make_loader() if not isinstance(d, ir.Loops) else d.inner_fn
        src = d if isinstance(d, ir.Pointwise) else Pointwise(x.get_device(), x.get_dtype(), loader, size)
        buf = graph.register_buffer(ir.ComputedBuffer, layout=layout, data=src)
        if not isinstance(d, ir.Loops):
            graph.comm_copies.append(buf.name)  # a copy in: the value was not ours to place
        x.data = buf
    graph.comm_buffers[buf.name] = (kind, group_name)
    return buf


def _all_reduce(x, reduce_op, group_name, inplace):
    graph = V.graph
    algorithm, reason = choices.comm_choice("all_reduce", x, reduce_op, group_name)
    if algorithm == "c10d":
        graph.comm_fallbacks.append({"op": "all_reduce", "reason": reason})
        # a dynamic-shape recompile silently losing the fast path is worth one warning
        (log.warning if reason.startswith("symbolic size") else log.info)(
            "commfuse: all_reduce on %s runs through c10d: %s", group_name, reason)
        return None
    # in place, the result is the buffer itself: it must have x's size
    buf = make_comm_buffer(x, group_name, "all_reduce", through_views=not inplace)
    if reason:
        graph.comm_choices.append({"op": "all_reduce", "buffer": buf.name, "algorithm": algorithm, "reason": reason})
    if algorithm in choices.SYMM_ALGORITHMS and not inplace:
        # a loop body reading the peers' copies: it fuses with its consumers like any pointwise node
        # indexed as x: the buffer is contiguous, possibly under another shape (a reshaped producer)
        name, layout = buf.name, ir.contiguous_layout(x.get_device(), x.get_dtype(), x.get_size())
        graph.comm_algorithms[name] = algorithm
        result = TensorBox(Pointwise(x.get_device(), x.get_dtype(),
                                     lambda idx: ops.peer_reduce(name, layout.index(idx), reduce_op),
                                     list(x.get_size())))
        out = result.realize()
        graph.comm_buffers[buf.name] += (out.name,)
        graph.comm_results.add(out.name)
        return result
    layout = buf.layout if inplace else ir.contiguous_layout(x.get_device(), x.get_dtype(), x.get_size())
    kernel = graph.register_buffer(ir.CommKernel, layout=layout, collective="all_reduce",
                                   algorithm=algorithm, reduce_op=reduce_op, group_name=group_name,
                                   world_size=choices.group_size(group_name), input=buf, inplace=inplace)
    graph.comm_buffers[buf.name] += (kernel.name,)
    graph.comm_results.add(kernel.name)
    return TensorBox(kernel)


@register(c10d.all_reduce.default)
def all_reduce(x, reduce_op, group_name):
    return _all_reduce(x, reduce_op, group_name, inplace=False)


@register(c10d.all_reduce_.default)
def all_reduce_(x, reduce_op, group_name):
    return _all_reduce(x, reduce_op, group_name, inplace=True)


@register(c10d.wait_tensor.default)
def wait_tensor(x):
    """Our comm kernels are ordered on the stream: nothing to wait for."""
    if isinstance(x, TensorBox) and isinstance(x.data, ir.Buffer) and x.data.name in V.graph.comm_results:
        return x
    return None  # a c10d collective: the aten wait runs where the graph waits
