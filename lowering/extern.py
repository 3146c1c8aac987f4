"""Extern kernels: aten ops we run as they are (mm, convolution, sort, ...).

The wrapper allocates their outputs (through the op's `out=` overload where it has
one) so that later passes can place them, e.g. straight into a comm buffer.
"""
from __future__ import annotations

import sympy
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from commfuse import ir, sizevars
from commfuse.choices import ATTENTION_BIAS_ALIGN, ATTENTION_BIAS_ARG, CONVOLUTIONS, MATMULS
from commfuse.ir import TensorBox, meta_layout, ordered_layout
from commfuse.virtualized import V


aten = torch.ops.aten


def out_overload(op):
    """The `.out` overload of a functional op with one output, if it has exactly that shape and
    a kernel of its own: a generated one (convolution's) runs the op, then copies its result."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    out = getattr(op.overloadpacket, "out", None)
    if out is None or op._overloadname not in ("default", "Tensor") or torch.Tag.generated in out.tags:
        return None
    names = [a.name for a in out._schema.arguments if a.kwarg_only and a.alias_info is not None
             and a.alias_info.is_write]
    if names != ["out"]:
        return None
    base = [a.name for a in op._schema.arguments]
    rest = [a.name for a in out._schema.arguments if a.name != "out"]
    return out if base == rest else None


def realize_arg(a, traced=None):
    """Stored for aten; a value not stored yet in the dim order of `traced` (its value in the
    graph, which eager passed and the op's meta result assumes) where that is a dense order."""
    if isinstance(a, TensorBox):
        return a.realize(_dense_order(traced, len(a.get_size())))
    return a


def _dense_order(val, dims: int):
    """The dims of a dense tensor `val`, outermost first; None if it is not dense or not static."""
    if not isinstance(val, torch.Tensor) or val.dim() != dims or dims < 2 or not all(
            isinstance(x, int) for x in (*val.shape, *val.stride())):
        return None
    order = _stride_order(val)
    dense = ordered_layout(None, None, list(val.shape), order).stride
    return order if all(n == 1 or s == int(d) for n, s, d in zip(val.shape, val.stride(), dense)) else None


def _traced_leaves(args, kwargs) -> list:
    """The graph's values for the leaves of (args, kwargs), as traced; None where unknown."""
    node, leaves = V.graph.current_node, pytree.tree_leaves((args, kwargs))
    traced = [] if node is None else pytree.tree_leaves(pytree.tree_map_only(
        torch.fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)))
    return traced if len(traced) == len(leaves) else [None] * len(leaves)


def _traced_layouts_differ(leaves, traced) -> bool:
    return any(isinstance(a, (ir.Buffer, ir.ReinterpretView)) and isinstance(t, torch.Tensor)
               and not a.layout.has_strides([sizevars.from_torch(x) for x in t.stride()])
               for a, t in zip(leaves, traced))


def _mutated_args(op, args, kwargs):
    if not isinstance(op, torch._ops.OpOverload):
        return []
    tensors = [ir.stored(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, (ir.Buffer, ir.ReinterpretView))]
    if ir.is_p2p(op):  # irecv writes its tensor, isend must send it: their schemas say neither
        return [x.name for x in tensors]
    if ir.is_wait(op) and tensors:  # ... and the data is there at the wait: readers after it
        src = tensors[0].parent if isinstance(tensors[0], ir.MultiOutput) else tensors[0]
        return list(src.mutates) if isinstance(src, ir.ExternKernel) and ir.is_p2p(src.op) else []
    out = []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [ir.stored(leaf).name for leaf in pytree.tree_leaves(v) if isinstance(leaf, (ir.Buffer, ir.ReinterpretView))]
    return out


# May `op`'s result be (a view of) an input? Its schema says so; a collective's wait returns its
# input whatever its schema says (a collective's result saved for the backward, waited there).
def returns_alias(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and (ir.is_wait(op) or any(
        r.alias_info is not None for r in op._schema.returns))


# A higher-order op (cond, map, invoke_subgraph) has no schema, and its subgraph may return an input
# as is (a saved activation): its inputs' memory is never reused while its results live.
def may_alias(op) -> bool:
    return returns_alias(op) or isinstance(op, torch._ops.HigherOrderOperator)


# An aliasing op (a view aten runs) returns strides that follow its input's, and the kernels reading
# it are built for the strides the graph's meta gives: its input is stored in the meta's order (a
# channels_last value we stored contiguous was read at channels_last strides).
def _in_meta_order(x: TensorBox):
    root = ir.view_root(x).data
    root = ir.stored(root)
    if isinstance(root, (ir.InputBuffer, ir.ConstantBuffer, ir.ExternKernel, ir.MultiOutput)):
        return x  # eager's own storage (an input, aten's result): a copy would change what a view of it reads
    arg = V.graph.current_node.args[0] if V.graph.current_node is not None and V.graph.current_node.args else None
    want = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(want, torch.Tensor) or want.dim() != len(x.get_size()) or want.dim() < 2:
        return x
    return x.realize_in_order(_stride_order(want))


def _stride_order(val: torch.Tensor) -> list:  # a traced value's dims, outermost first (hints where symbolic)
    return sorted(range(val.dim()), key=lambda d: -sizevars.hint(sizevars.from_torch(val.stride(d))))


def fallback(op, args, kwargs, meta):
    """Run `op` through aten; returns what the FX node's value is made of: TensorBox(es) over its
    tensor outputs, in the structure of `meta` (the op's own meta result: tuples, lists, None,
    ints). Layouts come from `meta`; the wrapper checks them against what aten returned."""
    if V.graph.channels_last and op in CONVOLUTIONS:  # 4-D operands (input, weight, grad) as cudnn wants
        args = [a.realize_in_order(ir.CHANNELS_LAST) if isinstance(a, TensorBox) and len(a.get_size()) == 4
                else a for a in args]
    if returns_alias(op) and args and isinstance(args[0], TensorBox):
        args = [_in_meta_order(args[0])] + list(args[1:])
    bias = ATTENTION_BIAS_ARG.get(op)
    if bias is not None and bias < len(args) and isinstance(args[bias], TensorBox):
        args = list(args)
        args[bias] = args[bias].realize_rows_aligned(ATTENTION_BIAS_ALIGN)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    traced = _traced_leaves(args, kwargs)
    leaves = [realize_arg(a, t) for a, t in zip(leaves, traced)]
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    if V.graph.channels_last or _traced_layouts_differ(leaves, traced):
        meta = _meta_for_layouts(op, args, kwargs, meta)
    mutates = _mutated_args(op, args, kwargs)
    graph = V.graph
    fields = dict(op=op, args=tuple(args), kwargs=dict(kwargs), mutates=mutates,
                  aliases=may_alias(op))
    if isinstance(meta, torch.Tensor):  # no `out=` where the size comes from the data: allocated by aten
        node = V.graph.current_node
        out = None if node is not None and node.meta.get("unbacked_bindings") else out_overload(op)
        layout = meta_layout(meta)
        if out is not None and op.overloadpacket in MATMULS:  # BLAS writes rows at the out's stride
            layout = V.choices.pad_rows(layout)
        kernel = graph.register_buffer(ir.ExternKernel, layout=layout,
                                       **{**fields, "op": out or op}, out_variant=out is not None)
        return TensorBox(kernel)
    with_paths, spec = pytree.tree_flatten_with_path(meta)
    leaves = [m for _, m in with_paths]
    plain = {i: _plain_value(m) for i, m in enumerate(leaves) if not isinstance(m, torch.Tensor)}
    tensors = [m for m in leaves if isinstance(m, torch.Tensor)]
    if not tensors:  # side effects only (or plain values): placed on the device of what it touches
        dev = next((a.get_device() for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, ir.IRNode)), torch.device("cpu"))
        graph.register_buffer(ir.ExternKernel, layout=ir.Layout(dev, torch.uint8, [], []),
                              **fields, side_effect=True)
        return pytree.tree_unflatten([plain[i] for i in range(len(leaves))], spec)
    kernel = graph.register_buffer(ir.ExternKernel, layout=ir.Layout(tensors[0].device, torch.uint8, [], []),
                                   **fields, multi_output=True)
    outs = []
    for i, (path, m) in enumerate(with_paths):
        if isinstance(m, torch.Tensor):
            index = tuple(k.idx for k in path)  # meta is tuples and lists only
            outs.append(TensorBox(graph.register_buffer(ir.MultiOutput, layout=meta_layout(m),
                                                        parent=kernel, index=index)))
        else:
            outs.append(plain[i])
    return pytree.tree_unflatten(outs, spec)


def _meta_for_layouts(op, args, kwargs, meta):
    """The op's meta result for its arguments as they are laid out here, where the graph was
    traced with others (channels_last values, traced contiguous; values stored before in another
    order): outputs follow their inputs' layout (a conv's, a max-pool's, attention's). Static
    layouts only; else `meta`."""
    def fake(a):
        if isinstance(a, (ir.Buffer, ir.ReinterpretView)):
            lay = a.layout
            size, stride, offset = ([int(x) for x in xs] for xs in (lay.size, lay.stride, [lay.offset]))
            return torch.empty(int(lay.storage_numel()), dtype=lay.dtype, device=lay.device).as_strided(
                size, stride, offset[0])
        if isinstance(a, ir.OpaqueInput):
            return a.example
        return int(a) if isinstance(a, sympy.Integer) else a
    leaves = pytree.tree_leaves((args, kwargs))
    layouts = [x.layout for x in leaves if isinstance(x, (ir.Buffer, ir.ReinterpretView))]
    if not all(sizevars.is_static(e) for lay in layouts for e in (*lay.size, *lay.stride, lay.offset)) \
            or any(isinstance(x, sympy.Expr) and not x.is_Integer for x in leaves):
        return meta
    try:
        with FakeTensorMode():
            return op(*pytree.tree_map(fake, args), **pytree.tree_map(fake, kwargs))
    except Exception:
        if returns_alias(op):  # a view taken as is would be indexed by the wrong strides
            raise
        return meta  # the wrapper copies what aten returns into the traced layout


def _plain_value(m):
    """A non-tensor output (an int such as flash attention's max sequence length, a None): its
    value is known when compiling; a symbolic one is an expression over the graph's sizes."""
    if isinstance(m, torch.SymInt):
        return sizevars.from_torch(m)
    if isinstance(m, torch.SymFloat) and isinstance(m.node.expr, sympy.Symbol):  # item() of a float: bound at run time
        return m.node.expr
    if m is None or isinstance(m, (int, float, bool)):
        return m
    raise ir.Unsupported(f"output of type {type(m).__name__}")
