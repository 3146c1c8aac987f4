"""commfuse options.

Every option is a module attribute with a default, overridable by the environment
(`COMMFUSE_<NAME>`, upper case, read at import), by `config.patch(...)` (a context
manager and decorator), or per compile through `torch.compile(..., options={...})`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any

# Debugging and dumps.
debug = False                 # log each compiled graph's summary
dump_dir: str | None = None   # write per-rank dumps under this folder (COMMFUSE_DUMP_DIR)
fallback_on_error = True      # a graph we fail to compile runs through aten instead of raising

# Fusion.
max_fusion_size = 64          # cap on the number of IR nodes in one fused kernel
realize_reads_threshold = 4   # a value with more users than this is stored, not recomputed by each
realize_opcount_threshold = 30  # ... or whose body has more ops than this
realize_acc_reads_threshold = 8         # realize a pointwise value that inlines more buffer reads
realize_acc_reads_size_threshold: int | None = None  # ... or reads more bytes than this (None: off)

# Reductions.
persistent_reduction_max = 4096   # rows up to this length are reduced in one block
split_reduction_min = 32768       # reductions longer than this with few rows are split across programs

# Code generation.
triton_interpret: bool | None = None  # None: Triton's interpreter exactly when CUDA is absent (set at import)
max_block = 1024                       # largest pointwise block


def _coerce(value: str, default: Any) -> Any:
    if isinstance(default, bool) or default is None and value.lower() in ("0", "1", "true", "false"):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    if value.lower() == "none":
        return None
    if value.isdigit():
        return int(value)
    return value


def _options() -> dict[str, Any]:
    mod = sys.modules[__name__]
    return {k: v for k, v in vars(mod).items()
            if not k.startswith("_") and not callable(v) and not isinstance(v, type(sys))
            and k not in ("annotations",)}


def _load_env() -> None:
    mod = sys.modules[__name__]
    for name, default in _options().items():
        env = os.environ.get(f"COMMFUSE_{name.upper()}")
        if env is not None:
            setattr(mod, name, _coerce(env, default))


def get(name: str) -> Any:
    return getattr(sys.modules[__name__], name)


def snapshot() -> dict[str, Any]:
    return dict(_options())


class _Patch(contextlib.ContextDecorator):
    def __init__(self, changes: dict[str, Any]):
        known = _options()
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ValueError(f"unknown commfuse option(s) {unknown}; known: {sorted(known)}")
        self.changes = changes
        self.saved: list[dict[str, Any]] = []

    def __enter__(self):
        mod = sys.modules[__name__]
        self.saved.append({k: getattr(mod, k) for k in self.changes})
        for k, v in self.changes.items():
            setattr(mod, k, v)
        return self

    def __exit__(self, *exc):
        mod = sys.modules[__name__]
        for k, v in self.saved.pop().items():
            setattr(mod, k, v)
        return False


def patch(changes: dict[str, Any] | None = None, **kwargs: Any) -> _Patch:
    """`with config.patch(max_fusion_size=8): ...` or `@config.patch({"debug": True})`."""
    return _Patch({**(changes or {}), **kwargs})


_load_env()
