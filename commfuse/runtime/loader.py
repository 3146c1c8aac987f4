"""Load a generated module from source: written to a cache file (Triton reads kernel
source from disk), imported, its constants installed."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile


def cache_dir() -> str:
    d = os.environ.get("COMMFUSE_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"commfuse_{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    os.makedirs(d, exist_ok=True)
    return d


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def check_triton_mode(device_types: set) -> None:
    """CPU tensors need Triton's interpreter, chosen before triton was imported."""
    if "cpu" in device_types and not interpreting():
        raise RuntimeError(
            "commfuse: this graph has CPU tensors, which need Triton's interpreter, but triton runs "
            "compiled. Set TRITON_INTERPRET=1 (or COMMFUSE_TRITON_INTERPRET=1) before triton is imported.")


def load_module(source: str, constants: dict):
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    path = os.path.join(cache_dir(), f"cf_{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    name = f"commfuse_generated_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.constants.update(constants)
    return module, path
