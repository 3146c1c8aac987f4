"""Extern kernels: aten ops we run as they are (mm, convolution, sort, ...).

The wrapper allocates their outputs (through the op's `out=` overload where it has
one) so that later passes can place them, e.g. straight into a comm buffer.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from commfuse import ir
from commfuse.graph import meta_layout
from commfuse.ir import TensorBox
from commfuse.virtualized import V


aten = torch.ops.aten


def out_overload(op):
    """The `.out` overload of a functional op with one output, if it has exactly that shape."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    out = getattr(op.overloadpacket, "out", None)
    if out is None or op._overloadname not in ("default", "Tensor"):
        return None
    names = [a.name for a in out._schema.arguments if a.kwarg_only and a.alias_info is not None
             and a.alias_info.is_write]
    if names != ["out"]:
        return None
    base = [a.name for a in op._schema.arguments]
    rest = [a.name for a in out._schema.arguments if a.name != "out"]
    return out if base == rest else None


def _realize_arg(a):
    if isinstance(a, TensorBox):
        return a.realize()
    return a


def _mutated_args(op, args, kwargs):
    if not isinstance(op, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for leaf in pytree.tree_leaves(v):
                if isinstance(leaf, (ir.Buffer, ir.ReinterpretView)):
                    out.append(leaf.base.name if isinstance(leaf, ir.ReinterpretView) else leaf.name)
    return out


def _returns_alias(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and any(
        r.alias_info is not None for r in op._schema.returns)


def fallback(op, args, kwargs, meta):
    """Run `op` through aten; returns TensorBox(es) over its outputs."""
    args, kwargs = pytree.tree_map(_realize_arg, (args, kwargs))
    mutates = _mutated_args(op, args, kwargs)
    graph = V.graph
    if isinstance(meta, torch.Tensor):
        out = out_overload(op)
        kernel = graph.register_buffer(ir.ExternKernel, layout=meta_layout(meta), op=out or op,
                                       args=tuple(args), kwargs=dict(kwargs), out_variant=out is not None,
                                       mutates=mutates, aliases=_returns_alias(op))
        return TensorBox(kernel)
    if isinstance(meta, (list, tuple)) and all(isinstance(m, torch.Tensor) or m is None for m in meta):
        dev = next((m.device for m in meta if m is not None), torch.device("cpu"))
        kernel = graph.register_buffer(ir.ExternKernel, layout=ir.Layout(dev, torch.uint8, [], []),
                                       op=op, args=tuple(args), kwargs=dict(kwargs), multi_output=True,
                                       mutates=mutates, aliases=_returns_alias(op))
        outs = []
        for i, m in enumerate(meta):
            if m is None:
                outs.append(None)
                continue
            outs.append(TensorBox(graph.register_buffer(ir.MultiOutput, layout=meta_layout(m),
                                                        parent=kernel, index=i)))
        return type(meta)(outs) if isinstance(meta, tuple) else outs
    if meta is None:  # side effects only: placed on the device of what it touches
        dev = next((a.get_device() for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, ir.IRNode)), torch.device("cpu"))
        graph.register_buffer(ir.ExternKernel, layout=ir.Layout(dev, torch.uint8, [], []),
                              op=op, args=tuple(args), kwargs=dict(kwargs), mutates=mutates,
                              side_effect=True)
        return None
    raise NotImplementedError(f"cannot fall back on {op}: output {type(meta).__name__}")
