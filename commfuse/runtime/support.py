"""Helpers the generated modules import."""
from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def empty_strided(size, stride, device, dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, device=device, dtype=dtype)


def reinterpret_tensor(base: torch.Tensor, size, stride, offset) -> torch.Tensor:
    return base.as_strided(size, stride, base.storage_offset() + offset)


def workspace(cache: dict, key: str, numel: int, dtype, device) -> torch.Tensor:
    """A zeroed scratch tensor kept for the module's life (the same memory in every CUDA-graph
    replay): the split-K matmul adds into it and leaves it zeroed again."""
    t = cache.get(key)
    if t is None:
        t = cache[key] = torch.zeros(numel, dtype=dtype, device=device)
    return t
