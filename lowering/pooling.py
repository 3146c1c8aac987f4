"""Pooling: max_pool2d with its indices, avg_pool2d, and their backwards, as pointwise gathers over windows."""
from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers the low-memory max-pool prims)
from torch._prims_common import suggest_memory_format

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.sizevars import FloorDiv, Mod
from commfuse.virtualized import V, ops

from . import register

aten = torch.ops.aten
prims = torch.ops.prims


def _pair(v) -> list:
    return [v, v] if isinstance(v, int) else list(v) * (2 // len(v))


def _inside(i, n):
    i64 = torch.int64
    return ops.logical_and(ops.ge(ops.index_expr(i, i64), ops.constant(0, i64)),
                           ops.lt(ops.index_expr(i, i64), ops.index_expr(n, i64)))


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, offsets=False)


def max_pool2d_with_offsets(x, kernel_size, stride, padding, dilation, ceil_mode):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, offsets=True)


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, offsets: bool):
    """Each window's max and where it is, h * W + w (or, with `offsets`, the tap's number i * kw + j
    within the window, as int8), found as aten finds them: the first maximum, unless a NaN comes
    (then the last NaN); padding never wins. Two loops over the same loads, which fuse into one
    kernel (or the indices die, in inference)."""
    (kh, kw), (sh, sw), (ph, pw) = (_pair(v) for v in (kernel_size, stride or kernel_size, padding))
    if _pair(dilation) != [1, 1] or len(x.get_size()) != 4 or not x.get_dtype().is_floating_point:
        raise ir.Unsupported("dilation, an unbatched or integer input")
    H, W = x.get_size()[2:]
    load, dtype, i64 = x.make_loader(), x.get_dtype(), torch.int64
    size = [sizevars.from_torch(s) for s in V.graph.current_node.meta["val"][0].shape]
    # A window with nothing above -inf keeps its first index: the first tap inside, but 0 in
    # aten's CUDA kernel for channels_last inputs (eager's layout of the input decides).
    first_is_zero = not offsets and x.get_device().type == "cuda" and suggest_memory_format(
        V.graph.current_node.args[0].meta["val"]) == torch.channels_last

    def window(idx, want_index):
        n, c, oh, ow = idx
        h0, w0 = oh * sh - ph, ow * sw - pw
        zero = ops.constant(0, i64)
        top, left = (ops.maximum(ops.index_expr(v, i64), zero) for v in ((-h0, -w0) if offsets else (h0, w0)))
        where = zero if first_is_zero else ops.add(ops.mul(top, ops.index_expr(kw if offsets else W, i64)), left)
        best = ops.constant(float("-inf"), dtype)
        for i, j in ((i, j) for i in range(kh) for j in range(kw)):
            h, w = h0 + i, w0 + j
            mask = ops.logical_and(_inside(h, H), _inside(w, W)) if ph or pw or ceil_mode else None
            v = load([n, c, h, w]) if mask is None else \
                ops.masked(mask, lambda: load([n, c, h, w]), float("-inf"))
            take = ops.logical_or(ops.gt(v, best), ops.isnan(v))
            best, where = ops.where(take, v, best), ops.where(take, ops.index_expr(i * kw + j if offsets else h * W + w, i64), where)
        return (ops.to_dtype(where, torch.int8) if offsets else where) if want_index else best
    return tuple(TensorBox(Pointwise(x.get_device(), dt, lambda idx, k=k: window(idx, k), list(size)))
                 for k, dt in ((False, dtype), (True, torch.int8 if offsets else i64)))


def max_pool_offsets_to_indices(offsets, kernel_size, input_size, stride, padding, dilation):
    """The index h * W + w of each window's tap number i * kw + j."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (_pair(v) for v in (kernel_size, stride, padding, dilation))
    load, i64, W = offsets.make_loader(), torch.int64, sizevars.from_torch(input_size[-1])

    def index(idx):
        *_, oh, ow = idx
        tap = ops.to_dtype(load(idx), i64)
        h = ops.add(ops.index_expr(oh * sh - ph, i64), ops.mul(ops.floordiv(tap, ops.constant(kw, i64)), ops.constant(dh, i64)))
        w = ops.add(ops.index_expr(ow * sw - pw, i64), ops.mul(ops.remainder(tap, ops.constant(kw, i64)), ops.constant(dw, i64)))
        return ops.add(ops.mul(h, ops.index_expr(W, i64)), w)
    indices = Pointwise(offsets.get_device(), i64, index, list(offsets.get_size()))
    # the backward reads the taps themselves: no 64-bit division per window (on H100, ResNet-18's
    # max-pool backward took 1371 µs through the indices)
    indices.taps = (offsets, [kh, kw], [sh, sw], [ph, pw], [dh, dw])
    return TensorBox(indices)


def _saved_taps(indices, pooling):
    # the offsets behind `indices`, where they are a max-pool's with this pooling
    data = indices.data.data if isinstance(indices.data, ir.ComputedBuffer) else indices.data
    taps = getattr(data, "taps", None)
    return taps[0] if taps is not None and list(taps[1:]) == [list(v) for v in pooling] else None


for _name, _lowering in (("_low_memory_max_pool_with_offsets", max_pool2d_with_offsets),
                         ("_low_memory_max_pool_offsets_to_indices", max_pool_offsets_to_indices)):
    if hasattr(prims, _name):  # where this torch has them (commfuse/decompositions.py uses them then)
        register(getattr(prims, _name).default)(_lowering)


def _acc(dtype):
    return torch.float32 if dtype.itemsize < 4 else dtype


def _windows(pos, k, s, p, d, n):
    """(window, whether it exists) for each tap of the k that may cover `pos` (an offset keeps
    the numerator non-negative, so that // and % need no sign care)."""
    i64, lift = torch.int64, -(-(k - 1) * d // s)
    for i in range(k):
        t = pos + p - i * d + s * lift
        q = FloorDiv(t, s)
        ok = ops.logical_and(ops.ge(ops.index_expr(q, i64), ops.constant(lift, i64)),
                             ops.lt(ops.index_expr(q, i64), ops.index_expr(n + lift, i64)))
        if s != 1:
            ok = ops.logical_and(ok, ops.eq(ops.index_expr(Mod(t, s), i64), ops.constant(0, i64)))
        yield q - lift, ok, i


def _gather(grad, x, kernel, stride, padding, dilation, part):
    """A pooling backward: each input position (h, w) sums part(window, h, w, tap) over the
    windows that cover it (at their tap number i * kw + j), in fp32 for 16-bit gradients. Tap i of
    window oh lies at oh * sh - ph + i * dh, so (h, w) meets at most kh * kw windows: no atomics,
    and the result fuses with what reads it."""
    dtype, (OH, OW) = grad.get_dtype(), grad.get_size()[-2:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    if len(x.get_size()) not in (3, 4):
        raise ir.Unsupported("a pooling backward of a non-3-D, non-4-D input")

    def fn(idx):
        *lead, h, w = idx
        total = ops.constant(0, _acc(dtype))
        for oh, ok_h, i in _windows(h, kh, sh, ph, dh, OH):
            for ow, ok_w, j in _windows(w, kw, sw, pw, dw, OW):
                total = ops.add(total, ops.masked(ops.logical_and(ok_h, ok_w),
                                                  lambda at=[*lead, oh, ow], tap=i * kw + j: part(at, h, w, tap), 0))
        return ops.to_dtype(total, dtype)
    return TensorBox(Pointwise(x.get_device(), dtype, fn, list(x.get_size())))


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Each input position gathers the gradient of every window that took it as its max, each
    checked against its saved index."""
    W, i64, acc = x.get_size()[-1], torch.int64, _acc(grad.get_dtype())
    pooling = [_pair(v) for v in (kernel_size, stride or kernel_size, padding, dilation)]
    offsets = _saved_taps(indices, pooling)
    load_grad, load_index = grad.make_loader(), (indices if offsets is None else offsets).make_loader()

    def picked(at, h, w, tap):
        taken = ops.eq(ops.to_dtype(load_index(at), torch.int32), ops.constant(tap, torch.int32)) if offsets is not None \
            else ops.eq(load_index(at), ops.index_expr(h * W + w, i64))
        return ops.where(taken, ops.to_dtype(load_grad(at), acc), ops.constant(0, acc))
    return _gather(grad, x, *pooling, picked)


def _avg(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """(kernel, stride, padding, divisor(oh, ow)) as aten's avg_pool2d divides window (oh, ow):
    by the override; else by its size within the input plus padding, clipped to the input unless
    count_include_pad (a constant kh * kw then, but for ceil_mode's windows past the padding)."""
    if len(x.get_size()) not in (3, 4) or not x.get_dtype().is_floating_point:
        raise ir.Unsupported("avg_pool2d of an integer or a non-3-D, non-4-D input")
    k, s, p = (_pair(v) for v in (kernel_size, stride or kernel_size, padding))
    acc, i64, fixed = _acc(x.get_dtype()), torch.int64, divisor_override or (
        k[0] * k[1] if count_include_pad and not ceil_mode else None)

    def divisor(*window):
        if fixed:
            return ops.constant(float(fixed), acc)
        count = ops.constant(1, i64)
        for o, kk, ss, pp, n in zip(window, k, s, p, x.get_size()[-2:]):
            start = ops.index_expr(o * ss - pp, i64)
            end = ops.minimum(ops.add(start, ops.constant(kk, i64)), ops.index_expr(n + pp, i64))
            if not count_include_pad:
                start, end = ops.maximum(start, ops.constant(0, i64)), ops.minimum(end, ops.index_expr(n, i64))
            count = ops.mul(count, ops.sub(end, start))
        return ops.to_dtype(count, acc)
    return k, s, p, divisor


@register(aten.avg_pool2d.default)
def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """Each window's sum, row by row as aten adds (in fp32 for 16-bit inputs), over its divisor."""
    (kh, kw), (sh, sw), (ph, pw), divisor = _avg(x, kernel_size, stride, padding, ceil_mode,
                                                  count_include_pad, divisor_override)
    (H, W), load, dtype, acc = x.get_size()[-2:], x.make_loader(), x.get_dtype(), _acc(x.get_dtype())
    size = [sizevars.from_torch(s) for s in V.graph.current_node.meta["val"].shape]

    def window(idx):
        *lead, oh, ow = idx
        total = ops.constant(0, acc)
        for h, w in ((oh * sh - ph + i, ow * sw - pw + j) for i in range(kh) for j in range(kw)):
            tap = lambda at=[*lead, h, w]: ops.to_dtype(load(at), acc)  # noqa: E731
            total = ops.add(total, ops.masked(ops.logical_and(_inside(h, H), _inside(w, W)), tap, 0)
                            if ph or pw or ceil_mode else tap())
        return ops.to_dtype(ops.truediv(total, divisor(oh, ow)), dtype)
    return TensorBox(Pointwise(x.get_device(), dtype, window, size))


@register(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Each input position gathers grad / divisor from every window that covers it."""
    k, s, p, divisor = _avg(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    load, acc = grad.make_loader(), _acc(grad.get_dtype())
    return _gather(grad, x, k, s, p, [1, 1], lambda at, h, w, tap: ops.truediv(
        ops.to_dtype(load(at), acc), divisor(*at[-2:])))
