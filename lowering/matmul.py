"""Matrix products with few rows (decode) by our own Triton kernel (codegen/matmul.py).

The weight streams once from memory; the left operand is small, so a pointwise producer of it (an
activation) is recomputed where the kernel loads it rather than stored (the prologue). Its
output is an out variant like aten's mm, so it can land straight in a comm buffer. Anything
`choices.use_mm_template` turns down runs aten's mm.
"""
from __future__ import annotations

import sympy
import torch

from commfuse import ir
from commfuse.dependencies import trace_body
from commfuse.ir import TensorBox
from commfuse.virtualized import V

from . import register
from .extern import realize_arg
from .views import constant_pad_nd, slice_

aten = torch.ops.aten


@register(aten.addmm.default)
def addmm(bias, a, b, beta=1, alpha=1):
    if beta != 1 or alpha != 1 or not isinstance(bias, TensorBox) or len(bias.get_size()) != 1:
        return None
    return aligned_mm(a, b, bias)


def aligned_mm(a, b, bias=None):
    """A large matmul whose K or N is not a multiple of 16 bytes, on zero-padded operands (the
    product over the padded K is the same), its output rows padded and sliced back to N: cuBLAS
    takes unaligned kernels otherwise (GPT-2's 50257-word head on H100: 3.3 ms, 0.45 aligned).
    The copies of the operands are cheap beside that. None where choices keeps it as it is."""
    if not (isinstance(a, TensorBox) and isinstance(b, TensorBox)):
        return None
    (m, k), n = a.get_size(), b.get_size()[1]
    multiple = V.choices.mm_pad_multiple(a.get_device(), a.get_dtype(), m, k, n)
    if multiple is None:
        return None
    kp, np_ = (-(-int(x) // multiple) * multiple for x in (k, n))
    args = (_zero_padded(a, [0, kp - int(k)]), _zero_padded(b, [0, np_ - int(n), 0, kp - int(k)]))
    if bias is not None:
        args = (_zero_padded(bias, [0, np_ - int(n)]),) + args
    layout = ir.contiguous_layout(a.get_device(), a.get_dtype(), [m, sympy.Integer(np_)], ir.FixedLayout)
    out = TensorBox(V.graph.register_buffer(ir.ExternKernel, layout=layout, op=aten.addmm.out if bias is not None
                                            else aten.mm.out, args=args, kwargs={}, mutates=[], aliases=False,
                                            out_variant=True))
    return slice_(out, 1, 0, n)


def _zero_padded(x, pad):
    """x stored zero-padded; an operand already aligned as it is. A transposed operand (a weight
    `w.t()`, rows of w padded) is stored transposed too, a copy that streams: cuBLAS takes it
    transposed as well, and a transposing copy of GPT-2's head took 317 µs against 52."""
    if not any(pad):
        return realize_arg(x)
    view = ir.as_strided_view(x) if len(x.get_size()) == 2 else None
    transposed = view is not None and view.layout.stride_order() == [1, 0]
    return constant_pad_nd(x, pad).realize([1, 0] if transposed else None)


@register(aten.mm.default)
def mm(a, b):
    if not (isinstance(a, TensorBox) and isinstance(b, TensorBox)):
        return None
    if not V.choices.use_mm_template(a, b):
        return aligned_mm(a, b)
    prologue = isinstance(a.data, ir.Pointwise)
    if not prologue:
        a.realize()
    loader = a.make_loader()
    m, k = a.get_size()
    # what the loader reads: traced as a pointwise body over a's [M, K]
    reads = trace_body(ir.Pointwise(a.get_device(), a.get_dtype(), loader, [m, k])).reads
    graph = V.graph
    a_reads = [graph.get_buffer(name) for name in dict.fromkeys(r.name for r in reads)]
    b_in = b.realize()
    layout = ir.contiguous_layout(a.get_device(), a.get_dtype(), [m, b.get_size()[1]], ir.FixedLayout)
    return TensorBox(graph.register_buffer(
        ir.MatmulTemplate, layout=layout, op=aten.mm.out, args=(None, b_in), out_variant=True,
        a_loader=loader, a_reads=a_reads, a_size=[m, k], prologue=prologue))
