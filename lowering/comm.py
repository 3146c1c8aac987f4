"""Collectives (`_c10d_functional` ops).

Each all-reduce gets its `CommPlan` here (commfuse/collectives.py), from `V.choices`. A fused
symmetric-memory algorithm (one-shot, two-shot) becomes a loop body that reads the peers' copies
(`ops.peer_reduce`), so its consumers fuse into it; in-place all-reduces and the other algorithms
become a `CommKernel` the wrapper renders from the plan. The input is made a comm buffer here, at
lowering time, so the kernel that produces it (a fused Triton kernel, or an extern mm through
`out=`) writes straight into the persistent pool: no copy in, also through views that only reshape
it (a row-parallel linear's 2-D mm output viewed back to (batch, seq, hidden)). Values we do not
produce (graph inputs, other views) get one copy kernel, fused with the pointwise op before it.
All-gathers and reduce-scatters (dim 0) are placed the same way and become loop bodies too: an
all-gather's element reads the one peer that holds it (`ops.peer_load`), a reduce-scatter's
combines every peer's element of this rank's shard (`ops.peer_reduce` with `shard`). A c10d plan and
every other collective run the c10d op asynchronously, waited on where the graph waits.
"""
from __future__ import annotations

import logging

import sympy
import torch

from commfuse import ir, overlap, sizevars
from commfuse.choices import group_size_or_0
from commfuse.collectives import CommPlan, CommRequest, algorithm
from commfuse.ir import Pointwise, TensorBox
from commfuse.sizevars import FloorDiv, Mod
from commfuse.runtime import async_tp
from commfuse.virtualized import V, ops

from . import register
from .extern import fallback, returns_alias

log = logging.getLogger("commfuse")
c10d = torch.ops._c10d_functional


def _placeable(d) -> bool:
    """A producer of ours whose output we may place: a fused kernel's buffer whose strides are
    still ours to choose, or a contiguous out= extern (mm)."""
    return (isinstance(d, ir.ComputedBuffer) and isinstance(d.layout, ir.FlexibleLayout) or
            isinstance(d, ir.ExternKernel) and d.out_variant and d.layout.is_contiguous()) \
        and not isinstance(d.layout, ir.CommLayout)


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


def place_input(x: TensorBox, plan: CommPlan, through_views: bool = False) -> ir.Buffer:
    """Store `x` in a comm buffer of the plan's group (or, for an algorithm that needs no symmetric
    memory, an ordinary buffer), written by its producer where we own it. With `through_views`, the
    buffer may be the producer under reshaping views of `x` (its size is then the producer's, its
    contiguous storage element for element `x`'s)."""
    producer = _reshaped(x) if through_views else None
    d = x.data if producer is None else producer
    size = list(d.get_size() if producer is not None else x.get_size())
    strides = sizevars.contiguous_strides(size)
    layout = ir.CommLayout(x.get_device(), x.get_dtype(), size, strides, group=plan.group, kind=plan.collective) \
        if plan.algorithm.symmetric else ir.FixedLayout(x.get_device(), x.get_dtype(), size, strides)
    if _placeable(d):
        d.layout = layout  # the producer writes into the pool
        buf = d
    else:
        loader = x.make_loader() if not isinstance(d, ir.Loops) else d.inner_fn
        src = d if isinstance(d, ir.Pointwise) else Pointwise(x.get_device(), x.get_dtype(), loader, size)
        buf = V.graph.register_buffer(ir.ComputedBuffer, layout=layout, data=src)
        plan.copy_in = not isinstance(d, ir.Loops)  # the value was not ours to place
        if not plan.copy_in:  # the value's other users read it stored; a copied buffer stays itself
            x.data = buf      # (a graph input that the graph then writes back must stay the input)
    plan.buffer = buf.name
    return buf


def _say_c10d(plan: CommPlan) -> None:
    # a dynamic-shape recompile silently losing the fast path is worth one warning
    (log.warning if plan.reason.startswith("symbolic size") else log.info)(
        "commfuse: %s on %s runs through c10d: %s", plan.collective, plan.group, plan.reason)


def _read_only_here(node) -> bool:
    """`node` (an all-reduce's FX input) is memory of the graph's own, made by an op that does not
    alias, read by this all-reduce alone (through views that only it reads)."""
    while isinstance(node, torch.fx.Node) and isinstance(node.target, torch._ops.OpOverload) and len(node.users) == 1:
        if not returns_alias(node.target):
            return True
        node = node.args[0] if node.args else None  # a view: its base must be ours alone too
    return False


def _independent_flops() -> int:
    node = V.graph.current_node
    return overlap.independent_flops(node) if node is not None else 0


def _all_reduce(x, reduce_op, group_name, inplace):
    graph = V.graph
    request = CommRequest("all_reduce", reduce_op, group_name, x.get_dtype(), x.get_device(),
                          tuple(x.get_size()), inplace, _independent_flops())
    plan = V.choices.all_reduce_plan(request)
    graph.comm_plans.append(plan)
    if plan.algorithm.name == "c10d":
        _say_c10d(plan)
        arg = graph.current_node.args[0] if graph.current_node is not None else None
        if inplace or not _read_only_here(arg):
            return None  # c10d's functional all_reduce: a copy of x, reduced
        # nothing else reads x: reduce it in place, as all_reduce_ (no copy of the whole tensor)
        return fallback(c10d.all_reduce_.default, (x, reduce_op, group_name), {}, arg.meta["val"])
    # in place, the result is the buffer itself: it must have x's size
    buf = place_input(x, plan, through_views=not inplace)
    if plan.algorithm.fused and not inplace:
        # a loop body reading the peers' copies: it fuses with its consumers like any pointwise node
        # indexed as x: the buffer is contiguous, possibly under another shape (a reshaped producer)
        name, layout = buf.name, ir.contiguous_layout(x.get_device(), x.get_dtype(), x.get_size())
        result = TensorBox(Pointwise(x.get_device(), x.get_dtype(),
                                     lambda idx: ops.peer_reduce(name, layout.index(idx), reduce_op),
                                     list(x.get_size())))
        plan.result = result.realize().name
        return result
    layout = buf.layout if inplace else ir.contiguous_layout(x.get_device(), x.get_dtype(), x.get_size())
    kernel = graph.register_buffer(ir.CommKernel, layout=layout, plan=plan, input=buf)
    plan.result = kernel.name
    return TensorBox(kernel)


@register(c10d.all_reduce.default)
def all_reduce(x, reduce_op, group_name):
    return _all_reduce(x, reduce_op, group_name, inplace=False)


@register(c10d.all_reduce_.default)
def all_reduce_(x, reduce_op, group_name):
    return _all_reduce(x, reduce_op, group_name, inplace=True)


def _gather_scatter(collective, x, reduce_op, group_name):
    """All-gather or reduce-scatter along dim 0, as `V.choices.gather_scatter_plan` says: the input
    placed in the group's pool (written there by its producer), the result a loop body that reads
    the peers' copies, so that its consumers fuse into the comm kernel."""
    graph = V.graph
    size = list(x.get_size())
    plan = V.choices.gather_scatter_plan(CommRequest(collective, reduce_op, group_name, x.get_dtype(), x.get_device(),
                                                     tuple(size), independent_flops=_independent_flops()))
    graph.comm_plans.append(plan)
    if plan.algorithm.name == "c10d":
        _say_c10d(plan)
        raise ir.Declined(f"{collective} runs through c10d: {plan.reason}")
    buf = place_input(x, plan, through_views=True)
    name, world, rows = buf.name, plan.world, int(size[0])
    layout = ir.contiguous_layout(x.get_device(), x.get_dtype(), size)  # the buffer, element for element x
    if collective == "all_gather_into_tensor":  # row i of the result: peer i // rows's row i % rows
        out = [sympy.Integer(rows * world)] + size[1:]
        fn = lambda idx: ops.peer_load(name, layout.index([Mod(idx[0], rows)] + list(idx[1:])),  # noqa: E731
                                       FloorDiv(idx[0], rows))
    else:  # row i of the result: row rank * rows / world + i, combined over the peers
        out = [sympy.Integer(rows // world)] + size[1:]
        shard = sizevars.product(out)
        fn = lambda idx: ops.peer_reduce(name, layout.index(idx), reduce_op, shard)  # noqa: E731
    result = TensorBox(Pointwise(x.get_device(), x.get_dtype(), fn, out))
    plan.result = result.realize().name
    return result


@register(c10d.all_gather_into_tensor.default)
def all_gather_into_tensor(x, group_size, group_name):
    return _gather_scatter("all_gather_into_tensor", x, "", group_name)


@register(c10d.reduce_scatter_tensor.default)
def reduce_scatter_tensor(x, reduce_op, group_size, group_name):
    return _gather_scatter("reduce_scatter_tensor", x, reduce_op, group_name)


@register(c10d.wait_tensor.default)
def wait_tensor(x):
    """Our comm kernels are ordered on the stream: nothing to wait for."""
    if isinstance(x, TensorBox) and isinstance(x.data, ir.Buffer) and x.data.name in V.graph.comm_results():
        return x
    raise ir.Declined("the wait of a collective run through c10d, where the graph waits")


def _through_c10d(name: str):
    """A collective commfuse has no kernel for runs as the c10d op, asynchronously; its plan
    (algorithm c10d) says so in summary.json's comm_plans and comm_fallbacks."""
    def lower(*args, **kwargs):
        group = kwargs.get("group_name", args[-1])
        group = str(getattr(group, "group_name", group))
        reduce_op = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        why = f"commfuse has no kernel for {name}: it runs through c10d"
        V.graph.comm_plans.append(CommPlan(name, group, group_size_or_0(group), reduce_op, algorithm("c10d"), why))
        raise ir.Declined(why)
    return lower


def _async_tp(collective: str, reduce_op_arg: int | None):
    """The chunked ops of runtime/async_tp.py run as they are; their plan says so."""
    def lower(*args):
        group, world = args[-3], args[-2]
        reduce_op = args[reduce_op_arg] if reduce_op_arg is not None else ""
        V.graph.comm_plans.append(CommPlan(collective, group, world, reduce_op, algorithm("async_tp"),
                                           "chunked with its matmuls (Choices.async_tp)"))
        raise ir.Declined("async-TP's op runs as it is")
    return lower


register(async_tp.all_gather_mm._opoverload)(_async_tp("all_gather_into_tensor", None))
register(async_tp.mm_reduce_scatter._opoverload)(_async_tp("reduce_scatter_tensor", 2))


for _name in ("all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
              "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
              "all_reduce_coalesced", "all_reduce_coalesced_", "all_to_all_single", "broadcast", "broadcast_"):
    if hasattr(c10d, _name):
        register(getattr(c10d, _name).default)(_through_c10d(_name))
