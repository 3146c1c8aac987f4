"""A softmax's row statistics (`prims.prepare_softmax_online`, which commfuse/decompositions.py
makes softmax, log-softmax and so cross-entropy of): the row's max and the row's sum of exp(x - max).
The pointwise rest of the softmax reads them like any buffer.

With `config.online_softmax`, the sum is one `softmax_sum` reduction of x itself (running max,
rescaled sum), so it needs no finished max and shares the max's pass over the row: a looped
row is read once for both.
"""
from __future__ import annotations

import torch

from commfuse import sizevars
from commfuse.virtualized import V, ops

from . import register
from .common import canonical_dim, make_pointwise
from .reduction import reduce


@register(torch.ops.prims.prepare_softmax_online.default)
def softmax_stats(x, dim):
    size, dtype = x.get_size(), x.get_dtype()
    dim = canonical_dim(dim, len(size))
    v = make_pointwise(lambda a: a, [x], out_dtype=dtype, compute_dtype=dtype)
    rnumel = size[dim]
    xnumel = sizevars.product(s for i, s in enumerate(size) if i != dim)
    if rnumel != 1 and V.choices.use_online_softmax(xnumel, rnumel):
        # first, so that the max of the same pass reuses its running max
        total = reduce(v, [dim], True, "softmax_sum", dtype)
        return reduce(v, [dim], True, "max", dtype), total
    mx = reduce(v, [dim], True, "max", dtype)
    e = make_pointwise(lambda a, m: ops.exp(ops.sub(a, m)), [v, mx], compute_dtype=dtype)
    return mx, reduce(e, [dim], True, "sum", dtype)
