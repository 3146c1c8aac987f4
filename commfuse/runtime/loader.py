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
    """Re-wrap triton.language's own @jit functions (tl.sum, tl.zeros, ...) for the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    for mod in {tl, tl.standard, tl.math, tl.core}:
        for name, value in list(vars(mod).items()):
            if isinstance(value, JITFunction):
                setattr(mod, name, InterpretedFunction(value.fn))
    sys.modules.pop("commfuse.runtime.triton_helpers", None)  # re-decorated on next import


def _interpreter_asserts() -> None:
    """Our only device asserts are index bounds checks: let the interpreter raise them. Not its
    integer overflow checks, which debug mode also turns on: eager wraps (an int32 hash)."""
    import dataclasses
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    if not builder.options.debug or builder.options.sanitize_overflow:
        builder.options = dataclasses.replace(builder.options, debug=True, sanitize_overflow=False)


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
        compat.patch_interpreter_index()
    module = import_file(path, f"commfuse_generated_{key}")
    module.constants.update(constants)
    return module, path


def import_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
