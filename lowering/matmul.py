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
from .pointwise import add_sub
from .views import constant_pad_nd, permute, slice_
from .views import view as reshape

aten = torch.ops.aten


@register(aten.addmm.default)
def addmm(bias, a, b, beta=1, alpha=1):
    """A biased Linear. Where the few-row template takes the product, the bias is its pointwise
    consumer, so it becomes the template's epilogue (with q's rotary embedding, k's cache store:
    Qwen2's biased q/k/v), not a cuBLAS addmm apart from its group."""
    if beta != 1 or alpha != 1 or not isinstance(bias, TensorBox) or len(bias.get_size()) != 1:
        return None
    if _use_template(a, b):
        return add_sub(aten.add.Tensor, _template_mm(a, b), bias)
    return aligned_mm(a, b, bias)


def aligned_mm(a, b, bias=None):
    """A large matmul whose K, N (or M, the leading dimension of a left operand stored transposed:
    an LM head's weight gradient gᵀ @ h) is not a multiple of 16 bytes, on zero-padded operands
    into a padded output sliced back: cuBLAS takes unaligned kernels otherwise (GPT-2's head on
    H100: 3.3 ms, 0.45 aligned). None where choices keeps it as it is."""
    if not (isinstance(a, TensorBox) and isinstance(b, TensorBox)):
        return None
    (m, k), n = a.get_size(), b.get_size()[1]
    a_view = ir.as_strided_view(a)
    m_leading = a_view is not None and a_view.layout.stride_order() == [1, 0]
    multiple = V.choices.mm_pad_multiple(a.get_device(), a.get_dtype(), m, k, n, m_leading)
    if multiple is None:
        return None
    mp, kp, np_ = (-(-int(x) // multiple) * multiple if pad else int(x) for x, pad in ((m, m_leading), (k, 1), (n, 1)))
    args = (_zero_padded(a, [0, kp - int(k), 0, mp - int(m)]), _zero_padded(b, [0, np_ - int(n), 0, kp - int(k)]))
    if bias is not None:
        args = (_zero_padded(bias, [0, np_ - int(n)]),) + args
    layout = ir.contiguous_layout(a.get_device(), a.get_dtype(), [sympy.Integer(mp), sympy.Integer(np_)], ir.FixedLayout)
    out = TensorBox(V.graph.register_buffer(ir.ExternKernel, layout=layout, op=aten.addmm.out if bias is not None
                                            else aten.mm.out, args=args, kwargs={}, mutates=[], aliases=False,
                                            out_variant=True))
    out = slice_(out, 1, 0, n)
    return slice_(out, 0, 0, m) if mp != int(m) else out


def _zero_padded(x, pad):
    """x stored zero-padded, in its order in memory (`w.t()` stays transposed: a copy that streams;
    transposing GPT-2's head took 317 µs against 52), one copy for every matmul that pads the same
    stored value alike (`g @ w` for K, `gᵀ @ h` for M); an operand already aligned as it is. A
    value not yet stored is stored once, padded: its other readers (a bias gradient's sum) read
    the copy's leading part (an LM head's vocabulary-wide gradient was computed and stored twice)."""
    if not any(pad):
        return realize_arg(x)
    two_d, root = len(x.get_size()) == 2, ir.view_root(x)
    if two_d and isinstance(root.data, ir.Pointwise) and ir.is_reshape_of_root(x):
        (m, k), padded = x.get_size(), TensorBox(constant_pad_nd(x, pad).realize([0, 1]))
        root.data = reshape(slice_(slice_(padded, 0, 0, m), 1, 0, k), root.get_size()).data
        V.graph.padded_operands[_pad_key(ir.as_strided_view(x), x, pad)] = padded
        return padded.realize()
    view = ir.as_strided_view(x) if two_d else None
    if view is None:
        return constant_pad_nd(x, pad).realize()
    transposed = view.layout.stride_order() == [1, 0]
    if transposed:  # in memory order: the rows as stored
        x, pad = permute(x, [1, 0]), pad[2:] + pad[:2]
    key = _pad_key(view, x, pad, transposed)
    copies = V.graph.padded_operands
    if key not in copies:
        copies[key] = TensorBox(constant_pad_nd(x, pad).realize([0, 1]))
    return permute(copies[key], [1, 0]).realize() if transposed else copies[key].realize()


_LEFT = {aten.mm.default: 0, aten.addmm.default: 1}  # where each product op takes its left operand


def _sibling_mms(node) -> int:
    """Other mms (or addmms) whose left operand is this one's, through views (each nn.Linear views
    it anew)."""
    views = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
    if node is None or node.target not in _LEFT or not isinstance(node.args[_LEFT[node.target]], torch.fx.Node):
        return 0  # (an mm this lowering makes for another op)
    root = node.args[_LEFT[node.target]]
    while root.target in views and isinstance(root.args[0], torch.fx.Node):
        root = root.args[0]
    seen, todo, mms = set(), [root], 0
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.target in views and u not in seen:
                seen.add(u)
                todo.append(u)
            elif u.target in _LEFT and u.args[_LEFT[u.target]] is n and u is not node:
                mms += 1
    return mms


def _pad_key(view, x, pad, transposed=False) -> tuple:
    stride = view.layout.stride[::-1] if transposed else view.layout.stride
    return view.base.name, view.layout.offset, tuple(x.get_size()), tuple(stride), tuple(pad)


@register(aten.mm.default)
def mm(a, b):
    if not (isinstance(a, TensorBox) and isinstance(b, TensorBox)):
        return None
    return _template_mm(a, b) if _use_template(a, b) else aligned_mm(a, b)


def _use_template(a, b) -> bool:  # the policy's choice for the mm or addmm being lowered
    return isinstance(a, TensorBox) and isinstance(b, TensorBox) and \
        V.choices.use_mm_template(a, b, _sibling_mms(V.graph.current_node))


def _template_mm(a, b):
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
