"""Load a generated module from source: written to a cache file (Triton reads kernel
source from disk), imported, its constants installed."""
from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings

from .. import compat, config
from .interpret import interpreting


def cache_dir() -> str:
    """The folder generated modules are written to: the configured one, or, where that cannot be
    written, a temporary folder of this process's (the caches are then off: `persistent_cache_dir`)."""
    return persistent_cache_dir() or _scratch_dir()


_writable: dict[str, bool] = {}  # by folder: tried once, warned about once


def persistent_cache_dir() -> str | None:
    """The configured cache folder, None where it cannot be written (said once, in a warning)."""
    d = config.cache_dir or os.environ.get("COMMFUSE_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"commfuse_{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    if _writable.get(d) is False:
        return None
    try:
        os.makedirs(d, exist_ok=True)
        if d not in _writable:  # its mode bits do not say (root writes anyway): try
            fd, probe = tempfile.mkstemp(dir=d)
            os.close(fd)
            os.unlink(probe)
        _writable[d] = True
        return d
    except OSError as e:
        _writable[d] = False
        warnings.warn(f"commfuse: cannot write the cache folder {d} ({type(e).__name__}: {e.strerror or e}); the "
                      f"graph caches are off, generated modules go to {_scratch_dir()} (set cache_dir / "
                      "COMMFUSE_CACHE_DIR to a writable folder)", stacklevel=2)
        return None


@functools.lru_cache(None)
def _scratch_dir() -> str:
    d = tempfile.mkdtemp(prefix="commfuse_")
    atexit.register(shutil.rmtree, d, True)
    return d



def check_triton_mode(device_types: set) -> None:
    """CPU tensors need Triton's interpreter. Normally chosen when commfuse is imported; when
    triton was imported first (torch.compile imports it), switch its library over now."""
    if "cpu" not in device_types or interpreting():
        return
    import torch
    if torch.cuda.is_available():
        raise RuntimeError(
            "commfuse: this graph has CPU tensors, which need Triton's interpreter, but triton runs "
            "compiled for the GPU. Move the tensors to CUDA, or set TRITON_INTERPRET=1 before triton is imported.")
    os.environ["TRITON_INTERPRET"] = "1"
    _interpret_triton_library()


def _interpret_triton_library() -> None:
    """Triton picks compiled or interpreted for each @jit function when it is decorated (it reads
    TRITON_INTERPRET then), so functions decorated before the switch, triton's own library
    (tl.sum, tl.rand and the Philox helpers it calls) and ours, stay compiled and raise inside an
    interpreted kernel. Re-wrap every one held by a loaded triton or commfuse module, each once:
    the interpreter's reductions recognise triton's combine functions by identity."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    wrapped = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or name.partition(".")[0] not in ("triton", "commfuse"):
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(mod, attr, wrapped[id(value)])
    # its definitions differ under the interpreter: imported again when next asked for
    sys.modules.pop("commfuse.runtime.triton_helpers", None)
    vars(sys.modules[__package__]).pop("triton_helpers", None)


def _interpreter_asserts() -> None:
    """Our only device asserts are index bounds checks: let the interpreter raise them. Not its
    integer overflow checks, which debug mode also turns on: eager wraps (an int32 hash)."""
    import dataclasses
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    if not builder.options.debug or builder.options.sanitize_overflow:
        builder.options = dataclasses.replace(builder.options, debug=True, sanitize_overflow=False)


@functools.lru_cache(None)
def _interpreter_launches() -> None:
    """Interpreted launches take turns, in IEEE arithmetic without numpy's warnings.
    The interpreter's state is the process's: the builder's program id, and triton.language's
    builtins, which each launch patches on entry and restores on exit. Two threads launching at
    once ran one's kernel with the other's program ids, or with builtins already restored
    (Inductor's C++ kernels have no such state); with the GIL they never ran side by side anyway.
    numpy warns of what a GPU and eager torch compute silently: 0 / 0 or log(0) in lanes past a
    mask (loaded as 0) or in a where() branch not taken (Kahan's expm1 at 0), x / 0 = inf."""
    import threading

    import numpy as np
    from triton.runtime import interpreter
    launch, lock = interpreter.GridExecutor.__call__, threading.RLock()

    def serial_launch(self, *args, **kwargs):
        with lock, np.errstate(all="ignore"):
            return launch(self, *args, **kwargs)
    interpreter.GridExecutor.__call__ = serial_launch


@functools.lru_cache(None)
def _tree_reduce() -> None:
    """The interpreter runs `tl.reduce` with a combine function of ours (Welford's, max / min with
    NaNs, argmax, prod) one value of the block at a time: a Python call of the function per lane,
    about a millisecond each, 8 x 20000 of them for a std(0) (minutes). Combine neighbouring lanes of
    the whole block at once instead, halving the axis each step: log2 of it calls, in a GPU's tree
    order. Combine functions are associative, and the left operand still precedes the right
    (argmax's ties)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    if not hasattr(interpreter.ReduceOps, "generic_reduce"):
        return

    def generic_reduce(self, inputs):
        inputs, axis = self.unravel(inputs, self.axis)
        dtypes = [t.dtype for t in inputs]
        data = [np.moveaxis(t.handle.data, axis, -1) for t in inputs]
        while data[0].shape[-1] > 1:
            even = data[0].shape[-1] // 2 * 2
            out = self.combine_fn.fn(*(self.to_tensor(d[..., 0:even:2], t) for d, t in zip(data, dtypes)),
                                     *(self.to_tensor(d[..., 1:even:2], t) for d, t in zip(data, dtypes)))
            half = data[0][..., 0:even:2].shape  # a combined value may be a Python scalar
            data = [np.concatenate([np.broadcast_to(o.handle.data if isinstance(o, tl.tensor) else o, half)
                                    .astype(d.dtype), d[..., even:]], -1)
                    for o, d in zip(out if isinstance(out, tuple) else (out,), data)]
        ret = []
        for d, t in zip(data, dtypes):
            d = d[..., 0]
            if self.keep_dims:
                d = np.expand_dims(d, axis if self.axis is not None else 0)
            elif self.axis is None:
                d = d.item()
            ret.append(self.to_tensor(d, t))
        return ret
    interpreter.ReduceOps.generic_reduce = generic_reduce


def load_module(source: str, constants: dict):
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    path = os.path.join(cache_dir(), f"cf_{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    if interpreting():
        _interpreter_asserts()
        _interpreter_launches()
        _tree_reduce()
        compat.patch_interpreter_index()
    module = import_file(path, f"commfuse_generated_{key}")
    module.constants.update(constants)
    return module, path


def import_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
