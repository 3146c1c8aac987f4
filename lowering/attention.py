"""`commfuse::decode_attention` (put by passes/attention.py where the policy chose it) -> our
split-KV decode kernel (`ir.DecodeAttention`, codegen/decode_attention.py). Static sizes only;
otherwise the op runs as SDPA through aten."""
from __future__ import annotations

import sympy
import torch

import commfuse.runtime.attention  # noqa: F401  (registers commfuse::decode_attention)
from commfuse import ir, sizevars
from commfuse.virtualized import V

from . import register
from .extern import realize_arg


@register(torch.ops.commfuse.decode_attention.default)
def decode_attention(q, k, v, mask, scale):
    boxes = [x for x in (q, k, v, mask) if x is not None]
    if not all(isinstance(x, ir.TensorBox) and len(x.get_size()) <= 4 for x in boxes) or \
            not all(sizevars.is_static(n) for x in boxes for n in x.get_size()):
        raise ir.Unsupported("decode attention with dynamic sizes")
    args = [realize_arg(x) for x in (q, k, v)]
    kind, strides = None, []
    if mask is not None:
        m = realize_arg(mask)
        kind = "bool" if m.get_dtype() == torch.bool else "float"
        size, stride = [1] * (4 - len(m.layout.size)) + list(m.layout.size), \
            [0] * (4 - len(m.layout.stride)) + list(m.layout.stride)
        strides = [sympy.Integer(0) if int(n) == 1 else s for n, s in zip(size, stride)]
        strides = [strides[0], strides[1], strides[3]]  # b, head, key (one query)
        args.append(m)
    b, hq, _, d = q.get_size()
    out = ir.contiguous_layout(q.get_device(), q.get_dtype(), [b, hq, sympy.Integer(1), v.get_size()[3]],
                               ir.FixedLayout)
    return ir.TensorBox(V.graph.register_buffer(
        ir.DecodeAttention, layout=out, op=torch.ops.commfuse.decode_attention.default, args=tuple(args),
        out_variant=True, scale=float(scale), mask=kind, mask_strides=strides))
