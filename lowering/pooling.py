"""Pooling: max_pool2d with its indices, and its backward, as pointwise gathers over windows."""
from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.sizevars import FloorDiv, Mod
from commfuse.virtualized import V, ops

from . import register

aten = torch.ops.aten


def _pair(v) -> list:
    return [v, v] if isinstance(v, int) else list(v) * (2 // len(v))


def _inside(i, n):
    i64 = torch.int64
    return ops.logical_and(ops.ge(ops.index_expr(i, i64), ops.constant(0, i64)),
                           ops.lt(ops.index_expr(i, i64), ops.index_expr(n, i64)))


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Each window's max and where it is (h * W + w), found as aten finds them: the first maximum,
    unless a NaN comes (then the last NaN); padding never wins. Two loops over the same loads,
    which fuse into one kernel (or the indices die, in inference)."""
    (kh, kw), (sh, sw), (ph, pw) = (_pair(v) for v in (kernel_size, stride or kernel_size, padding))
    if ceil_mode or _pair(dilation) != [1, 1] or len(x.get_size()) != 4 or not x.get_dtype().is_floating_point:
        raise ir.Unsupported("ceil_mode, dilation, an unbatched or integer input")
    H, W = x.get_size()[2:]
    load, dtype, i64 = x.make_loader(), x.get_dtype(), torch.int64
    size = [sizevars.from_torch(s) for s in V.graph.current_node.meta["val"][0].shape]
    # A window with nothing above -inf keeps its first index: the first tap inside, but 0 in
    # aten's CUDA kernel for channels_last inputs (eager's layout of the input decides).
    first_is_zero = x.get_device().type == "cuda" and suggest_memory_format(
        V.graph.current_node.args[0].meta["val"]) == torch.channels_last

    def window(idx, want_index):
        n, c, oh, ow = idx
        h0, w0 = oh * sh - ph, ow * sw - pw
        zero = ops.constant(0, i64)
        where = zero if first_is_zero else ops.add(
            ops.mul(ops.maximum(ops.index_expr(h0, i64), zero), ops.index_expr(W, i64)),
            ops.maximum(ops.index_expr(w0, i64), zero))
        best = ops.constant(float("-inf"), dtype)
        for h, w in ((h0 + i, w0 + j) for i in range(kh) for j in range(kw)):
            mask = ops.logical_and(_inside(h, H), _inside(w, W)) if ph or pw else None
            v = load([n, c, h, w]) if mask is None else \
                ops.masked(mask, lambda: load([n, c, h, w]), float("-inf"))
            take = ops.logical_or(ops.gt(v, best), ops.isnan(v))
            best, where = ops.where(take, v, best), ops.where(take, ops.index_expr(h * W + w, i64), where)
        return where if want_index else best
    return tuple(TensorBox(Pointwise(x.get_device(), dt, lambda idx, k=k: window(idx, k), list(size)))
                 for k, dt in ((False, dtype), (True, i64)))


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Each input position gathers the gradient of every window that took it as its max. Tap i of
    window oh lies at oh * sh - ph + i * dh, so (h, w) meets at most kh * kw windows, each checked
    against its saved index: no atomics, and the result fuses with what reads it."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (
        _pair(v) for v in (kernel_size, stride or kernel_size, padding, dilation))
    if len(x.get_size()) not in (3, 4):
        raise ir.Unsupported("max_pool2d_with_indices_backward of a non-3-D, non-4-D input")
    dtype, i64 = grad.get_dtype(), torch.int64
    acc = torch.float32 if dtype.itemsize < 4 else dtype
    H, W = x.get_size()[-2:]
    OH, OW = grad.get_size()[-2:]
    load_grad, load_index = grad.make_loader(), indices.make_loader()

    def windows(pos, k, s, p, d, n):
        """(window, whether it exists) for each tap of the k that may cover `pos` (an offset
        keeps the numerator non-negative, so that // and % need no sign care)."""
        lift = -(-(k - 1) * d // s)
        for i in range(k):
            t = pos + p - i * d + s * lift
            q = FloorDiv(t, s)
            ok = ops.logical_and(ops.ge(ops.index_expr(q, i64), ops.constant(lift, i64)),
                                 ops.lt(ops.index_expr(q, i64), ops.index_expr(n + lift, i64)))
            if s != 1:
                ok = ops.logical_and(ok, ops.eq(ops.index_expr(Mod(t, s), i64), ops.constant(0, i64)))
            yield q - lift, ok

    def gather(idx):
        *lead, h, w = idx
        here = ops.index_expr(h * W + w, i64)
        total = ops.constant(0, acc)
        for oh, ok_h in windows(h, kh, sh, ph, dh, OH):
            for ow, ok_w in windows(w, kw, sw, pw, dw, OW):
                at = [*lead, oh, ow]

                def picked(at=at):
                    g = ops.to_dtype(load_grad(at), acc)
                    return ops.where(ops.eq(load_index(at), here), g, ops.constant(0, acc))
                total = ops.add(total, ops.masked(ops.logical_and(ok_h, ok_w), picked, 0))
        return ops.to_dtype(total, dtype)
    return TensorBox(Pointwise(x.get_device(), dtype, gather, list(x.get_size())))
