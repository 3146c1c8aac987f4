"""A sum of all-reduced values, all-reduced once: `all_reduce(a) + all_reduce(b)` is
`all_reduce(a + b)` for a sum or a mean over the same group.

Tensor parallelism makes such sums in every backward: an activation read by several
column-parallel linears (q, k and v; gate and up) gets one partial gradient from each, DTensor
all-reduces each, and autograd adds them. Adding first moves a third (or half) of the bytes over
the links, for one local add. The result differs from eager's in rounding only: the same values
are summed in another order.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx

from .. import choices, config
from .fx_rewrite import finish

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
LINEAR_REDUCE_OPS = ("sum", "avg")  # all_reduce(a) + all_reduce(b) == all_reduce(a + b)


def _reduced(node, alone: bool = True):
    """(x, op, group) where `node` is wait_tensor(all_reduce(x, op, group)) and (`alone`) nothing
    else reads either, else None."""
    if not (isinstance(node, torch.fx.Node) and node.target is c10d.wait_tensor.default and (len(node.users) == 1 or not alone)):
        return None
    ar = node.args[0]
    if not (isinstance(ar, torch.fx.Node) and ar.target is c10d.all_reduce.default and len(ar.users) == 1):
        return None
    x, op, group = ar.args
    return (x, op, group) if op in LINEAR_REDUCE_OPS and choices.current().rewrites_collectives(str(group)) else None


def _same_value_type(*nodes) -> bool:  # no broadcast, no type promotion
    vals = [n.meta.get("val") for n in nodes]  # symbolic sizes compare by their expressions (no guard)
    return all(isinstance(v, torch.Tensor) for v in vals) and \
        len({(tuple(map(str, v.shape)), v.dtype, v.device) for v in vals}) == 1


def all_reduce_sums(gm: torch.fx.GraphModule) -> int:
    """Rewrite each add of two all-reduced values (each read by the add alone) into the all-reduce
    of their add; chains (a + b + c) fold one add at a time. Returns how many adds changed."""
    if not config.comm.sum_before_all_reduce:
        return 0
    graph, changed = gm.graph, 0
    for add in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        left, right = add.args[:2] if len(add.args) == 2 and not add.kwargs else (None, None)
        a, b = _reduced(left), _reduced(right)
        if a is None or b is None or left is right or a[1:] != b[1:] or not _same_value_type(add, a[0], b[0]):
            continue
        with graph.inserting_before(add):
            total = graph.call_function(aten.add.Tensor, (a[0], b[0]))
            reduce = graph.call_function(c10d.all_reduce.default, (total, *a[1:]))
            wait = graph.call_function(c10d.wait_tensor.default, (reduce,))
        va, vb = a[0].meta["val"], b[0].meta["val"]
        with getattr(va, "fake_mode", None) or contextlib.nullcontext():
            total.meta["val"] = aten.add.Tensor(va, vb)
        reduce.meta["val"] = wait.meta["val"] = add.meta["val"]  # contiguous, as the add of two all-reduced values
        add.replace_all_uses_with(wait)
        for n in (add, left, left.args[0], right, right.args[0]):
            graph.erase_node(n)
        changed += 1
    return finish(gm, changed)


def summable_groups(gm: torch.fx.GraphModule) -> set:
    """The groups of all-reduced values that an add sums, whoever else reads them: where the
    rewrite may apply on some ranks and not on others (a term only one rank logs)."""
    out = set()
    if not config.comm.sum_before_all_reduce:
        return out
    for add in gm.graph.find_nodes(op="call_function", target=aten.add.Tensor):
        a, b = (_reduced(x, alone=False) for x in add.args[:2]) if len(add.args) == 2 else (None, None)
        if a is not None and b is not None and a[1:] == b[1:]:
            out.add(str(a[2]))
    return out
