"""Helpers the generated modules import."""
from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def empty_strided(size, stride, device, dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, device=device, dtype=dtype)


def reinterpret_tensor(base: torch.Tensor, size, stride, offset) -> torch.Tensor:
    return base.as_strided(size, stride, base.storage_offset() + offset)
