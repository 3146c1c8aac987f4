"""Differences between the supported torch / triton versions, in one place."""
from __future__ import annotations

import functools


@functools.lru_cache(None)
def triton_has_block_ptr() -> bool:
    """`tl.make_block_ptr` exists in triton 3.6 (the GPU machines); later versions removed it in
    favour of tensor descriptors and raise when it is called."""
    import inspect

    import triton.language as tl
    fn = getattr(tl, "make_block_ptr", None)
    return fn is not None and "removed" not in (inspect.getdoc(fn) or "")
