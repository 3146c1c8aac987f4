"""aten op -> IR. One module per op family; each registers its lowerings here."""
from __future__ import annotations

import importlib
from typing import Callable

import torch

lowerings: dict = {}

FAMILIES = ("pointwise", "reduction", "softmax", "views", "indexing", "comm", "matmul", "extern")  # random ops fall back to aten


def register(*ops, name: str | None = None) -> Callable:
    """Register `fn` as the lowering of each op (an OpOverloadPacket means all its overloads)."""
    def wrap(fn):
        for op in ops:
            overloads = ([getattr(op, o) for o in op.overloads()]
                         if isinstance(op, torch._ops.OpOverloadPacket) else [op])
            for ov in overloads:
                lowerings[ov] = fn
        return fn
    return wrap


_loaded = False


def load_all() -> None:
    global _loaded
    if not _loaded:
        for fam in FAMILIES:
            importlib.import_module(f"{__name__}.{fam}")
        _loaded = True
