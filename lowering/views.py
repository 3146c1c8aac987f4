"""Views (reshape, permute, expand, squeeze, slice, select, as_strided), cat, constant_pad_nd.

A view is an index remapping of its base: no data moves until a consumer reads it.
"""
from __future__ import annotations

import sympy
import torch

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox, View
from commfuse.sizevars import FloorDiv, Mod
from commfuse.virtualized import V, ops

from . import register
from .common import canonical_dim, to_size

aten = torch.ops.aten
prims = torch.ops.prims


def make_view(x: TensorBox, size, reindex) -> TensorBox:
    return TensorBox(View(x, list(size), reindex))


# ----------------------------------------------------------------------------- reshape
def _infer_size(size, numel):
    size = to_size(size)
    if any(s == -1 for s in size):
        known = sizevars.product(s for s in size if s != -1)
        size = [FloorDiv(numel, known) if s == -1 else s for s in size]  # exact: numel // known
    return size


def reshape_indexer(old, new):
    """new index -> old index, group by group so plain splits/merges stay affine."""
    old, new = list(old), list(new)
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        oi, nj = [], []
        po, pn = sympy.Integer(1), sympy.Integer(1)
        # grow both sides until their products agree (and at least one dim is consumed)
        while True:
            if (oi or nj) and sizevars.equal(po, pn) and \
                    not (i < len(old) and old[i] == 1) and not (j < len(new) and new[j] == 1):
                break
            if i < len(old) and (sizevars.hint(po) <= sizevars.hint(pn) or j >= len(new)):
                oi.append(i); po = po * old[i]; i += 1
            elif j < len(new):
                nj.append(j); pn = pn * new[j]; j += 1
            else:
                break
        if not sizevars.equal(po, pn):
            raise ir.Unsupported(f"reshape {old} -> {new} needs a size relation we cannot prove")
        groups.append((oi, nj))

    def reindex(index):
        out = [sympy.Integer(0)] * len(old)
        for oi, nj in groups:
            flat = sizevars.ravel([index[k] for k in nj], [new[k] for k in nj])
            for k, v in zip(oi, sizevars.unravel(flat, [old[k] for k in oi])):
                out[k] = v
        return out
    return reindex


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          prims.reshape.default, aten.view_copy.default)
def view(x, size):
    new = _infer_size(size, x.get_numel())
    old = x.get_size()
    if len(new) == len(old) and all(sizevars.equal(a, b) for a, b in zip(old, new)):
        return x
    return make_view(x, new, reshape_indexer(old, new))


@register(aten.permute.default)
def permute(x, dims):
    dims = [canonical_dim(d, len(x.get_size())) for d in dims]
    size = x.get_size()
    inv = [dims.index(i) for i in range(len(dims))]
    return make_view(x, [size[d] for d in dims], lambda idx: [idx[inv[i]] for i in range(len(dims))])


@register(aten.t.default)
def t(x):
    return x if len(x.get_size()) < 2 else permute(x, [1, 0])


@register(aten.transpose.int)
def transpose(x, d0, d1):
    n = len(x.get_size())
    if n == 0:
        return x
    dims = list(range(n))
    d0, d1 = canonical_dim(d0, n), canonical_dim(d1, n)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return permute(x, dims)


@register(aten.expand.default, aten.expand_copy.default)
def expand(x, size, implicit=False):
    size = to_size(size)
    old = x.get_size()
    skip = len(size) - len(old)
    size = [old[i - skip] if s == -1 else s for i, s in enumerate(size)]
    bcast = [o == 1 and size[skip + i] != 1 for i, o in enumerate(old)]
    return make_view(x, size, lambda idx: [sympy.Integer(0) if b else i
                                           for b, i in zip(bcast, idx[skip:])])


@register(prims.broadcast_in_dim)
def broadcast_in_dim(x, shape, broadcast_dimensions):
    shape = to_size(shape)
    old = x.get_size()

    def reindex(idx):
        return [sympy.Integer(0) if old[k] == 1 and shape[d] != 1 else idx[d]
                for k, d in enumerate(broadcast_dimensions)]
    return make_view(x, shape, reindex)


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, prims.squeeze)
def squeeze(x, dims=None):
    size = x.get_size()
    if dims is None:
        dims = [i for i, s in enumerate(size) if s == 1]
    elif isinstance(dims, int):
        dims = [dims]
    dims = {canonical_dim(d, len(size)) for d in dims if size and size[canonical_dim(d, len(size))] == 1}
    keep = [i for i in range(len(size)) if i not in dims]

    def reindex(idx):
        out = [sympy.Integer(0)] * len(size)
        for k, i in enumerate(keep):
            out[i] = idx[k]
        return out
    return make_view(x, [size[i] for i in keep], reindex)


@register(aten.unsqueeze.default)
def unsqueeze(x, dim):
    size = list(x.get_size())
    dim = dim % (len(size) + 1)
    return make_view(x, size[:dim] + [sympy.Integer(1)] + size[dim:],
                     lambda idx: list(idx[:dim]) + list(idx[dim + 1:]))


@register(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(x, dim=0, start=None, end=None, step=1):
    size = list(x.get_size())
    dim = canonical_dim(dim, len(size))
    start, length = _slice_bounds(size[dim], start, end, step)
    if start == 0 and step == 1 and sizevars.equal(length, size[dim]):
        return x
    new = size[:dim] + [length] + size[dim + 1:]

    def reindex(idx):
        idx = list(idx)
        idx[dim] = start + idx[dim] * step
        return idx
    return make_view(x, new, reindex)


@register(prims.rev.default)
def rev(x, dims):
    """flip (its decomposition): each flipped dim read from its far end."""
    size, load = list(x.get_size()), x.make_loader()
    dims = {canonical_dim(d, len(size)) for d in dims}
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(),
                               lambda idx: load([size[d] - 1 - i if d in dims else i for d, i in enumerate(idx)]), size))


@register(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """x with src over x[start:end:step] along dim (the backward of every slice): each element
    picks src or x, so it fuses like any pointwise op instead of a copy of x and a copy into it."""
    size = list(x.get_size())
    dim = canonical_dim(dim, len(size))
    start, length = _slice_bounds(size[dim], start, end, step)
    load_x, load_src = x.make_loader(), src.make_loader()

    def inner(idx):
        i = idx[dim]
        inside = _in_range(i, start, start + (length - 1) * step + 1)
        if step != 1:
            on_step = ops.eq(ops.index_expr(Mod(i - start, step), torch.int64), ops.index_expr(sympy.Integer(0), torch.int64))
            inside = ops.logical_and(inside, on_step)
        at = list(idx)
        at[dim] = FloorDiv(i - start, step) if step != 1 else i - start
        return ops.where(inside, ops.masked(inside, lambda: load_src(at), 0.0), load_x(idx))
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(), inner, size))


@register(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    """x with src at `index` along dim (the backward of a select, as for a fused q/k/v
    projection's bias): src is read only where it lands, where the decomposition (a `where`
    over the whole of x) would read it, and every other source, at every element."""
    dim = canonical_dim(dim, len(x.get_size()))
    index = sizevars.from_torch(index)
    if _negative(index):
        index = x.get_size()[dim] + index
    return slice_scatter(x, unsqueeze(src, dim), dim, index, index + 1)


def _slice_bounds(n, start, end, step):
    """(start, length) with python slice semantics. A symbolic bound is wrapped and clamped as its
    hint says: torch made those comparisons when it traced the slice, and Dynamo guards them
    (HF's sliding-window cache slices from `-window + 1`)."""
    start = sizevars.from_torch(0 if start is None else start)
    end = sizevars.from_torch(n if end is None else end)
    if end.is_number and int(end) >= 2**62:
        end = n
    if n.is_number and start.is_number and end.is_number:
        start, end = (int(n) + int(i) if int(i) < 0 else int(i) for i in (start, end))
        lo = min(max(start, 0), int(n))
        hi = min(max(end, lo), int(n))
        return sympy.Integer(lo), sympy.Integer((hi - lo + step - 1) // step)
    if (start.free_symbols | end.free_symbols) & set(V.graph.symbol_defs) and not all(
            sizevars.known_true(r) for r in (sympy.Ge(start, 0), sympy.Le(start, end), sympy.Le(end, n))):
        # a bound known only at run time (`x[:n.item()]`): its hint is a guess, so where torch has not
        # proven it in range, its clamping is aten's (its meta size is Min(size, bound))
        raise ir.Unsupported("a slice bound known only at run time, not proven within the dim")
    start, end = _in_range_by_hint(start, n), _in_range_by_hint(end, n)
    end = start if _negative(end - start) else end  # x[a:b] with a > b: empty
    length = end - start if step == 1 else FloorDiv(end - start + step - 1, step)
    return start, length


def _negative(i) -> bool:
    """By its hint, where it has one (a symbol without, such as an unbacked one, is taken as >= 0)."""
    return i.free_symbols <= set(V.graph.size_hints) and sizevars.hint(i) < 0


def _in_range_by_hint(i, n):
    i = n + i if _negative(i) else i
    if _negative(i):
        return sympy.Integer(0)
    return n if _negative(n - i) else i


@register(aten.unfold.default)
def unfold(x, dimension, size, step):
    """Windows of `size` every `step` along `dimension`, as a new last dim: an affine view."""
    shape = list(x.get_size())
    if not shape:
        raise ir.Unsupported("unfold of a 0-d tensor")
    dim, size, step = canonical_dim(dimension, len(shape)), sizevars.from_torch(size), sizevars.from_torch(step)
    new = shape[:dim] + [FloorDiv(shape[dim] - size, step) + 1] + shape[dim + 1:] + [size]
    return make_view(x, new, lambda idx: list(idx[:dim]) + [idx[dim] * step + idx[-1]] + list(idx[dim + 1:-1]))


@register(aten.select.int, aten.select_copy.int)
def select(x, dim, index):
    size = list(x.get_size())
    dim = canonical_dim(dim, len(size))
    index = sizevars.from_torch(index)
    if _negative(index):  # a symbolic one too, as torch took it (guarded)
        index = size[dim] + index
    new = size[:dim] + size[dim + 1:]
    return make_view(x, new, lambda idx: list(idx[:dim]) + [index] + list(idx[dim:]))


@register(aten.as_strided.default, aten.as_strided_copy.default)
def as_strided(x, size, stride, storage_offset=None):
    """Read x's storage directly. The strides count in eager's storage of x, which ours may not be
    (rows padded, channels_last): a value of ours laid out otherwise is stored contiguous first
    where it is its whole storage in eager; elsewhere the graph cannot compile (aten's as_strided
    would misread our storage as well)."""
    eager = V.graph.current_node.args[0].meta.get("val")
    base = x.realize()
    base_buf = ir.stored(base)
    ours = not isinstance(base_buf, (ir.InputBuffer, ir.ConstantBuffer))
    if ours and isinstance(eager, torch.Tensor) and not _laid_out_as(base, base_buf, eager):
        if not _whole_storage(eager):
            raise ir.NoOpFallback("as_strided over a storage laid out unlike eager's")
        base = base_buf = V.graph.register_buffer(ir.ComputedBuffer, layout=ir.FixedLayout(  # eager's strides
            x.get_device(), x.get_dtype(), x.get_size(), [sizevars.from_torch(s) for s in eager.stride()]),
            data=Pointwise(x.get_device(), x.get_dtype(), base.make_loader(), list(x.get_size())))
    here = base.layout.offset if isinstance(base, ir.ReinterpretView) else sympy.Integer(0)
    if storage_offset is None:  # x's own offset
        offset = here
    else:  # counted from eager's storage; an input's (or constant's) buffer starts at its own data, where
        offset = sizevars.from_torch(storage_offset)  # eager's x sits `here` past it
        if not ours and isinstance(eager, torch.Tensor):
            offset = offset - (sizevars.from_torch(eager.storage_offset()) - here)
    layout = ir.FixedLayout(x.get_device(), x.get_dtype(), to_size(size), to_size(stride), offset)
    if isinstance(base_buf, ir.ComputedBuffer):
        base_buf.freeze_layout()
    dense = base_buf.layout.is_contiguous() or (isinstance(eager, torch.Tensor) and _whole_storage(eager)
                                                and base_buf.layout.has_strides(ir.meta_layout(eager).stride))
    if not dense or base_buf.layout.offset != 0:
        raise ir.Unsupported("as_strided over a non-contiguous storage")
    return TensorBox(ir.ReinterpretView(base_buf, layout))


def _laid_out_as(view, buf, eager) -> bool:
    """Does our `view` of `buf` sit in its storage as `eager` sits in eager's (strides, offset and
    the storage's size)?"""
    lay = buf.layout
    return view.layout.has_strides(ir.meta_layout(eager).stride) and \
        sizevars.equal(view.layout.offset, sizevars.from_torch(eager.storage_offset())) and \
        sizevars.equal(lay.storage_numel() * lay.dtype.itemsize, sizevars.from_torch(eager.untyped_storage().nbytes()))


def _whole_storage(t) -> bool:
    """Is `t` (an FX value) dense over the whole of its storage, in eager: contiguous, or its dims
    permuted (a pointwise op keeps its input's order: Mamba2's masked x.transpose(1, 2))?"""
    return isinstance(t, torch.Tensor) and ir.meta_layout(t).is_dense() and t.storage_offset() == 0 and \
        sizevars.equal(sizevars.from_torch(t.untyped_storage().nbytes()), sizevars.from_torch(t.numel() * t.element_size()))


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(x, offset=0, dim1=0, dim2=1):
    size = list(x.get_size())
    n = len(size)
    d1, d2 = canonical_dim(dim1, n), canonical_dim(dim2, n)
    if not (size[d1].is_number and size[d2].is_number):
        raise ir.Unsupported("symbolic diagonal")
    length = max(0, min(int(size[d1]) + min(offset, 0), int(size[d2]) - max(offset, 0)))
    rest = [i for i in range(n) if i not in (d1, d2)]

    def reindex(idx):
        out = [None] * n
        for k, i in enumerate(rest):
            out[i] = idx[k]
        out[d1] = idx[-1] + max(-offset, 0)
        out[d2] = idx[-1] + max(offset, 0)
        return out
    return make_view(x, [size[i] for i in rest] + [sympy.Integer(length)], reindex)


# ----------------------------------------------------------------------------- data movement
@register(aten.cat.default)
def cat(tensors, dim=0):
    tensors = [t for t in tensors if not (len(t.get_size()) == 1 and t.get_size()[0] == 0)] or tensors[:1]
    if len(tensors) == 1:
        return _copy(tensors[0])
    size = list(tensors[0].get_size())
    dim = canonical_dim(dim, len(size))
    dtype = V.graph.current_node.meta["val"].dtype if V.graph.current_node is not None else tensors[0].get_dtype()
    offsets, acc = [], sympy.Integer(0)
    for t in tensors:
        offsets.append(acc)
        acc = acc + t.get_size()[dim]
    size[dim] = acc
    placed = _cat_by_out_views(tensors, dim, offsets, dtype)
    if placed is not None:
        return placed
    loaders = [t.make_loader() for t in tensors]

    def inner(idx):
        value = None
        for k in range(len(tensors) - 1, -1, -1):
            local = list(idx)
            local[dim] = idx[dim] - offsets[k]
            load = loaders[k]
            here = ops.masked(_in_range(idx[dim], offsets[k], offsets[k] + tensors[k].get_size()[dim]),
                              lambda load=load, local=local, k=k: ops.to_dtype(load(local), dtype), 0)
            if value is None:
                value = here
            else:
                value = ops.where(_in_range(idx[dim], offsets[k], offsets[k] + tensors[k].get_size()[dim]),
                                  here, value)
        return value
    return TensorBox(Pointwise(tensors[0].get_device(), dtype, inner, size))


def _cat_by_out_views(tensors, dim, offsets, dtype):
    """A cat of extern outputs (matmuls) that feed only the cat: allocate the cat once and let each
    op write its slice through `out=`, instead of copying every input in a kernel."""
    node = V.graph.current_node
    parts = [t.data for t in tensors]
    if node is None or len(node.args[0]) != len(parts) or len({id(p) for p in parts}) < len(parts) \
            or any(not isinstance(p, ir.ExternKernel) or p.get_dtype() != dtype for p in parts) \
            or any(not isinstance(n, torch.fx.Node) or len(n.users) != 1 for n in node.args[0]):
        return None  # another reader would see the op's output at the cat's strides
    layout = ir.meta_layout(node.meta["val"])
    slices = [ir.FixedLayout(layout.device, dtype, list(p.get_size()), list(layout.stride), off * layout.stride[dim])
              for p, off in zip(parts, offsets)]
    if not all(V.choices.extern_writes_slice(p, s) for p, s in zip(parts, slices)):
        return None
    buf = V.graph.register_buffer(ir.ConcatBuffer, layout=layout, parts=parts)
    for p, s in zip(parts, slices):
        p.out_view = ir.ReinterpretView(buf, s)
        p.layout = ir.FixedLayout(s.device, s.dtype, s.size, s.stride)  # its name holds the slice
    return TensorBox(buf)


def _in_range(i, lo, hi):
    dt = torch.int64
    conds = []
    if lo != 0:
        conds.append(ops.ge(ops.index_expr(i, dt), ops.index_expr(lo, dt)))
    conds.append(ops.lt(ops.index_expr(i, dt), ops.index_expr(hi, dt)))
    return conds[0] if len(conds) == 1 else ops.logical_and(*conds)


def _copy(x):
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(), x.make_loader(), list(x.get_size())))


@register(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0.0):
    size = list(x.get_size())
    n = len(size)
    new = list(size)
    lows = [sympy.Integer(0)] * n
    for k in range(len(pad) // 2):
        d = n - 1 - k
        lo, hi = sizevars.from_torch(pad[2 * k]), sizevars.from_torch(pad[2 * k + 1])
        lows[d] = lo
        new[d] = size[d] + lo + hi
    load = x.make_loader()
    dtype = x.get_dtype()

    def inner(idx):
        src = [i - lo for i, lo in zip(idx, lows)]
        conds = [_in_range(i, lo, lo + s) for i, lo, s, d in zip(idx, lows, size, range(n))
                 if lows[d] != 0 or new[d] != size[d]]
        if not conds:
            return load(src)
        mask = conds[0]
        for c in conds[1:]:
            mask = ops.logical_and(mask, c)
        return ops.masked(mask, lambda: load(src), value)
    return TensorBox(Pointwise(x.get_device(), dtype, inner, new))
