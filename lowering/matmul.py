"""Matrix products with few rows (decode) by our own Triton kernel (codegen/matmul.py).

The weight streams once from memory; the left operand is small, so a pointwise producer of it (an
activation) is recomputed where the kernel loads it rather than stored (the prologue). Its
output is an out variant like aten's mm, so it can land straight in a comm buffer. Anything
`choices.use_mm_template` turns down runs aten's mm.
"""
from __future__ import annotations

import torch

from commfuse import ir
from commfuse.dependencies import trace_body
from commfuse.ir import TensorBox
from commfuse.virtualized import V

from . import register

aten = torch.ops.aten


@register(aten.mm.default)
def mm(a, b):
    if not (isinstance(a, TensorBox) and isinstance(b, TensorBox)) or not V.choices.use_mm_template(a, b):
        return None
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
