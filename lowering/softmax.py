"""softmax and log_softmax (so also cross-entropy): the row's max, the row's sum of
exp(x - max), then the pointwise result.

With `config.online_softmax`, the sum is one `softmax_sum` reduction of x itself (running max,
rescaled sum), so it needs no finished max and shares the max's pass over the row: a looped
row is read twice (max + sum, then the output) instead of three times.
"""
from __future__ import annotations

import torch

from commfuse import ir, sizevars
from commfuse.virtualized import V, ops

from . import register
from .common import DEFAULT, canonical_dim, make_pointwise, promote
from .reduction import reduce

aten = torch.ops.aten


@register(aten._softmax.default)
def softmax(x, dim, half_to_float):
    return _softmax(x, dim, half_to_float, log=False)


@register(aten._log_softmax.default)
def log_softmax(x, dim, half_to_float):
    return _softmax(x, dim, half_to_float, log=True)


def _softmax(x, dim, half_to_float, log):
    if not x.get_dtype().is_floating_point:
        raise ir.Unsupported(f"softmax of {x.get_dtype()}")
    compute, result = promote([x], DEFAULT)
    if half_to_float:
        result = torch.float32
    size = x.get_size()
    if not size:
        raise ir.Unsupported("softmax of a 0-d tensor")
    dim = canonical_dim(dim, len(size))
    v = make_pointwise(lambda a: a, [x], out_dtype=compute, compute_dtype=compute)
    rnumel = size[dim]
    xnumel = sizevars.product(s for i, s in enumerate(size) if i != dim)
    if rnumel != 1 and V.choices.use_online_softmax(xnumel, rnumel):
        # first, so that the max of the same pass reuses its running max
        total = reduce(v, [dim], True, "softmax_sum", compute)
        mx = reduce(v, [dim], True, "max", compute)
    else:
        mx = reduce(v, [dim], True, "max", compute)
        e = make_pointwise(lambda a, m: ops.exp(ops.sub(a, m)), [v, mx], compute_dtype=compute)
        total = reduce(e, [dim], True, "sum", compute)
    if log:
        fn = lambda a, m, s: ops.sub(ops.sub(a, m), ops.log(s))  # noqa: E731
    else:
        fn = lambda a, m, s: ops.truediv(ops.exp(ops.sub(a, m)), s)  # noqa: E731
    return make_pointwise(fn, [v, mx, total], out_dtype=result, compute_dtype=compute)
