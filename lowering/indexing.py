"""Indirect indexing: index (advanced indexing), gather; embedding decomposes to index.

Indices are loaded, wrapped when negative, bounds-checked on the device, and masked
so an out-of-range index can never read outside the buffer. Mutations (scatter_add,
scatter in general) run through aten; a scatter that puts a few values per row is pointwise (the
one-hot of cross entropy's backward, topk's), and index_put runs in place on a buffer of our own
(values added at indices with atomic adds: runtime/scatter.py). A graph input's rows updated in place
at positions along one dim (a static KV cache's `index_copy_`) are stored there by the kernel that
computes them (`ir.ScatterLayout`): no aten op, no copy.
"""
from __future__ import annotations

import sympy
import torch

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.runtime.scatter import can_add_at
from commfuse.virtualized import V, ops

from . import register
from .common import broadcast_loader, broadcast_shapes, canonical_dim, is_tensor
from .extern import fallback
from .views import expand

aten = torch.ops.aten


def _check_index(t):
    if t.get_dtype() not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ir.Unsupported(f"index dtype {t.get_dtype()} (bool masks have data-dependent shapes)")


@register(aten.index.Tensor)
def index(x, indices, check=True):
    size = list(x.get_size())
    present = [i for i, t in enumerate(indices) if t is not None]
    for i in present:
        _check_index(indices[i])
    bshape = broadcast_shapes(*[indices[i].get_size() for i in present])
    adjacent = present == list(range(present[0], present[-1] + 1))
    rest = [d for d in range(len(size)) if d not in present]
    if adjacent:
        before = [d for d in rest if d < present[0]]
        after = [d for d in rest if d > present[0]]
    else:
        before, after = [], rest
    out = [size[d] for d in before] + bshape + [size[d] for d in after]
    loaders = {i: broadcast_loader(indices[i], bshape) for i in present}
    load = x.make_loader()
    nb = len(before)

    def inner(idx):
        full = [None] * len(size)
        for k, d in enumerate(before):
            full[d] = idx[k]
        bidx = idx[nb:nb + len(bshape)]
        for k, d in enumerate(after):
            full[d] = idx[nb + len(bshape) + k]
        for d in present:
            full[d] = ops.indirect_indexing(loaders[d](bidx), size[d], check)
        return load(full)
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(), inner, out))


# indices in bounds by construction (upsampling's): no device asserts, which compile a kernel in
# Triton's debug mode (every nearest and bilinear upsample had them)
@register(aten._unsafe_index.Tensor)
def unsafe_index(x, indices):
    return index(x, indices, check=False)


@register(aten.gather.default)
def gather(x, dim, index_t, sparse_grad=False):
    _check_index(index_t)
    size = list(x.get_size())
    if size and len(size) != len(index_t.get_size()):  # aten lets an empty index have any rank
        raise ir.Unsupported("gather index of another rank than the input")
    dim = canonical_dim(dim, len(size))
    load, lidx = x.make_loader(), index_t.make_loader()

    def inner(idx):
        if not size:  # a 0-d input reads as one element, whatever the index's rank (0 or 1)
            return load([])
        full = list(idx)
        full[dim] = ops.indirect_indexing(lidx(idx), size[dim], wrap=False)  # (aten's gather takes no negative)
        return load(full)
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(), inner, list(index_t.get_size())))


@register(aten.scatter.value, aten.scatter.src)
def scatter(x, dim, index_t, src):
    """`x` with `src` put at `index` along `dim`, when `index` is a few elements long along `dim`
    and as large as `x` elsewhere: each output element compares its position with its row's
    indices, the last that hits wins (as on CPU), so no copy of `x` is scattered into (aten's
    out-of-place scatter stores two tensors of x's size). Other shapes run through aten."""
    _check_index(index_t)
    size, isize = list(x.get_size()), list(index_t.get_size())
    if not size:
        raise ir.Unsupported("0-d scatter")
    dim = canonical_dim(dim, len(size))
    if len(isize) != len(size) or not V.choices.scatter_as_pointwise(isize[dim]) \
            or not all(sizevars.equal(a, b) for d, (a, b) in enumerate(zip(size, isize)) if d != dim):
        raise ir.Unsupported("scatter of more indices per row than scatter_as_pointwise takes, or another shape")
    load, lidx, dtype = x.make_loader(), index_t.make_loader(), x.get_dtype()
    lsrc = src.make_loader() if isinstance(src, TensorBox) else lambda idx: ops.constant(src, dtype)

    def inner(idx):
        out = load(idx)
        for k in range(int(isize[dim])):
            row = [sympy.Integer(k) if d == dim else i for d, i in enumerate(idx)]
            ops.indirect_indexing(lidx(row), size[dim], wrap=False)  # for its bounds assert, as aten's check
            hit = ops.eq(lidx(row), ops.index_expr(idx[dim], index_t.get_dtype()))
            value = lsrc(row)
            if isinstance(src, TensorBox) and src.get_dtype() != dtype:
                value = ops.to_dtype(value, dtype)
            out = ops.where(hit, value, out)
        return out
    return TensorBox(Pointwise(x.get_device(), dtype, inner, size))


@register(aten.index_put.default)
def index_put(x, indices, values, accumulate=False):
    """An in-place index_put_ on a new buffer holding `x` (zeros, for embedding's backward: the
    fill kernel writes it): the out-of-place op would allocate and copy a second one. Values added
    at indices of adjacent dims (an embedding's, an upsample's backward) take runtime/scatter.py's
    atomic adds, others aten's op."""
    lead = next((d for d, i in enumerate(indices) if i is not None), len(indices))
    if (masked := _masked_fill(x, indices, values, accumulate, lead)) is not None:
        return masked
    target = TensorBox(Pointwise(x.get_device(), x.get_dtype(), x.make_loader(), list(x.get_size())))
    target.realize()
    given = list(indices[lead:])
    while given and given[-1] is None:
        given.pop()
    atomic = accumulate and given and None not in given and isinstance(values, TensorBox) \
        and can_add_at(x.get_dtype(), [i.get_dtype() for i in given]) \
        and all(i.get_device() == x.get_device() for i in (*given, values))  # aten takes a CPU index
    if atomic:
        fallback(torch.ops.commfuse.index_add_at_.default, (target, given, lead, values), {}, None)
    else:
        fallback(aten.index_put_.default, (target, indices, values, accumulate), {}, None)
    return target


def _masked_fill(x, indices, value, accumulate, lead):
    """`x[..., mask] = v` (a bool mask over dims lead.., one value: DTensor's vocab-parallel embedding
    masks its ids and rows so) as a pointwise where(mask, v, x): aten's op would find the mask's
    positions with nonzero, a sync with the host that a CUDA graph cannot capture."""
    mask = indices[lead] if lead < len(indices) else None
    if accumulate or mask is None or any(i is not None for i in indices[lead + 1:]) or mask.get_dtype() != torch.bool \
            or not isinstance(value, TensorBox) or not sizevars.is_static(n := sizevars.product(value.get_size())) \
            or int(n) != 1 or len({mask.get_device(), x.get_device(), value.get_device()}) != 1:
        return None
    k, size = len(mask.get_size()), list(x.get_size())
    if lead + k > len(size) or not all(sizevars.equal(a, b) for a, b in zip(mask.get_size(), size[lead:])):
        return None
    lm, lx, lv, dtype = mask.make_loader(), x.make_loader(), value.make_loader(), x.get_dtype()
    zero = [sympy.Integer(0)] * len(value.get_size())
    return TensorBox(Pointwise(x.get_device(), dtype, lambda idx: ops.where(
        lm(list(idx[lead:lead + k])), ops.to_dtype(lv(zero), dtype), lx(idx)), size))


@register(aten.index_put_.default)
def index_put_into_input(x, indices, values, accumulate=False):
    """`x[..., pos, ...] = values` on a whole graph input, one index tensor along one dim (what
    `reinplace.py` makes of a KV cache's `index_copy_`): a kernel over the values stores each
    row at its position in the input. Repeated positions keep one of their rows, as aten's CUDA
    kernel does. Else (accumulate, several index tensors, a buffer of ours) aten's op."""
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if accumulate or not is_tensor(x) or type(x.data) is not ir.InputBuffer or len(given) != 1:
        raise ir.Unsupported("index_put_ other than rows of a graph input at positions along one dim")
    (dim, pos), lay = given[0], x.data.layout
    if len(pos.get_size()) != 1 or not is_tensor(values) or pos.get_device() != x.get_device():
        raise ir.Unsupported("index_put_ with other than a 1-D index on the input's device")
    _check_index(pos)
    size = list(x.get_size())
    bound, size[dim] = size[dim], pos.get_size()[0]
    load = expand(values, size).make_loader()
    body = Pointwise(x.get_device(), x.get_dtype(), lambda i: ops.to_dtype(load(i), x.get_dtype()), size)
    layout = ir.ScatterLayout(lay.device, lay.dtype, size, list(lay.stride), lay.offset, target=x.data.name,
                              dim=dim, positions=pos.make_loader(), bound=bound)
    V.graph.register_buffer(ir.ComputedBuffer, layout=layout, data=body)
    return x


@register(aten.index_copy_.default)
def index_copy_into_input(x, dim, index, source):
    """`x.index_copy_(dim, index, source)` on a graph input: `index_put_` at `index` along `dim`."""
    return index_put_into_input(x, [None] * canonical_dim(dim, len(x.get_size())) + [index], source)
