"""aten op -> IR. One module per op family; each registers its lowerings here."""
from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch

lowerings: dict = {}

FAMILIES = ("pointwise", "reduction", "pooling", "softmax", "views", "indexing", "comm", "matmul", "extern",
            "random", "attention")


def register(*ops, name: str | None = None, with_op: bool = False) -> Callable:
    """Register `fn` as the lowering of each op (an OpOverloadPacket means all its overloads).
    With `with_op`, an overload's lowering is `fn(overload, *args, **kwargs)`: a lowering shared by
    several ops is told which one it lowers."""
    def wrap(fn):
        for op in ops:
            overloads = ([getattr(op, o) for o in op.overloads()]
                         if isinstance(op, torch._ops.OpOverloadPacket) else [op])
            for ov in overloads:
                lowerings[ov] = functools.partial(fn, ov) if with_op else fn
        return fn
    return wrap


_loaded = False


def load_all() -> None:
    global _loaded
    if not _loaded:
        for fam in FAMILIES:
            importlib.import_module(f"{__name__}.{fam}")
        _loaded = True
