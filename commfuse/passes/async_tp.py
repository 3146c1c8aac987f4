"""Async-TP: an all-gather whose result feeds matmuls, and a matmul whose result feeds a
reduce-scatter, each become one op (runtime/async_tp.py) that overlaps the transfer of one rank's
chunk with the matmul of another.

Sequence parallelism makes both: a norm's output, sharded over the sequence, is all-gathered for
the column-parallel matmuls (q/k/v, gate/up), and the row-parallel matmul's partial sums (o, down)
are reduce-scattered back over the sequence. DTensor gathers and scatters along dim 0 and moves
blocks between dim 0 and the sequence dim around the collective (dim-0 blocks concatenated along
dim d, and back). A matmul acts on rows, so that reordering commutes with it: the gathered chunks
are multiplied as they arrive and the product reordered as the input was; the scatter's rows are
reordered before the matmul. Where the pattern differs, or `Choices.async_tp` says no, the graph
is left as it is.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from .. import choices, config
from ..collectives import CommRequest
from ..runtime import async_tp as _registers_the_ops  # noqa: F401
from .fx_rewrite import call, erase_unused, finish

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
_WEIGHT_VIEWS = (aten.permute.default, aten.t.default, aten.transpose.int, aten.view.default, aten.alias.default)
_FLAT_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_BLOCK_VIEWS = (aten.as_strided.default, aten.slice.Tensor, aten.narrow.default, aten.alias.default)


def _val(n):
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in (*v.shape, *v.stride())) else None


def _block_source(p: torch.fx.Node):
    """The node a view `p` selects from (through split / chunk's getitem too), else None."""
    if p.op != "call_function":
        return None
    if p.target in _BLOCK_VIEWS:
        return p.args[0]
    if p.target is operator.getitem and isinstance(p.args[0], torch.fx.Node) and p.args[0].target in (
            aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return p.args[0].args[0]
    return None


def _blocks_of(cat: torch.fx.Node, world: int):
    """(src, d) where `cat`'s inputs are src's `world` blocks along dim d, in order; else None."""
    parts = cat.args[0] if cat.target is aten.cat.default else ()
    srcs = {_block_source(p) if isinstance(p, torch.fx.Node) else None for p in parts}
    if len(parts) != world or len(srcs) != 1 or None in srcs:
        return None
    (src,), vals = srcs, [_val(p) for p in parts]
    s = _val(src)
    if s is None or None in vals:
        return None
    for d in range(s.dim()):
        blk = s.shape[d] // world
        shape = [*s.shape[:d], blk, *s.shape[d + 1:]]
        if s.shape[d] % world == 0 and all(
                list(v.shape) == shape and v.stride() == s.stride() and
                v.storage_offset() == s.storage_offset() + r * blk * s.stride(d) for r, v in enumerate(vals)):
            return src, d
    return None


def _cat_dim(cat: torch.fx.Node, dims: int) -> int:
    d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return d % dims


def _weight_chain(w) -> list | None:
    """The view nodes (base first) that make weight `w` from a graph input, else None: what may be
    moved up to where the collective was."""
    chain = []
    while isinstance(w, torch.fx.Node) and w.op == "call_function" and w.target in _WEIGHT_VIEWS:
        chain.append(w)
        w = w.args[0]
    return chain[::-1] if isinstance(w, torch.fx.Node) and w.op in ("placeholder", "get_attr") else None


def _reordered(graph, y, shape: list, world: int, d: int, cat_dim: int, rows: int):
    """`y` (2-D) viewed as `shape`, its `world` blocks along dim d concatenated along cat_dim, as rows."""
    y = call(graph, aten.view.default, y, shape)
    blk = shape[d] // world
    y = call(graph, aten.cat.default, [call(graph, aten.slice.Tensor, y, d, r * blk, (r + 1) * blk)
                                       for r in range(world)], cat_dim)
    return call(graph, aten.view.default, y, [rows, shape[-1]])


def _gather_mm(graph: torch.fx.Graph, ag: torch.fx.Node) -> bool:
    x, world, group = ag.args[:3]
    (wait,) = ag.users if len(ag.users) == 1 else (None,)
    g = _val(wait) if wait is not None and wait.target is c10d.wait_tensor.default else None
    if g is None or g.dim() < 2 or world < 2:
        return False
    src, cat_dim = wait, None
    cats = {u for p in wait.users for u in p.users}
    if len(cats) == 1 and len(wait.users) == world and _blocks_of(next(iter(cats)), world) == (wait, 0):
        src = next(iter(cats))
        cat_dim = _cat_dim(src, g.dim())
        if cat_dim == g.dim() - 1:
            return False
    k = g.shape[-1]
    rows = g.numel() // k
    flat = [v for v in src.users if v.target in _FLAT_VIEWS and _val(v) is not None and list(_val(v).shape) == [rows, k]]
    if g.dim() == 2 and cat_dim is None:
        flat.append(src)
    mms = [u for v in flat for u in v.users if u.target is aten.mm.default and u.args[0] is v
           and _weight_chain(u.args[1]) is not None]
    if not mms:
        return False
    if choices.current().async_tp(CommRequest("all_gather_into_tensor", "", str(group), g.dtype, g.device,
                                              tuple(_val(x).shape))):
        return False
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for u in mms:  # the weights' views that come later move up to where the collective waited
        for n in _weight_chain(u.args[1]):
            if pos[n] > pos[wait]:
                wait.prepend(n)
    with graph.inserting_before(wait):
        fused = call(graph, torch.ops.commfuse_comm.all_gather_mm.default, x, [u.args[1] for u in mms], str(group), world,
                     config.comm.barrier_timeout_s)
        outs = [call(graph, operator.getitem, fused, i) for i in range(len(mms) + 1)]
    wait.replace_all_uses_with(outs[0])
    for u, y in zip(mms, outs[1:]):
        if cat_dim is not None:
            with graph.inserting_before(u):
                y = _reordered(graph, y, [*g.shape[:-1], _val(u).shape[1]], world, 0, cat_dim, rows)
        u.replace_all_uses_with(y)
        graph.erase_node(u)
    graph.erase_node(wait)
    graph.erase_node(ag)
    erase_unused(graph, [v for v in flat if v is not wait] + ([src, *src.args[0]] if cat_dim is not None else []))
    return True


def _mm_terms(y: torch.fx.Node) -> list | None:
    """The matmuls whose products `y` adds up (through views that only flatten), each read by it alone."""
    if y.target is aten.add.Tensor and len(y.args) == 2 and not y.kwargs and all(isinstance(t, torch.fx.Node) for t in y.args):
        terms = [_mm_terms(t) if len(t.users) == 1 else None for t in y.args]
        return None if None in terms else terms[0] + terms[1]
    mm = y.args[0] if y.target in _FLAT_VIEWS and len(y.users) == 1 else y
    return [mm] if mm.target is aten.mm.default and len(mm.users) == 1 else None


def _mm_scatter(graph: torch.fx.Graph, rs: torch.fx.Node) -> bool:
    x, reduce_op, world, group = rs.args[:4]
    (wait,) = rs.users if len(rs.users) == 1 else (None,)
    out = _val(wait) if wait is not None and wait.target is c10d.wait_tensor.default else None
    if out is None or reduce_op not in ("sum", "avg") or world < 2 or _val(x) is None:
        return False
    found = _blocks_of(x, world) if x.target is aten.cat.default and _cat_dim(x, _val(x).dim()) == 0 else None
    y, d = found if found else (x, None)
    ys = _val(y)
    if len(y.users) != (world if found else 1) or ys is None:
        return False
    mms = _mm_terms(y.args[0] if y.target in _FLAT_VIEWS else y)
    if not mms or any(_val(mm) is None or list(_val(mm).shape) != [ys.numel() // ys.shape[-1], ys.shape[-1]] for mm in mms):
        return False
    rows, n = _val(mms[0]).shape
    if (d is not None and d == ys.dim() - 1) or (d is None and (ys.numel() // world) % n):
        return False
    if choices.current().async_tp(CommRequest("reduce_scatter_tensor", reduce_op, str(group), ys.dtype, ys.device,
                                              tuple(_val(x).shape))):
        return False
    with graph.inserting_before(rs):
        a = [mm.args[0] for mm in mms]
        if d is not None:  # the rows as the scatter deals them: the product's reordering, on the inputs
            a = [_reordered(graph, t, [*ys.shape[:-1], _val(t).shape[1]], world, d, 0, rows) for t in a]
        fused = call(graph, torch.ops.commfuse_comm.mm_reduce_scatter.default, a, [mm.args[1] for mm in mms],
                     reduce_op, str(group), world, config.comm.barrier_timeout_s)
        result = call(graph, aten.view.default, fused, list(out.shape))
    wait.replace_all_uses_with(result)
    graph.erase_node(wait)
    graph.erase_node(rs)
    chain = [n for n in reversed(graph.nodes) if n in _chain_nodes(y, mms)]  # users first
    erase_unused(graph, [x] + (list(x.args[0]) if found else []) + chain)
    return True


def _chain_nodes(y: torch.fx.Node, mms: list) -> set:
    """`y` and every node between it and the matmuls `mms` (the sum and its views), and the matmuls."""
    out, todo = set(mms), [y]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += [a for a in n.args if isinstance(a, torch.fx.Node)]
    return out


def async_tp(gm: torch.fx.GraphModule) -> int:
    """Rewrite every all-gather → matmuls and matmul → reduce-scatter that policy chunks; returns how many."""
    changed = 0
    for node in list(gm.graph.nodes):
        rewrite = {c10d.all_gather_into_tensor.default: _gather_mm, c10d.reduce_scatter_tensor.default: _mm_scatter}.get(node.target)
        changed += bool(rewrite and rewrite(gm.graph, node))
    return finish(gm, changed)
