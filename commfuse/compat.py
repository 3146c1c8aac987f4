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


@functools.lru_cache(None)
def triton_has_dependent_launch() -> bool:
    """Programmatic dependent launch: `tl.extra.cuda.gdc_wait` in a kernel and the `launch_pdl`
    launch option (Triton >= 3.4, CUDA backend)."""
    try:
        import dataclasses

        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tl.extra, "cuda") and hasattr(tl.extra.cuda, "gdc_wait") and \
        "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


@functools.lru_cache(None)
def patch_interpreter_index() -> None:
    """Triton < 3.7's interpreter turns a scalar into a Python int (a `range()` bound that is a
    kernel argument) with `int()` of a 1-element 1-d array, which numpy >= 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"): every looped kernel fails under the
    interpreter. Triton 3.7 fixed it upstream; the GPU machines' triton 3.6 compiles kernels and
    never gets here. Patched here rather than pinned: a `triton>=3.7` requirement would conflict
    with torch 2.11's own `triton==3.6` pin, and no environment marker can tell interpreter from GPU."""
    import triton
    from triton.runtime import interpreter
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        # the scope restores in reverse order, so this is undone first and triton's own after it
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    interpreter._patch_lang_tensor = _patch_lang_tensor
