"""Sums of one-hot tensors, taken without a pass over them.

A cross-entropy's backward (aten's nll_loss_backward, then _log_softmax_backward_data) builds
`g = scatter(zeros, d, target, c) * w`, one nonzero per row, and sums it along the row:
`sum(g, d)`. Over a vocabulary that is a reduction over rows x vocabulary elements which loads
nothing but compares every column with the target. Its value is `c * w` where w is constant along
d: exact, since the other terms are zeros. `g` itself stays, for the pointwise kernel that reads it.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

_ZEROS = {aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default}
_FULL = {aten.full_like.default: 1, aten.full.default: 1, aten.new_full.default: 2}  # op -> index of its value


def sum_one_hot(gm: torch.fx.GraphModule) -> int:
    """Rewrite `sum(scatter(zeros, d, idx, c) * w, [d])`, with one index per row and w constant
    along d, into `c * w`; returns how many sums changed."""
    changed = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)):
        match = _match(node)
        if match is None:
            continue
        w, c, d, keepdim = match
        out = node.meta["val"]
        shape = list(node.args[0].meta["val"].shape)
        shape[d] = 1
        graph = gm.graph
        with graph.inserting_before(node):
            value = graph.call_function(aten.mul.Tensor, (w, c))
            if _val(value).dtype != out.dtype:
                value = graph.call_function(aten._to_copy.default, (value,), {"dtype": out.dtype})
                _val(value)
            value = graph.call_function(aten.expand.default, (value, shape))
            _val(value)
            if not keepdim:
                value = graph.call_function(aten.squeeze.dim, (value, d))
                _val(value)
        node.replace_all_uses_with(value)
        _erase_unused(graph, node)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _match(node):
    """(w, c, d, keepdim) where `node` sums a one-hot tensor times w, else None."""
    x, dims = node.args[0], node.args[1]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None or not isinstance(x, torch.fx.Node) or x.target != aten.mul.Tensor:
        return None
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or not dims or len(dims) != 1:
        return None
    d = dims[0] % val.dim()
    for s, w in (x.args, x.args[::-1]):
        c = _one_hot(s, d, val.shape)
        if c is not None and isinstance(w, torch.fx.Node) and _constant_along(w, d, val.dim()):
            return w, c, d, keepdim
    return None


def _one_hot(s, d: int, shape) -> float | int | None:
    """c, where s is `scatter(zeros of shape, d, idx, c)` with exactly one index per row."""
    if not isinstance(s, torch.fx.Node) or s.target != aten.scatter.value:
        return None
    base, dim, idx, c = s.args[:4]
    sval, ival = s.meta.get("val"), getattr(idx, "meta", {}).get("val")
    if not isinstance(sval, torch.Tensor) or not isinstance(ival, torch.Tensor) or s.kwargs:
        return None
    if tuple(sval.shape) != tuple(shape) or dim % sval.dim() != d or ival.dim() != sval.dim():
        return None
    if any(ival.shape[k] != (1 if k == d else shape[k]) for k in range(len(shape))):
        return None  # an index per row, for every row
    if not _is_zeros(base) or not isinstance(c, (int, float)) or isinstance(c, bool):
        return None
    return c


def _is_zeros(n) -> bool:
    if not isinstance(n, torch.fx.Node):
        return False
    if n.target in _ZEROS:
        return True
    i = _FULL.get(n.target)
    return i is not None and len(n.args) > i and n.args[i] == 0 and not isinstance(n.args[i], bool)


def _constant_along(w: torch.fx.Node, d: int, ndim: int) -> bool:
    val = w.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() > ndim:
        return False
    k = d - (ndim - val.dim())  # broadcasting aligns the trailing dims
    return k < 0 or val.shape[k] == 1


def _val(node: torch.fx.Node):
    """The node's value, computed on the fake values of its arguments."""
    from torch._subclasses.fake_tensor import FakeTensor
    args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    fake = next(v for v in torch.utils._pytree.tree_leaves(args) if isinstance(v, FakeTensor))
    with fake.fake_mode:
        node.meta["val"] = node.target(*args[0], **args[1])
    return node.meta["val"]


def _erase_unused(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """`node` and the producers only it used (mul, scatter, zeros: all functional)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack += [i for i in inputs if i.target in (aten.mul.Tensor, aten.scatter.value) or _is_zeros(i)]
