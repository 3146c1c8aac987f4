"""Indirect indexing: index (advanced indexing), gather; embedding decomposes to index.

Indices are loaded, wrapped when negative, bounds-checked on the device, and masked
so an out-of-range index can never read outside the buffer. Mutations (index_put,
scatter, scatter_add) run through aten.
"""
from __future__ import annotations

import torch

from commfuse import ir, sizevars
from commfuse.ir import Pointwise, TensorBox
from commfuse.virtualized import V, ops

from . import register
from .common import broadcast_loader, broadcast_shapes, canonical_dim, to_size

aten = torch.ops.aten


def _check_index(t):
    if t.get_dtype() not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ir.Unsupported(f"index dtype {t.get_dtype()} (bool masks have data-dependent shapes)")


@register(aten.index.Tensor)
def index(x, indices):
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
            full[d] = ops.indirect_indexing(loaders[d](bidx), size[d])
        return load(full)
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(), inner, out))


@register(aten.gather.default)
def gather(x, dim, index_t, sparse_grad=False):
    _check_index(index_t)
    size = list(x.get_size())
    dim = canonical_dim(dim, len(size))
    load, lidx = x.make_loader(), index_t.make_loader()

    def inner(idx):
        full = list(idx)
        if size:
            full[dim] = ops.indirect_indexing(lidx(idx), size[dim])
        return load(full)
    return TensorBox(Pointwise(x.get_device(), x.get_dtype(), inner, list(index_t.get_size())))
