"""Sums of one-hot tensors, taken without a pass over them. A cross-entropy's backward builds
`g = scatter(zeros, d, target, c) * w` (nll_loss_backward) and sums its rows (log_softmax's
backward): a reduction over the vocabulary that compares every column with the target. Where w is
constant along d the sum is `c * w + 0 * w`, exactly (the other columns' zeros: NaN where w is
infinite); `g` stays for the pointwise kernel that reads it."""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import guard_or_true

from .fx_rewrite import erase_unused, finish

aten = torch.ops.aten

_ZEROS = {aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default}
_FULL = {aten.full_like.default: 1, aten.full.default: 1, aten.new_full.default: 2}  # op -> index of its value


def sum_one_hot(gm: torch.fx.GraphModule) -> int:
    """`sum(scatter(zeros, d, idx, c) * w, [d])` -> `c * w + 0 * w` (one index per row, w constant along d)."""
    changed = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)):
        match = _match(node)
        if match is None:
            continue
        w, c, d, keepdim, dead = match
        shape = list(node.args[0].meta["val"].shape)
        shape[d] = 1
        with gm.graph.inserting_before(node):
            product = node.args[0].meta["val"].dtype  # eager's one-hot * w: computed in this dtype
            if w.meta["val"].dtype != product:
                w = _add(gm.graph, aten._to_copy.default, w, dtype=product)
            value = _add(gm.graph, aten.mul.Tensor, w, c)
            if guard_or_true(node.args[0].meta["val"].shape[d] != 1):  # (a dim of 1 has no other column)
                # the other columns' 0 * w: nothing where w is finite, NaN where it is not, as eager's sum
                value = _add(gm.graph, aten.add.Tensor, value, _add(gm.graph, aten.mul.Tensor, w, 0))
            if value.meta["val"].dtype != node.meta["val"].dtype:
                value = _add(gm.graph, aten._to_copy.default, value, dtype=node.meta["val"].dtype)
            value = _add(gm.graph, aten.expand.default, value, shape)
            if not keepdim:
                value = _add(gm.graph, aten.squeeze.dim, value, d)
        node.replace_all_uses_with(value)
        erase_unused(gm.graph, (node, *dead))  # the product, the one-hot and its zeros, if only the sum read them
        changed += 1
    return finish(gm, changed)


def _match(node):
    """(w, c, d, keepdim, [mul, scatter, zeros]) where `node` sums a one-hot tensor times w."""
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
            return w, c, d, keepdim, [x, s, s.args[0]]
    return None


def _one_hot(s, d: int, shape) -> float | int | None:
    """c, where s is `scatter(zeros of shape, d, idx, c)` with exactly one index per row."""
    if not isinstance(s, torch.fx.Node) or s.target != aten.scatter.value or s.kwargs:
        return None
    base, dim, idx, c = s.args[:4]
    sval, ival = s.meta.get("val"), getattr(idx, "meta", {}).get("val")
    if not isinstance(sval, torch.Tensor) or not isinstance(ival, torch.Tensor) or tuple(sval.shape) != tuple(shape):
        return None
    one_per_row = ival.dim() == sval.dim() and all(ival.shape[k] == (1 if k == d else shape[k]) for k in range(len(shape)))
    if dim % sval.dim() != d or not one_per_row or not _is_zeros(base) or type(c) not in (int, float):
        return None
    as_stored = torch.tensor(c, dtype=torch.float64 if isinstance(c, float) else torch.int64).to(sval.dtype)
    return as_stored.item()  # as scatter stores it (1.7 into int64 zeros: 1)


def _is_zeros(n) -> bool:
    i = _FULL.get(getattr(n, "target", None))
    return isinstance(n, torch.fx.Node) and (n.target in _ZEROS or i is not None and len(n.args) > i
                                             and n.args[i] == 0 and not isinstance(n.args[i], bool))


def _constant_along(w: torch.fx.Node, d: int, ndim: int) -> bool:
    val = w.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() > ndim:
        return False
    k = d - (ndim - val.dim())  # broadcasting aligns the trailing dims
    return k < 0 or val.shape[k] == 1


def _add(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A new node, its value computed on the fake values of its arguments."""
    node = graph.call_function(target, args, kwargs)
    vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(vals)):
        node.meta["val"] = target(*vals[0], **vals[1])
    return node
