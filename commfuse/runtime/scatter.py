"""Values added into a tensor at indices, with atomic adds: `target.index_put_(indices, values,
accumulate=True)` where the indexed dims are adjacent. An embedding's backward decomposes to it
(one index along dim 0), and so does a bilinear or nearest upsample's (row and column indices
past the batch and channel dims).

aten's CUDA kernel for it sorts the indices and adds the values of one index one after another, so
its time grows with the number of values and with the most repeated index: 16384 tokens of BERT's
token-type ids, all 0, cost milliseconds, and Segformer's upsampled logits (8 x 150 x 512 x 512
values) hundreds. Here each block of (index, trailing element) pairs is one program that adds its
values atomically: the repeats contend only where they meet. The order of the adds varies between
runs, as it does in Inductor's kernel for the same op; under `torch.use_deterministic_algorithms`
the lowering keeps aten's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # (index, trailing element) pairs per program


@triton.jit(debug=True)  # the bounds assert stays on the GPU too, as in generated kernels' indirect loads
def _add_at(target, flat, values, K, M, T, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    # target is (P, M, T), values (P, K, T): values[p, k, t] goes to target[p, flat[k], t]
    blocks = tl.cdiv(K, BLOCK_K)
    p = (tl.program_id(0) // blocks).to(tl.int64)
    k = (tl.program_id(0) % blocks) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    i = tl.load(flat + k, k < K, other=0)
    tl.device_assert(((i >= 0) & (i < M)) | (k >= K), "index_put: index out of bounds")
    live = (k < K) & (t < T)
    v = tl.load(values + (p * K + k) * T + t, live)
    tl.atomic_add(target + (p * M + i) * T + t, v, live & (i >= 0) & (i < M), sem="relaxed")  # no order


@torch.library.custom_op("commfuse::index_add_at_", mutates_args=("target",))
def index_add_at_(target: torch.Tensor, indices: list[torch.Tensor], lead: int, values: torch.Tensor) -> None:
    """target[(:,) * lead + indices] += values, repeats adding up; the indices broadcast together."""
    if not target.is_contiguous():  # elements at strides of their own: aten's op
        target.index_put_((None,) * lead + tuple(indices), values, accumulate=True)
        return
    indices = torch.broadcast_tensors(*indices)
    sizes, tail = target.shape[lead:lead + len(indices)], target.shape[lead + len(indices):]
    flat, bad = 0, False  # each index wrapped and checked in its own dim, then row-major over them
    for i, n in zip(indices, sizes):
        i = torch.where(i < 0, i + n, i).long()
        flat, bad = flat * n + i, bad | (i < 0) | (i >= n)
    flat = torch.where(bad, -1, flat).reshape(-1)
    P, M, K, T = target.shape[:lead].numel(), sizes.numel(), flat.numel(), tail.numel()
    values = values.expand(*target.shape[:lead], *indices[0].shape, *tail).reshape(P, K, T).contiguous()
    if P * K * T == 0:
        return
    bt = min(triton.next_power_of_2(T), BLOCK)
    grid = (P * triton.cdiv(K, BLOCK // bt), triton.cdiv(T, bt))
    _add_at[grid](target, flat, values, K, M, T, BLOCK_K=BLOCK // bt, BLOCK_T=bt, sanitize_overflow=False)


def can_add_at(target_dtype: torch.dtype, index_dtypes) -> bool:
    """Where `index_add_at_` computes what aten's accumulating index_put_ would: fp32 adds (an
    atomic add of a half type rounds each step), integer indices, nondeterminism allowed."""
    return (target_dtype == torch.float32 and all(d in (torch.int64, torch.int32) for d in index_dtypes)
            and not torch.are_deterministic_algorithms_enabled())
