"""Rows added into a tensor at indices, with atomic adds: `target.index_put_([index], values,
accumulate=True)`, the op that an embedding's backward decomposes to.

aten's CUDA kernel for it sorts the indices and adds the rows of one index one after another, so
its time grows with the most repeated index: 16384 tokens of BERT's token-type ids, all 0, cost
milliseconds. Here each (row, column block) is one program that adds its values atomically: the
repeats contend only where they meet. The order of the adds varies between runs, as it does in
Inductor's kernel for the same op; under `torch.use_deterministic_algorithms` the lowering keeps
aten's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program; one program per row when a row fits


@triton.jit(debug=True)  # the bounds assert stays on the GPU too, as in generated kernels' indirect loads
def _add_rows(target, index, values, width, bound, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.load(index + row + 0 * cols).to(tl.int64)  # the row's index in every lane: masks stay blocks
    i = tl.where(i < 0, i + bound, i)
    tl.device_assert((i >= 0) & (i < bound), "index_put: index out of bounds")
    inside = (cols < width) & (i >= 0) & (i < bound)  # never written outside, asserts off or not
    v = tl.load(values + row.to(tl.int64) * width + cols, cols < width)
    tl.atomic_add(target + i * width + cols, v, inside, sem="relaxed")  # no order among the adds


@torch.library.custom_op("commfuse::index_add_rows_", mutates_args=("target",))
def index_add_rows_(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """target[index] += values, repeats adding up, along dim 0."""
    if not target.is_contiguous():  # rows at a stride of their own: aten's op
        target.index_put_((index,), values, accumulate=True)
        return
    width = target[0].numel() if target.shape[0] else 0
    rows = values.expand(*index.shape, *target.shape[1:]).contiguous().view(-1, max(width, 1))
    index = index.reshape(-1)
    if index.numel() == 0 or width == 0:
        return
    grid = (index.numel(), triton.cdiv(width, BLOCK))
    _add_rows[grid](target, index, rows, width, target.shape[0], BLOCK=BLOCK, sanitize_overflow=False)


def can_add_rows(target_dtype: torch.dtype, index_dtype: torch.dtype) -> bool:
    """Where `index_add_rows_` computes what aten's accumulating index_put_ would: fp32 adds (an
    atomic add of a half type rounds each step), integer indices, nondeterminism allowed."""
    return (target_dtype == torch.float32 and index_dtype in (torch.int64, torch.int32)
            and not torch.are_deterministic_algorithms_enabled())
